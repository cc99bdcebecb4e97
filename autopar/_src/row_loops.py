"""Python loops over the batch's rows, followed row by row.

``jnp.stack([f(row) for row in x])`` traces one chain of equations per row: ``jax`` takes each
row by a slice (or, from 0.12, all of them by one ``unstack``) and puts the results back by a
concatenation (or ``stack``). The step traced at one microbatch and at the whole batch differ
there in more than shapes, so the checks that compare them equation by equation pair them around
it (:func:`~autopar._src.twin_traces.twin_equations`) and cannot tell a row's own slice from a
pick by place. This module follows each row taken one by one instead: what is made from one row
alone stays that row's; put back in its place, with all the others in order, the rows are the
batch's again. A value made from two rows (``rows[i] + rows[i - 1]``), from a row and the batch,
or rows put back out of order or not at all, combine examples by their positions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Any

from autopar._src import compat, twin_traces

_Row = tuple[int, int]
"""A row taken one by one: its index along the batch, and the count of rows it is one of (rows of
the same index taken from two values, ``zip(x, y)``, are the same example's)."""


def mixing_rows(eqns: Sequence[Any], dims: dict[Any, set[int]], needed: Set[Any]) -> Any:
    """The first equation of ``eqns`` that combines rows taken one by one with others, or puts
    them back out of their places (None if there is none). ``dims``: the per-example dims of the
    values known to have them (grown here by the rows put back); ``needed``: the values the rest
    of the step reads, which must not be single rows."""
    rows: dict[Any, _Row] = {}
    for e in eqns:
        taken = _taken(e, dims)
        if taken is not None:
            rows.update(taken)
            continue
        mine = {rows[a] for a in e.invars if not compat.is_literal(a) and a in rows}
        if not mine:
            continue
        put = _put_back(e, rows)
        if put is not None:
            dims[e.outvars[0]] = {put}
            continue
        others = [a for a in e.invars if not compat.is_literal(a) and a not in rows and dims.get(a)]
        if len(mine) > 1 or others:
            return e
        rows.update((v, *mine) for v in e.outvars if not compat.is_dropvar(v))
    return next((e for e in eqns if any(v in rows and v in needed for v in e.outvars)), None)


def _taken(e: Any, dims: Mapping[Any, Set[int]]) -> dict[Any, _Row] | None:
    """The rows ``e`` takes one by one from a value along its per-example dim: an ``unstack``'s
    results, or a slice one row wide."""
    if not e.invars or compat.is_literal(e.invars[0]):
        return None
    operand = e.invars[0]
    along = dims.get(operand, set())
    shape = twin_traces.shape_of(operand)
    name = e.primitive.name
    if name == "unstack" and e.params["axis"] % len(shape) in along:
        return {v: (i, len(e.outvars)) for i, v in enumerate(e.outvars)}
    if name != "slice" or len(along) != 1:
        return None
    (d,) = along
    start, limit = e.params["start_indices"][d], e.params["limit_indices"][d]
    strides = e.params["strides"] or (1,) * len(shape)
    if limit - start != 1 or strides[d] != 1 or shape[d] == 1:  # one row of one: the whole dim
        return None
    return {e.outvars[0]: (start, shape[d])}


def _put_back(e: Any, rows: Mapping[Any, _Row]) -> int | None:
    """The dim along which ``e`` stacks or concatenates all the rows, each in its place; None for
    another equation."""
    name = e.primitive.name
    if name not in ("stack", "concatenate"):
        return None
    parts = [None if compat.is_literal(a) else rows.get(a) for a in e.invars]
    if parts != [(i, len(parts)) for i in range(len(parts))]:
        return None
    return e.params["axis"] if name == "stack" else e.params["dimension"]
