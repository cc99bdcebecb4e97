"""Splitting a once-per-step ``cond`` into one ``cond`` per independent group of its results.

An optimizer wrapper such as ``optax.MultiSteps`` updates every parameter inside one ``cond``
(apply the accumulated update, or keep accumulating). As one equation it would run on one
stage, and every other stage's parameters, gradients and optimizer state would travel there
and back each step. Its results mostly depend on disjoint arrays, though: parameter ``i``'s
new moments and update read only parameter ``i``'s gradient and state, plus scalars (the
step counter, the learning rate). So each group of results that shares no array work becomes
its own ``cond`` over just the operands it reads, and the partitioner places each group on the
stage of its largest input, as it places any other equation.

Scalar work (every operand and result a scalar) is repeated in each group that needs it;
results that need a common non-scalar equation (say, a global norm's reduction) stay in one
group. A ``cond`` with effects is left whole.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax

from autopar._src import compat


def _is_array_work(eqn: Any) -> bool:
    """Whether an equation reads or makes a non-scalar (it is not cheap to repeat)."""
    atoms = [*eqn.invars, *eqn.outvars]
    return any(not compat.is_literal(a) and getattr(a.aval, "shape", ()) != () for a in atoms)


def _needers(jaxpr: Any, label: Sequence[int]) -> tuple[list[set[int]], dict[Any, set[int]]]:
    """One backward pass over ``jaxpr``: for each equation, and for each var read, the labels
    (``label[k]`` for result ``k``) of the results that need it."""
    needers: dict[Any, set[int]] = {}
    for k, v in enumerate(jaxpr.outvars):
        if not compat.is_literal(v):
            needers.setdefault(v, set()).add(label[k])
    per_eqn: list[set[int]] = [set() for _ in jaxpr.eqns]
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        per_eqn[i] = need = set().union(*(needers.get(v, ()) for v in eqn.outvars))
        for a in eqn.invars:
            if need and not compat.is_literal(a):
                needers.setdefault(a, set()).update(need)
    return per_eqn, needers


def output_groups(branches: Sequence[Any]) -> list[list[int]]:
    """Results of a ``cond`` (one open jaxpr per branch) grouped so that no two groups share
    array work in any branch; each group in increasing order, groups by their first result."""
    n = len(branches[0].outvars)
    parent = list(range(n))

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for jaxpr in branches:
        per_eqn, _ = _needers(jaxpr, range(n))
        for eqn, need in zip(jaxpr.eqns, per_eqn, strict=True):
            if need and _is_array_work(eqn):
                first = min(need)
                for k in need:
                    parent[find(k)] = find(first)
    groups: dict[int, list[int]] = {}
    for k in range(n):
        groups.setdefault(find(k), []).append(k)
    return sorted(groups.values())


def _run_part(
    jaxpr: Any,
    consts: Sequence[Any],
    eqns: Sequence[int],
    used: Sequence[int],
    outputs: Sequence[int],
    *args: Any,
) -> list[Any]:
    """Evaluates the equations ``eqns`` of ``jaxpr`` on its operands ``used`` (``args``);
    returns its results ``outputs``."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update((jaxpr.invars[p], x) for p, x in zip(used, args, strict=True))

    def read(a: Any) -> Any:
        return compat.literal_value(a) if compat.is_literal(a) else env[a]

    for i in eqns:
        eqn = jaxpr.eqns[i]
        outs = compat.bind_eqn(eqn, [read(a) for a in eqn.invars])
        env.update((v, x) for v, x in zip(eqn.outvars, outs, strict=True) if not compat.is_dropvar(v))
    return [read(jaxpr.outvars[k]) for k in outputs]


def _inlined(jaxpr: Any, consts: Sequence[Any]) -> tuple[Any, list[Any]]:
    """A branch with its nested ``jit`` calls inlined (and its own ``cond``s split), so that a
    call over many parameters' leaves (as optax makes) does not tie their results together."""
    from autopar._src import layers

    avals = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in jaxpr.invars
    ]
    flat = jax.make_jaxpr(lambda *xs: layers.inline_calls(jaxpr, consts, xs, split_conds=True))(*avals)
    return compat.jaxpr_and_consts(flat)


def split_cond(eqn: Any, invals: Sequence[Any]) -> list[Any] | None:
    """``eqn``'s results computed by one ``cond`` per group of :func:`output_groups` (use under
    tracing); None when ``eqn`` is not a ``cond``, has effects, or its results form one group."""
    branches = compat.cond_branches(eqn)
    if branches is None or eqn.effects:
        return None
    branches = [_inlined(*b) for b in branches]
    jaxprs = [b for b, _ in branches]
    groups = output_groups(jaxprs)
    if len(groups) < 2:
        return None
    index, operands = invals[0], invals[1:]
    label = [0] * len(eqn.outvars)  # result -> its group
    for g, group in enumerate(groups):
        for k in group:
            label[k] = g
    kept: list[list[list[int]]] = []  # [branch][group] -> equation indices, in order
    used: list[set[int]] = [set() for _ in groups]  # [group] -> operand positions read
    for jaxpr in jaxprs:
        per_eqn, needers = _needers(jaxpr, label)
        kept.append([[] for _ in groups])
        for i, need in enumerate(per_eqn):
            for g in need:
                kept[-1][g].append(i)
        for p, v in enumerate(jaxpr.invars):
            for g in needers.get(v, ()):
                used[g].add(p)
    results: list[Any] = [None] * len(eqn.outvars)
    for g, group in enumerate(groups):
        reads = sorted(used[g])
        fns = [
            functools.partial(_run_part, jaxpr, consts, kept[b][g], reads, group)
            for b, (jaxpr, consts) in enumerate(branches)
        ]
        outs = jax.lax.switch(index, fns, *[operands[p] for p in reads])
        for k, x in zip(group, outs, strict=True):
            results[k] = x
    return results
