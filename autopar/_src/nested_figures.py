"""Figures of the batch made inside the loss function's bodies, which no microbatch could share.

:mod:`~autopar._src.batch_statistics` makes each figure of the batch alone that the loss
function reads at its top level (a token count) once per step from the whole batch. One made
inside a body and read there (``lax.cond(n > 0, lambda: sum(l * m) / sum(m), ...)``, a masked mean
inside ``jax.checkpoint`` or a ``custom_jvp`` function) cannot be taken out: each microbatch would
count its own examples and the average of the microbatches' losses would not be the whole
batch's, silently. Those are errors naming the line, whose fix is to make the figure outside the
body. Nested ``jit``s are inlined before this runs; loops over the examples (a trip count that
follows the batch) and ``while`` loops are left to :mod:`~autopar._src.batch_scaling`, which follows
sums made there.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Any

from autopar._src import batch_scaling, carry_updates, compat, dependence, layers


def require_none(
    eqns: Sequence[Any], twins: Sequence[Any], tainted: Set[Any], bound: Set[Any], nmb: int
) -> None:
    """Raises if a body of ``eqns`` (``twins``: the same equations at the whole batch) makes a
    figure of the batch alone from the examples and reads it there. ``tainted``: the values made
    from the batch;
    ``bound``: those made from anything else too (the model, random draws, cotangents).

    Raises:
      ValueError: naming the equation that makes the figure and its source line.
    """
    for e, t in zip(eqns, twins, strict=True):
        if layers.is_boundary(e):
            continue
        # What the body makes from the examples: a figure made outside it is a statistic already.
        examples = {
            a
            for a, b in zip(e.invars, t.invars, strict=True)
            if _in(a, tainted) and a.aval.shape != b.aval.shape
        }
        for body, twin, operands, carried in _bodies(e, t):
            sums = _summed_figures(body, operands, carried, bound)
            carried = carried - sums
            inner_tainted = {v for v, a in zip(body.invars, operands, strict=True) if _in(a, examples)}
            _taint_sums(body, sums, min(carried | sums, default=0), inner_tainted)
            inner_bound = {
                v
                for k, (v, a) in enumerate(zip(body.invars, operands, strict=True))
                if k in carried or _in(a, bound)
            }
            found = _read_inside(body, twin, inner_tainted, inner_bound, nmb)
            if found is not None:
                figure = f"{found.outvars[0].aval.str_short()} at {compat.source_line(found)}"
                raise ValueError(
                    f"The loss function makes a figure of the batch alone ({figure}: "
                    f"{str(found).splitlines()[0]!r}) inside a {e.primitive.name} and reads it there. "
                    f"With num_microbatches={nmb} each microbatch would make its own from its "
                    "examples (a token count of its own), and the average of the microbatches' "
                    "losses would not be the whole batch's. Make it before the "
                    f"{e.primitive.name}, as a float (n = jnp.sum(mask, dtype=jnp.float32)), and pass "
                    "it in: there it is made once from the whole batch. Or use num_microbatches=1."
                )


def _in(a: Any, values: Set[Any]) -> bool:
    return not compat.is_literal(a) and a in values


def _bodies(e: Any, t: Any) -> list[tuple[Any, Any, Sequence[Any], set[int]]]:
    """``e``'s bodies that take its operands one for one (with their twins in ``t``, the operands
    and the positions of loop carries): branches, calls, scans as long for a microbatch as for
    the batch."""
    branches, theirs = compat.cond_branches(e), compat.cond_branches(t)
    if branches is not None and theirs is not None:
        return [
            (b, tb, e.invars[1:], set())
            for (b, c), (tb, tc) in zip(branches, theirs, strict=True)
            if not c and not tc
        ]
    loop, twin_loop = compat.scan_loop(e), compat.scan_loop(t)
    if loop is not None and twin_loop is not None:
        if loop.length != twin_loop.length:  # a loop over the examples
            return []
        return [
            (
                loop.body,
                twin_loop.body,
                e.invars,
                set(range(loop.num_consts, loop.num_consts + loop.num_carry)),
            )
        ]
    body, twin = compat.operand_body(e), compat.operand_body(t)
    return [] if body is None or twin is None else [(body, twin, e.invars, set())]


def _summed_figures(body: Any, operands: Sequence[Any], carried: Set[int], bound: Set[Any]) -> set[int]:
    """The positions among ``carried`` (a scan's carries) of the running sums of figures of the
    batch: each starts from a value made from neither the model nor draws (``0.0``) and adds only
    such values (a chunked loss's token count ``n + jnp.sum(m)``): a figure of the batch, as the
    sum of the chunks' counts is."""
    if not carried:
        return set()
    first = min(carried)
    links = carry_updates.Links(body.eqns)
    sums = {
        k
        for k in carried
        if not _in(operands[k], bound)
        and carry_updates.update(body.outvars[k - first], body.invars[k], links)[0] == "sum"
    }
    while sums:
        flags = [(k in carried and k not in sums) or _in(a, bound) for k, a in enumerate(operands)]
        reached = dependence.depends(body, flags)
        if reached is None:
            return set()
        adds_bound = {k for k in sums if reached[k - first]}
        if not adds_bound:
            break
        sums -= adds_bound
    return sums


def _taint_sums(body: Any, sums: Set[int], first: int, tainted: set[Any]) -> None:
    """Adds to ``tainted`` the carries at ``sums`` (``first``: the first carry's position) that
    add what is made from the examples: read in the body, they are figures of the batch."""
    while sums:
        reached = dependence.depends(body, [v in tainted for v in body.invars])
        grown = {body.invars[k] for k in sums if reached is None or reached[k - first]} - tainted
        if not grown:
            return
        tainted.update(grown)


def _read_inside(body: Any, twin: Any, tainted: set[Any], bound: set[Any], nmb: int) -> Any | None:
    """The first equation of ``body`` that makes a figure read inside it, or None."""
    if len(body.eqns) != len(twin.eqns) or any(
        q.primitive is not r.primitive or len(q.outvars) != len(r.outvars)
        for q, r in zip(body.eqns, twin.eqns, strict=True)
    ):
        return None
    shapes = {}
    whole = {v: tuple(w.aval.shape) for v, w in zip(body.invars, twin.invars, strict=True)}
    maker = {}
    for q, r in zip(body.eqns, twin.eqns, strict=True):
        require_none([q], [r], tainted, bound, nmb)  # its own bodies
        for values in (bound, tainted):
            flags = dependence.eqn_depends(q, [_in(a, values) for a in q.invars])
            values.update(
                q.outvars if flags is None else [v for v, f in zip(q.outvars, flags, strict=True) if f]
            )
        for v, w in zip(q.outvars, r.outvars, strict=True):
            shapes[v] = v.aval.shape == w.aval.shape
            whole[v] = tuple(w.aval.shape)
            maker[v] = q

    def figure(a: Any) -> bool:
        return _in(a, tainted) and not _in(a, bound) and shapes.get(a, False)

    for q in body.eqns:
        read = batch_scaling.reads_as_figure(q, whole.get)
        if any(figure(a) for a in read) and not all(figure(v) for v in q.outvars if not compat.is_dropvar(v)):
            return maker[next(a for a in read if figure(a))]
    return None
