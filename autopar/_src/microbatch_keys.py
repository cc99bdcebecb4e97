"""A distinct PRNG key for every microbatch, where the loss draws values per example that
cannot be ``jax.jit``'s (:mod:`~autopar._src.microbatch_draws` makes the others).

A key the loss function reads from outside it (dropout's, split once per step) is one value
per step; run per microbatch unchanged, every microbatch would draw the same masks, the same
for each slice of the batch. With several microbatches, microbatch ``j > 0`` reads
``jax.random.fold_in(key, j)`` instead, made once per step by one op (:func:`fold_op`) on the
first stage that reads the key. Microbatch 0 reads the key itself, so what the loss derives
from it and returns (a split key, an RNG state) is what ``jax.jit`` returns: region outputs
that cannot be averaged are the first microbatch's (:mod:`~autopar._src.region_outputs`).

Only keys from which the loss draws something per example are folded
(:func:`drawing_per_example`: a draw whose shape differs between the step traced at one
microbatch and at the whole batch); a draw of the same shape for any batch (weight noise) is
one value per step, as under ``jax.jit``, and its key is left alone. Typed keys
(``jax.random.key``) are found by their dtype, raw ones (``jax.random.PRNGKey``'s ``uint32``
key data) by the ``random_wrap`` that reads them, directly, after a clone or slice (flax's
lifted ``nn.scan``/``nn.vmap`` clone a key before splitting it) or inside a nested body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from autopar._src import compat
from autopar._src.program import Op
from autopar._src.trace import TracedStep


@dataclasses.dataclass(frozen=True)
class Folded:
    """The per-microbatch keys of one key: ``var`` (tag ``j`` for microbatch ``j``)."""

    var: Any
    impl: str
    """For raw key data, its PRNG implementation's name (``"threefry2x32"``); empty if typed."""


DRAWING = frozenset({"random_bits", "random_gamma"})
"""Primitives that draw values from a key: bits, and gamma variates (one per element of their
shape parameter, the key split inside; ``jax.random.gamma``, ``beta``, ``dirichlet``, ``t``)."""


def drawing_per_example(step: TracedStep, whole: TracedStep) -> frozenset[int]:
    """Indices into the grad region's inputs of the values from which its loss draws random
    values per example: values that reach a draw (:data:`DRAWING`) whose shape differs in ``whole``
    (the step traced at the whole batch) from ``step``'s (at one microbatch)."""
    mine, theirs = (s.jaxpr.eqns[s.region_index()].params["info"].jaxpr for s in (step, whole))
    draws, whole_draws = _draws(mine), _draws(theirs)
    if len(draws) == len(whole_draws):
        per_example = {i for (i, a), (_, b) in zip(draws, whole_draws, strict=True) if a != b}
    else:  # code that changes with the batch size: every drawing equation may be
        per_example = {i for i, _ in draws}
    if not per_example:
        return frozenset()
    raw = _wrapped_raw(mine)
    found = set()
    for k, v in enumerate([*mine.constvars, *mine.invars]):
        if not (jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.prng_key) or v in raw):
            continue  # only keys can be folded
        reached = {v}
        for i, e in enumerate(mine.eqns):
            if any(not compat.is_literal(a) and a in reached for a in e.invars):
                if i in per_example:
                    found.add(k)
                    break
                reached.update(e.outvars)
    return frozenset(found)


def _draws(jaxpr: Any) -> list[tuple[int, tuple[int, ...]]]:
    """``(index of the top-level equation, shape)`` of every draw (:data:`DRAWING`) in ``jaxpr``,
    nested bodies included, in order."""
    found = []
    for i, e in enumerate(jaxpr.eqns):
        if e.primitive.name in DRAWING:
            found.append((i, tuple(e.outvars[0].aval.shape)))
        bodies = compat.bodies(e)
        while bodies:
            for inner in bodies.pop(0).eqns:
                if inner.primitive.name in DRAWING:
                    found.append((i, tuple(inner.outvars[0].aval.shape)))
                bodies += compat.bodies(inner)
    return found


def keys_to_fold(
    region_jaxpr: Any, rmap: Mapping[Any, Any], per_mb: set[Any], drawing: frozenset[int]
) -> dict[Any, Folded]:
    """The step's vars that the region reads as a PRNG key, that hold one value per step, and
    from which it draws per example (``drawing``: indices into the region's inputs, see
    :func:`drawing_per_example`)."""
    raw = _wrapped_raw(region_jaxpr)
    folded: dict[Any, Folded] = {}
    for k, (inner, outer) in enumerate(rmap.items()):
        if k not in drawing or compat.is_literal(outer) or outer in per_mb or outer in folded:
            continue
        if jax.dtypes.issubdtype(inner.aval.dtype, jax.dtypes.prng_key):
            folded[outer] = Folded(var=compat.Var(outer.aval), impl="")
        elif inner in raw:
            folded[outer] = Folded(var=compat.Var(outer.aval), impl=raw[inner])
    return folded


# Equations whose first operand's key data reaches their output unchanged in value or in part
# (flax's lifted transforms clone a key before splitting it).
_MOVES_KEY_DATA = frozenset(
    {"random_clone", "reshape", "squeeze", "expand_dims", "slice", "dynamic_slice", "copy", "copy_p"}
)


def _wrapped_raw(jaxpr: Any, outs: Mapping[Any, str] | None = None) -> dict[Any, str]:
    """The vars of ``jaxpr`` that hold raw key data, with their PRNG's name: those a
    ``random_wrap`` reads, directly, through equations that move key data (``random_clone``,
    slices, reshapes) or inside nested calls, ``scan`` loops and ``cond`` branches (e.g. a
    ``PRNGKey`` split in front of an ``nn.scan`` stack). ``outs``: outputs already known."""
    found = dict(outs or {})
    for e in reversed(jaxpr.eqns):
        name = e.primitive.name
        if name == "random_wrap":
            marks = {0: e.params["impl"].name}
        elif name in _MOVES_KEY_DATA:
            impl = found.get(e.outvars[0])
            marks = {0: impl} if impl is not None else {}
        else:
            marks = _through_bodies(e, found)
        for k, impl in marks.items():
            if not compat.is_literal(e.invars[k]):
                found.setdefault(e.invars[k], impl)
    return found


def _through_bodies(eqn: Any, found: Mapping[Any, str]) -> dict[int, str]:
    """Operand index -> PRNG name, for the operands of ``eqn`` that its bodies use as raw key
    data (bodies whose inputs and outputs map one to one onto the equation's, after a
    ``cond``'s index)."""
    marks: dict[int, str] = {}
    branches = compat.cond_branches(eqn)
    if branches is not None:
        mapped = [(b, 1) for b, consts in branches if not consts]
    else:
        mapped = [(b, 0) for b in compat.sub_jaxprs(eqn) if not b.constvars]
    for body, offset in mapped:
        if len(body.invars) != len(eqn.invars) - offset or len(body.outvars) != len(eqn.outvars):
            continue
        known = {
            b: found[o]
            for b, o in zip(body.outvars, eqn.outvars, strict=True)
            if o in found and not compat.is_literal(b)
        }
        inner = _wrapped_raw(body, known)
        for k, v in enumerate(body.invars):
            if v in inner:
                marks.setdefault(offset + k, inner[v])
    return marks


def fold_op(key: Any, folded: Folded, nmb: int) -> Op:
    """The op that makes every microbatch's key from ``key`` (once per step)."""
    outs = tuple((folded.var, j) for j in range(nmb))
    return Op(kind="acc", mode="fold", ins=((key, None),), outs=outs, key_impl=folded.impl)


def fold(key: Any, count: int, impl: str) -> list[Any]:
    """``key``, then ``fold_in(key, j)`` for ``0 < j < count`` (as key data if ``impl`` names raw
    keys' PRNG), each key of an array of keys (e.g. one per layer of a scanned stack) folded
    alike."""
    typed = jax.random.wrap_key_data(key, impl=impl) if impl else key
    flat = typed.reshape(-1)
    keys = [jax.vmap(jax.random.fold_in, (0, None))(flat, j).reshape(typed.shape) for j in range(1, count)]
    return [key, *(jax.random.key_data(k) for k in keys)] if impl else [key, *keys]
