"""How a gradient is made as partial sums: the chains that deferred reductions keep stacked.

A gradient is a *chain*: an equation whose local result is a partial sum when a contracted
dim is split (:data:`PARTIAL_SUM_PRIMITIVES`), then linear equations, each read only by the
next, up to the value summed over the microbatches. :func:`gradient_chains` finds them in a
stage's tasks, for the driver (:mod:`autopar._src.deferred`) and a stage's ILP;
:func:`graph_chains` in one microbatch's expanded equations, for the stage DP's costs. Both
follow a chain out of nested ``jit`` and rematerialised calls and out of a ``scan``'s stacked
results, naming the values inside as the sharding ILP does
(:class:`~autopar._src.strategy_graph.Inner`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from autopar._src import compat
from autopar._src.program import Task
from autopar._src.strategy_graph import GraphOp, Inner

SCATTER_ADD = frozenset({"scatter-add", "scatter_add"})
"""A ``scatter-add``'s primitive name (JAX versions spell it either way)."""
SCATTER_UPDATES = 2
"""A ``scatter-add``'s updates operand (after the operand and the indices)."""
PARTIAL_SUM_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated", "reduce_sum"}) | SCATTER_ADD
"""Primitives whose result on local blocks is a partial sum of the result's block when a
contracted (or reduced) dim is split: applied to every device's blocks and summed, they give
the whole result. A ``scatter-add`` is one only into zeros (:func:`sums_partials`): an
embedding's gradient, the transpose of its lookup, scatters each device's rows of the batch."""
ADDS = frozenset({"add_any", "add"})
"""Additions: of two partial sums over the same axes, a partial sum (see :func:`joins`)."""
LINEAR_PRIMITIVES = frozenset({"convert_element_type", "transpose", "copy", "copy_p", "reshape"})
"""One-operand primitives that may be applied to each partial sum instead of to their sum."""


Path = list[tuple[Any, int]]
"""``(name, stacked dim position)`` from a partial sum's root to a gradient."""


class Chain(NamedTuple):
    """How a gradient is made as partial sums (see :func:`gradient_chains`)."""

    root: Any
    """The value of the equation that makes the partial sums."""
    links: list[Any]
    """The values of the linear equations (and calls) from it, in order."""
    total: Any
    """The value that sums the last one over the microbatches (or, in one microbatch's
    equations, the gradient)."""
    at: dict[Any, int]
    """The stacked dim's position (:attr:`~autopar._src.deferred.Stacked.at`) of each link and
    the total."""


def gradient_chains(
    tasks: Sequence[Task],
    stage: int,
    is_partial: Callable[[Any], bool],
    *,
    through_scatters: bool = False,
    whole_batch: bool = False,
) -> list[Chain]:
    """The :class:`Chain` of every gradient of ``stage`` that is made as partial sums: its root
    by an equation of :data:`PARTIAL_SUM_PRIMITIVES` (for which ``is_partial`` holds for its
    variable), its links by linear equations from it, the last one the value the accumulator
    (the total) adds. The chain may pass out of nested ``jit`` and rematerialised calls (a
    rematerialised block's weight gradients are made inside its backward call) and out of a
    ``scan`` as a stacked result (a scanned layer stack's): their values are named
    :class:`~autopar._src.strategy_graph.Inner` as the ILP names them, and the call's result
    is a link. A ``scatter-add`` into zeros is a root where ``is_partial`` holds for it (and
    ``through_scatters`` is off), and otherwise a link, linear in its updates (a position
    embedding's gradient scatters a sum over the batch).

    With ``whole_batch``, a step of one microbatch, whose region outputs are its values as they
    are, gives the chains of those values too (their total is the output), for pricing."""

    def descend(eqn: Any, index: int) -> tuple[list[Path], int] | None:
        return _call_chain(eqn, index, (), is_partial, through_scatters)

    chains: list[Chain] = []
    for task in tasks:
        if task.stage != stage:
            continue
        adds = [
            op
            for op in task.ops
            if op.kind == "acc"
            and (op.mode == "add" or (whole_batch and op.mode == "copy" and op.out[1] is None))
        ]
        made = {
            k: (op.eqn, op.ins, index)
            for op in task.ops
            if op.kind == "eqn"
            for index, k in enumerate(op.outs)
            if k is not None
        }
        reads = Counter(k for op in task.ops if op not in adds for k in op.ins if isinstance(k, tuple))
        reads.update(task.out_keys)
        for op in adds:  # the running sum, then the values it adds
            for value in op.ins[1:] if op.mode == "add" else op.ins:
                paths = _partial_chain(
                    value, made, reads, 0, is_partial, descend, lambda k: k[0], through_scatters
                )
                chains.extend(_chain(path, op.out[0]) for path in paths or ())
    return chains


def _chain(names: Path, total: Any) -> Chain:
    at = dict(names[1:])
    at[total] = names[-1][1]
    return Chain(names[0][0], [name for name, _ in names[1:]], total, at)


def graph_chains(
    ops: Sequence[GraphOp],
    grads: Iterable[Any],
    loops: frozenset[int] = frozenset(),
    *,
    through_scatters: bool = False,
) -> list[Chain]:
    """:func:`gradient_chains` of one microbatch's equations (named values, calls expanded, see
    :class:`~autopar._src.strategy_graph.GraphOp`), for the gradients ``grads`` (each chain's
    total). Chains through values inside the loops or
    branches ``loops`` (the ids of their equations, see :func:`loop_ids`) are left out: the
    driver reduces those gradients each microbatch."""
    made = {
        out: (op.eqn, op.ins, index) for op in ops for index, out in enumerate(op.outs) if out is not None
    }
    reads = Counter(name for op in ops for name in op.ins if name is not None)
    chains: list[Chain] = []
    for g in grads:
        paths = _partial_chain(
            g, made, reads, 0, lambda name: True, lambda eqn, index: None, through=through_scatters
        )
        if paths and not any(
            isinstance(name, Inner) and loops.intersection(name.path) for path in paths for name, _ in path
        ):
            chains.extend(_chain(path, g) for path in paths)
    return chains


def loop_ids(jaxpr: Any) -> frozenset[int]:
    """The ids of the ``while`` and ``cond`` equations in ``jaxpr`` and the calls in it."""
    found: set[int] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("while", "cond"):
            found.add(id(eqn))
        for body in compat.sub_jaxprs(eqn):
            found |= loop_ids(body)
    return frozenset(found)


def _partial_chain(
    name: Any,
    made: Mapping[Any, tuple[Any, Sequence[Any], int]],
    reads: Mapping[Any, int],
    first_reads: int,
    is_partial: Callable[[Any], bool],
    descend: Callable[[Any, int], tuple[list[Path], int] | None],
    name_of: Callable[[Any], Any] = lambda name: name,
    through: bool = False,
) -> list[Path] | None:
    """The paths from partial-sum equations' results to ``name`` (read ``first_reads``
    times), each link read only by the next; None if there are none. An addition of two values
    (a tied weight's two uses) joins a path from each, and only both are paths. ``made`` maps a
    value to its equation, operands and result index; ``descend(eqn, index)`` is the paths
    inside a call whose ``index``-th result is a link, and how many dims the call puts before
    the stacked one, if any. With ``through``, a ``scatter-add`` into zeros is only ever a
    link."""
    chain: list[Any] = []

    def tail(at: int) -> Path:
        return [(n, at) for n in reversed(chain)]

    while name is not None and not compat.is_literal(name) and name in made:
        if reads.get(name, 0) != (1 if chain else first_reads):
            return None
        eqn, ins, index = made[name]
        chain.append(name_of(name))
        scatter = eqn.primitive.name in SCATTER_ADD
        if sums_partials(eqn, ins, made) and is_partial(chain[-1]) and not (through and scatter):
            return [tail(0)]
        inside = descend(eqn, index)
        if inside is not None:
            inner, lift = inside
            return [path + tail(path[-1][1] + lift) for path in inner]
        if joins(eqn, ins):
            branches = [_partial_chain(x, made, reads, 1, is_partial, descend, name_of, through) for x in ins]
            paths = [path for branch in branches if branch is not None for path in branch]
            ats = {path[-1][1] for path in paths}
            if None in branches or len(ats) != 1:
                return None
            at = ats.pop()
            return [path + tail(at) for path in paths]
        if scatter and sums_partials(eqn, ins, made):
            name = ins[SCATTER_UPDATES]
        elif linear_link(eqn, ins):
            name = ins[0]
        else:
            return None
    return None


def every_chain(find: Callable[[bool], list[Chain]]) -> list[Chain]:
    """The chains some layout makes, for pricing: ``find(through_scatters)`` (a
    :func:`gradient_chains` or :func:`graph_chains` that admits any root) with each
    ``scatter-add`` into zeros as a root (its updates split over the scattered rows), and
    also as a link to the root before it (its updates summed over the batch first)."""
    chains = find(False)
    roots = {c.root for c in chains}
    return chains + [c for c in find(True) if c.root not in roots]


def linked_operands(eqn: Any) -> tuple[int, ...]:
    """The operands a chain's link ``eqn`` is linear in: a ``scatter-add``'s updates (into
    zeros, see :func:`sums_partials`), both of an addition, the only one of the others."""
    if eqn.primitive.name in SCATTER_ADD:
        return (SCATTER_UPDATES,)
    return (0, 1) if eqn.primitive.name in ADDS else (0,)


def joins(eqn: Any, ins: Sequence[Any]) -> bool:
    """Whether ``eqn`` adds two values of its result's shape (what differentiation makes of a
    value used twice)."""
    return (
        eqn.primitive.name in ADDS
        and len(ins) == 2
        and all(x is not None and not compat.is_literal(x) for x in ins)
        and all(v.aval.shape == eqn.outvars[0].aval.shape for v in eqn.invars)
    )


def sums_partials(eqn: Any, ins: Sequence[Any], made: Mapping[Any, tuple[Any, Sequence[Any], int]]) -> bool:
    """Whether ``eqn`` (operands ``ins``, made as ``made`` says) gives partial sums on local
    blocks: one of :data:`PARTIAL_SUM_PRIMITIVES`, a ``scatter-add`` only into zeros that
    ``made`` shows (every device adds its scattered rows to its own copy of the operand, so
    the operand must add nothing)."""
    name = eqn.primitive.name
    if name not in PARTIAL_SUM_PRIMITIVES or (name == "reduce_sum" and _keeps_size(eqn)):
        return False  # (a sum over unit dims is a reshape: a link)
    if name not in SCATTER_ADD:
        return True
    operand = None if ins[0] is None or compat.is_literal(ins[0]) else made.get(ins[0])
    return operand is not None and _zeros(operand[0])


def _zeros(eqn: Any) -> bool:
    """Whether ``eqn`` broadcasts the literal 0."""
    if eqn.primitive.name != "broadcast_in_dim" or not compat.is_literal(eqn.invars[0]):
        return False
    return not np.any(np.asarray(compat.literal_value(eqn.invars[0])))


def linear_link(eqn: Any, ins: Sequence[Any]) -> bool:
    """Whether ``eqn`` is a one-operand equation that may be applied to each partial sum: one
    of :data:`LINEAR_PRIMITIVES`, or a broadcast or sum that only adds or drops unit dims."""
    if len(ins) != 1:
        return False
    if eqn.primitive.name in ("broadcast_in_dim", "reduce_sum"):
        return _keeps_size(eqn)
    return eqn.primitive.name in LINEAR_PRIMITIVES


def _keeps_size(eqn: Any) -> bool:
    """Whether ``eqn``'s first result has as many elements as its first operand."""
    return math.prod(eqn.invars[0].aval.shape) == math.prod(eqn.outvars[0].aval.shape)


def _call_chain(
    eqn: Any, index: int, path: tuple[int, ...], is_partial: Callable[[Any], bool], through: bool
) -> tuple[list[Path], int] | None:
    """The paths that end at result ``index`` of ``eqn`` inside its body, and the dims the
    equation puts before the stacked dim (a ``scan``'s stacked result: 1), for a nested
    ``jit`` or rematerialised call or a ``scan``'s stacked result; None for other equations
    and results, or if there is none."""
    loop = compat.scan_loop(eqn)
    body = None if loop is not None and index < loop.num_carry else compat.inlinable_body(eqn)
    if body is None:
        return None
    here = (*path, id(eqn))
    made = {
        Inner(here, v): (e, [None if compat.is_literal(a) else Inner(here, a) for a in e.invars], k)
        for e in body.eqns
        for k, v in enumerate(e.outvars)
        if not compat.is_dropvar(v)
    }
    reads = Counter(Inner(here, a) for e in body.eqns for a in e.invars if not compat.is_literal(a))
    reads.update(Inner(here, v) for v in body.outvars if not compat.is_literal(v))
    out = body.outvars[index]
    if compat.is_literal(out):
        return None

    def descend(inner_eqn: Any, k: int) -> tuple[list[Path], int] | None:
        return _call_chain(inner_eqn, k, here, is_partial, through)

    paths = _partial_chain(Inner(here, out), made, reads, 1, is_partial, descend, through=through)
    return None if paths is None else (paths, int(loop is not None))
