"""Loops over the examples that carry one example's values into another's.

A ``scan`` whose trip count follows the batch runs over the examples (or chunks of them): with
microbatches each microbatch's loop starts afresh from the carries' initial values. That is
``jax.jit``'s result where no iteration reads what an earlier one made from its examples: a
counter, a sum (or max, min) carried to the end alone (a reduction, which the loss's checks
follow), a buffer written row by row, each row from itself. It is not where a carry made from
the examples reaches the next iteration's results (a recurrence along time-major data split along
its time dim, a running sum read per row), where one is carried to the end through a nonlinear
update (an RNN's final state), or where an iteration reads or writes the examples' rows at
different rows (``a.at[i].set(f(a[i - 1]))``, ``x[i] * x[i - 1]``): :func:`carries_examples_on`
finds those by the loop's form. What the form does not show (a linear update carried to the end
other than a sum, as an exponential moving average's, rows read through nested ``jit``s, a key
split per row, ``while`` loops) is found by running the loop (:mod:`~autopar._src.loop_restarts`).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Any

import numpy as np

from autopar._src import carry_updates, compat, dependence, loop_restarts, twin_traces

_TRIES = 3
"""How many of the counter's values a buffer's read and written rows are compared at."""


def carries_examples_on(
    e: Any,
    other: Any,
    nmb: int,
    live: Set[Any] | None = None,
    values: tuple[loop_restarts.Values, loop_restarts.Values] | None = None,
) -> bool:
    """Whether ``e`` is a ``scan`` over the examples (``other``, its twin at the whole batch, runs
    more often) that carries what it made from some examples into what it makes for others (see
    the module's docstring), or to its end through a nonlinear update (an RNN's final state; a
    linear one, as a running mean's, is left to the loss's checks). ``live``: the values read on
    the way to the loss function's own outputs, where ``e`` is differentiated (None: all): the
    stacked results the backward alone reads (a differentiated loop's residuals, such as its
    carries' values) do not count, nor a loop of the backward (which moves cotangents between
    carries as the forward moved values). What the form does not tell (a ``while`` loop, an
    exponential moving average, a key split per row) is found by running the loop
    (:func:`~autopar._src.loop_restarts.restart_differs`; ``values``: its operands' made from no
    input)."""
    if live is not None and not any(v in live for v in e.outvars):
        return False  # the backward's (it mirrors the forward's loop)
    if loop_restarts.counts_batch(e, other, nmb):
        return loop_restarts.restart_differs(e, other, nmb, live, values)
    loop, theirs = compat.scan_loop(e), compat.scan_loop(other)
    if loop is None or theirs is None or theirs.length == loop.length:
        return False
    rows = [
        set() if compat.is_literal(a) else twin_traces.per_example_dims(a, b, nmb)
        for a, b in zip(e.invars, other.invars, strict=True)
    ]
    per_example = [bool(d) for d in rows]
    if _rows_apart(loop, e.invars, dict(zip(loop.body.invars, rows, strict=True))):
        return True
    seeds = {v for v, f in zip(loop.body.invars, per_example, strict=True) if f}
    while True:  # the carries made from the examples, grown over iterations
        made_from_examples = _reached(loop.body, seeds)
        grown = {
            loop.body.invars[loop.num_consts + k] for k in range(loop.num_carry) if made_from_examples[k]
        } - seeds
        if not grown:
            break
        seeds |= grown
    links = carry_updates.Links(loop.body.eqns)
    for k in range(loop.num_carry):
        carried = loop.body.invars[loop.num_consts + k]
        if not made_from_examples[k]:
            continue
        kind = carry_updates.update(loop.body.outvars[k], carried, links)[0]
        if kind == "same":
            continue
        if twin_traces.per_example_dims(e.outvars[k], other.outvars[k], nmb):
            continue  # a buffer of the examples' rows: its reads and writes are _rows_apart's
        if kind == "other" and (live is None or e.outvars[k] in live) and _nonlinear(loop.body, carried):
            return True  # carried to the end through a nonlinear update: an RNN's final state
        reached = _reached(loop.body, {carried})
        if any(
            r and (j < loop.num_carry or live is None or e.outvars[j] in live)
            for j, r in enumerate(reached)
            if j != k
        ):
            return True
    return loop_restarts.restart_differs(e, other, nmb, live, values)


_LINEAR = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "neg",
        "convert_element_type",
        "copy",
        "copy_p",
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "transpose",
        "slice",
        "concatenate",
        "reduce_sum",
        "select_n",
        "dynamic_slice",
        "pad",
    }
)
"""Primitives linear in each operand (``select_n`` in its cases)."""


def _nonlinear(body: Any, carried: Any) -> bool:
    """Whether ``body`` makes anything from ``carried`` other than linearly: a ``tanh`` of it,
    a product of two values made from it. A running mean (``c + (x - c) / (i + 1)``) is linear."""
    made = {carried}
    for q in body.eqns:
        reads = [k for k, a in enumerate(q.invars) if not compat.is_literal(a) and a in made]
        if not reads:
            continue
        name = q.primitive.name
        linear = (
            (name in _LINEAR and not (name == "select_n" and 0 in reads))
            or (name in ("mul", "dot_general") and len(reads) == 1)
            or (name == "div" and reads == [0])
        )
        if not linear:
            return True
        made.update(q.outvars)
    return False


def _reached(body: Any, seeds: Set[Any]) -> list[bool]:
    """For each output of ``body``, whether it is made from one of ``seeds``; an equation whose
    outputs :mod:`~autopar._src.dependence` cannot tell apart (a ``while`` loop) makes all of
    them from each operand."""
    reached = set(seeds)
    for q in body.eqns:
        flags = [not compat.is_literal(a) and a in reached for a in q.invars]
        out = dependence.eqn_depends(q, flags)
        reached.update(v for v, f in zip(q.outvars, out or [any(flags)] * len(q.outvars), strict=True) if f)
    return [not compat.is_literal(v) and v in reached for v in body.outvars]


def _rows_apart(loop: compat.Loop, operands: Sequence[Any], rows: dict[Any, set[int]]) -> bool:
    """Whether an iteration of ``loop`` reads or writes the examples' arrays (its inputs with
    dims per example, ``rows``: those dims per body input: the batch's, a buffer carried) at
    rows other than one another's, as far as the loop's counter tells: each slice's start along
    those dims is computed at the counter's first values (``x[i] + x[i - 1]``, ``a.at[i].set(f(a[i
    - 1]))``). Where a start cannot be computed (read from the batch), nothing is found."""
    body = loop.body
    carries = range(loop.num_consts, loop.num_consts + loop.num_carry)
    counters = [
        (body.invars[k], operands[k])
        for k in carries
        if compat.is_literal(operands[k])
        and body.invars[k].aval.shape == ()
        and _counts(body, body.invars[k], k - loop.num_consts)
    ]
    if len(counters) != 1:
        return False
    counter, start = counters[0]
    first = int(compat.literal_value(start))
    starts = []  # the starts along the dims per example of each slice read or written
    for q in body.eqns:
        dims = rows.get(q.invars[0]) if q.invars and not compat.is_literal(q.invars[0]) else None
        if not dims:
            continue
        name = q.primitive.name
        if name == "dynamic_slice":
            starts.append([q.invars[1 + d] for d in sorted(dims)])
        elif name == "dynamic_update_slice":
            starts.append([q.invars[2 + d] for d in sorted(dims)])
        elif name == "scatter" and tuple(q.params["dimension_numbers"].scatter_dims_to_operand_dims) == tuple(
            sorted(dims)
        ):
            starts.append([q.invars[1]])
    if len(starts) < 2:
        return False
    producer = {id(v): q for q in body.eqns for v in q.outvars}
    for t in range(first, first + min(_TRIES, loop.length)):
        known: dict[Any, Any] = {counter: np.int32(t)}
        found = {
            tuple(_flat(twin_traces.static_value(a, producer, known)) or () for a in one) for one in starts
        }
        if any(not all(one) for one in found):
            return False
        if len(found) > 1:
            return True
    return False


def _counts(body: Any, v: Any, k: int) -> bool:
    """Whether carry ``k`` of ``body`` (``v`` there) goes up by one each iteration."""
    q = next((q for q in body.eqns if body.outvars[k] in q.outvars), None)
    return (
        q is not None
        and q.primitive.name == "add"
        and v in q.invars
        and any(compat.is_literal(a) and int(compat.literal_value(a)) == 1 for a in q.invars)
    )


def _flat(x: Any) -> Any:
    return None if x is None else tuple(np.asarray(x).ravel().tolist())
