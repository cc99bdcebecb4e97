"""The step traced at one microbatch and at the whole batch, side by side.

The microbatch checks (:mod:`~autopar._src.example_mixing`, :mod:`~autopar._src.example_order`,
:mod:`~autopar._src.output_checks`) compare the two traces equation by equation: a dim
``num_microbatches`` times longer at the whole batch is per example. This module pairs the
equations, finds the per-example dims, and follows the batch's integers.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence, Set
from typing import Any

import jax
import numpy as np

from autopar._src import compat, fusion, layers
from autopar._src.strategies import ELEMENTWISE_PRIMITIVES


def twin_equations(mine: Sequence[Any], theirs: Sequence[Any], nmb: int) -> dict[int, Any]:
    """``id`` of each equation of ``mine`` (traced at one of ``nmb`` microbatches) -> its twin in
    ``theirs`` (at the whole batch). Where the two differ in more than shapes (a three-operand
    ``jnp.einsum``, whose contraction order depends on the sizes; a Python loop over chunks of
    the batch), the longest runs of alike equations are paired, each pair's values alike but for
    dims ``nmb`` times longer, and the others have no twin: the checks pass over them."""

    def key(e: Any) -> tuple[str, int, int]:
        return e.primitive.name, len(e.invars), len(e.outvars)

    a, b = [key(e) for e in mine], [key(e) for e in theirs]
    if a == b:
        return dict(zip(map(id, mine), theirs, strict=True))
    blocks = difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks()
    pairs = ((mine[m.a + k], theirs[m.b + k]) for m in blocks for k in range(m.size))
    return {id(q): r for q, r in pairs if _alike(q, r, nmb)}


def reading_twins(e: Any, other: Any, twins: dict[Any, Any]) -> Any:
    """``other``, ``e``'s twin equation (or None), reading the twins of ``e``'s operands where
    ``twins`` knows them; records ``e``'s results' twins where ``other`` read those already. The
    pairing around differences between the traces may put ``e`` against an equation that reads
    other values (another level of an associative scan, whose depth follows the batch: the
    derivative of ``cummax``): then ``e``'s operands are read against their own twins."""
    if other is None:
        return None
    known = [None if compat.is_literal(a) else twins.get(a) for a in e.invars]
    if all(k is None or k is b for k, b in zip(known, other.invars, strict=True)):
        twins.update(
            (v, w) for v, w in zip(e.outvars, other.outvars, strict=True) if not compat.is_dropvar(v)
        )
        return other
    return other.replace(invars=[b if k is None else k for k, b in zip(known, other.invars, strict=True)])


def _alike(q: Any, r: Any, nmb: int) -> bool:
    for v, w in zip([*q.invars, *q.outvars], [*r.invars, *r.outvars], strict=True):
        x, y = shape_of(v), shape_of(w)
        if len(x) != len(y) or any(i != j and i * nmb != j for i, j in zip(x, y, strict=True)):
            return False
    return True


def feeding_values(jaxpr: Any, roots: Sequence[Any], statistics: Set[Any] = frozenset()) -> set[Any]:
    """The values of ``jaxpr`` that ``roots`` (some of its values) are made from, but for what
    only makes ``statistics``, the roots among them."""
    needed = {v for v in roots if not compat.is_literal(v)} - set(statistics)
    for e in reversed(jaxpr.eqns):
        if layers.is_boundary(e):  # an identity per value
            pairs = zip(e.invars, e.outvars, strict=True)
            needed.update(
                a for a, v in pairs if v in needed and not compat.is_literal(a) and a not in statistics
            )
        elif any(v in needed for v in e.outvars if not compat.is_dropvar(v)):
            needed.update(a for a in e.invars if not compat.is_literal(a) and a not in statistics)
    return needed


def feeding_outputs(jaxpr: Any, statistics: Set[Any] = frozenset()) -> set[int]:
    """The ids of the equations of ``jaxpr`` that its outputs are made from, but for what only
    makes ``statistics``."""
    needed = {v for v in jaxpr.outvars if not compat.is_literal(v)} - set(statistics)
    used = set()
    for e in reversed(jaxpr.eqns):
        if any(v in needed for v in e.outvars if not compat.is_dropvar(v)):
            used.add(id(e))
            needed.update(a for a in e.invars if not compat.is_literal(a) and a not in statistics)
    return used


KEEPING_PRIMITIVES = ELEMENTWISE_PRIMITIVES | fusion.LAYOUT_PRIMITIVES | {"broadcast_in_dim"}
"""Primitives that keep a fill the same along the batch, and an index what it numbers."""


def read_from_the_batch(eqns: Sequence[Any], seeds: Set[Any]) -> frozenset[Any]:
    """The integers ``eqns`` make from ``seeds`` (the batch's integer leaves) by elementwise and
    layout equations alone, through calls too: ``jnp``'s wrapping of negative indices, ``[:,
    None]``, a choice between them and others (``jnp.where(p >= 0, p, jnp.arange(n))``). Indices
    among them are positions the data pipeline numbered over the whole batch (a partner
    example's row); mixed with an ``iota`` along the batch (``jnp.arange(n)[:, None] * T +
    positions``) or computed from the examples' values they are the microbatch's own."""
    found = set(seeds)
    for e in eqns:
        operands = [a for a in e.invars if not compat.is_literal(a)]
        body = compat.operand_body(e)
        if body is not None and any(a in found for a in operands):
            inner = read_from_the_batch(
                body.eqns, {v for a, v in zip(e.invars, body.invars, strict=True) if a in found}
            )
            found.update(v for b, v in zip(body.outvars, e.outvars, strict=True) if b in inner)
        elif body is None and reads_the_batch(e, found):
            found.update(v for v in e.outvars if whole_number(v))
    return frozenset(found)


_CHOICES = {"select_n": slice(1, None), "max": slice(None), "min": slice(None), "clamp": slice(1, 2)}
"""Primitives whose result is one of some operands' values, and which operands those are."""


def reads_the_batch(e: Any, found: Set[Any]) -> bool:
    """Whether ``e``'s integer results are read from the batch, ``found`` being what is: made from
    it alone by an elementwise or layout equation, or chosen among its values and others."""
    name = e.primitive.name
    operands = [a for a in e.invars if not compat.is_literal(a)]
    if name in _CHOICES and any(not compat.is_literal(a) and a in found for a in e.invars[_CHOICES[name]]):
        return True
    return bool(operands) and name in KEEPING_PRIMITIVES and all(a in found for a in operands)


def of_kind(v: Any, *kinds: Any) -> bool:
    """Whether ``v``'s dtype is of one of ``kinds`` (``np.integer``, ``np.floating``, ...)."""
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    return dtype is not None and any(jax.dtypes.issubdtype(dtype, k) for k in kinds)


def whole_number(v: Any) -> bool:
    return of_kind(v, np.integer, np.bool_)


STATIC_ELEMENTS = 1 << 20
"""Values of at most this many elements made from no input are evaluated to check them."""


def static_value(v: Any, producer: Mapping[int, Any], known: dict[Any, Any], depth: int = 0) -> Any:
    """``v``'s value, computed from literals and the ``known`` values (updated with what is
    computed) by the equations ``producer`` gives (by ``id`` of what they make), or None where it
    reads anything else (or is too large to evaluate)."""
    if compat.is_literal(v):
        return compat.literal_value(v)
    if v in known:
        return known[v]
    e = producer.get(id(v))
    if e is None or depth > 64 or np.prod(shape_of(v)) > STATIC_ELEMENTS:
        return None
    ins = [static_value(a, producer, known, depth + 1) for a in e.invars]
    if any(x is None for x in ins):
        return None
    try:
        outs = compat.bind_eqn(e, ins)
    except Exception:  # noqa: BLE001 - a primitive that cannot run on values here: not known
        return None
    known.update(zip(e.outvars, outs, strict=True))
    return known[v]


def shape_of(v: Any) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def per_example_dims(v: Any, w: Any, nmb: int) -> set[int]:
    """The dims of ``v`` that are ``nmb`` times longer in ``w``, its whole batch's twin."""
    a, b = shape_of(v), shape_of(w)
    if len(a) != len(b):
        return set()
    return {d for d, (x, y) in enumerate(zip(a, b, strict=True)) if x != y and x * nmb == y}
