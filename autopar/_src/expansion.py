"""Expanding calls, loops and branches into the equations of their bodies, for the intra-op ILP.

A nested ``jit``, a rematerialised (``jax.checkpoint``) call, a ``scan``, a ``while`` and a
``cond`` are single equations of the step, but the values inside them are what a stage
computes. :func:`expand_calls` replaces such an equation by its bodies' equations (named
:class:`~autopar._src.strategy_graph.Inner`), so that the ILP lays them out like any others;
the driver pins the layouts it chose inside (:func:`autopar._src.interpret.bind_pinned`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from autopar._src import compat, layers
from autopar._src.stage_values import alias_root
from autopar._src.strategies import elementwise_call
from autopar._src.strategy_graph import GraphOp, Inner, Tie


def _sliced(aval: Any, *, stack: bool) -> Any:
    """The jaxpr of taking one slice of a scanned operand (``stack``: of putting one result
    slice into the stacked result), as the equations a ``scan`` runs per iteration."""
    if stack:
        closed = jax.make_jaxpr(lambda y: jax.lax.expand_dims(y, (0,)))(
            jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        )
    else:
        closed = jax.make_jaxpr(lambda a: jax.lax.index_in_dim(a, 0, keepdims=False))(
            jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        )
    return compat.jaxpr_and_consts(closed)[0]


def expand_calls(
    op: GraphOp, alias: dict[Any, Any], ties: list[Tie] | None = None, path: tuple[int, ...] = ()
) -> list[GraphOp]:
    """``op``, or for a nested ``jit``, a rematerialised (``jax.checkpoint``) call, a ``scan`` or
    a ``cond`` the equations of its bodies, recursively, so that the ILP lays out the values
    inside as it lays out any others.

    The body reads the call's inputs; the values its equations make are named
    :class:`Inner` ``(path + (id(op.eqn),), var)``; each result of the call becomes an alias (in
    ``alias``) of the body value it returns. A ``scan``'s body counts ``length`` times; its
    scanned operands reach the body through a slicing op and its stacked results leave through
    a stacking op (the per-iteration copies the loop does), and each carry out is tied (in
    ``ties``) to the carry it starts from, so that the loop keeps one layout. Every branch of a
    ``cond`` counts as often as the ``cond`` runs (its values are named under
    ``path + (id(op.eqn), branch)``); the results are the first branch's, and the other
    branches' results are tied to them. A ``while``'s body counts once (its trip count is not
    known), its carries tied like a ``scan``'s; its predicate is not laid out. A ``cond`` whose
    branches are elementwise stays one op (its strategies follow its operands). The driver pins
    the values inside (see :func:`autopar._src.interpret.bind_pinned`). A body that returns a
    literal, or an input that is one, stays a single op.
    """
    branches = expandable_branches(op.eqn)
    if branches is not None:
        return _expand_cond(op, branches, alias, ties, path)
    while_loop = compat.while_body(op.eqn)
    if while_loop is not None:
        return _expand_while(op, *while_loop, alias, ties, path)
    loop = compat.scan_loop(op.eqn)
    body = loop.body if loop is not None else compat.inlinable_body(op.eqn)
    if body is None or _literal_results(body, op.ins, op.outs):
        return [op]
    here = (*path, id(op.eqn))
    weight = op.weight * (loop.length if loop is not None else 1)
    ops: list[GraphOp] = []
    env: dict[Any, Any] = {}
    if loop is None:
        body_ins = op.ins
    else:  # each iteration reads one slice of every scanned operand
        first_x = loop.num_consts + loop.num_carry
        slices = [
            None
            if src is None
            else _inline(_sliced(v.aval, stack=False), (src,), env, here, weight, alias, ties, ops)[0]
            for v, src in zip(op.eqn.invars[first_x:], op.ins[first_x:], strict=True)
        ]
        body_ins = (*op.ins[:first_x], *slices)
    results = _inline(body, body_ins, env, here, weight, alias, ties, ops)
    for k, (out, res) in enumerate(zip(op.outs, results, strict=True)):
        if loop is not None and k >= loop.num_carry:  # ... and writes one slice of every stacked result
            if out is not None:
                stacked = _sliced(body.outvars[k].aval, stack=True)
                alias[out] = _inline(stacked, (res,), env, here, weight, alias, ties, ops)[0]
            continue
        if loop is not None and ties is not None:
            start = body_ins[loop.num_consts + k]
            if start is not None and res != start:
                ties.append(Tie(out=res, into=start, weight=weight))
        if out is not None and res != out:
            alias[out] = res
    return ops


def expandable_branches(eqn: Any) -> list[Any] | None:
    """The branches (open jaxprs) of a ``cond`` that :func:`expand_calls` lays out inside: one
    whose branches are not elementwise and carry no constants; None otherwise."""
    branches = compat.cond_branches(eqn)
    if branches is None or any(consts or body.constvars for body, consts in branches):
        return None
    return None if elementwise_call(eqn) else [body for body, _ in branches]


def _literal_results(body: Any, ins: Sequence[Any], outs: Sequence[Any]) -> bool:
    """Whether a used result of ``body`` (reading ``ins``) is a literal or a literal input."""
    return any(
        out is not None and (compat.is_literal(v) or (v in body.invars and ins[body.invars.index(v)] is None))
        for out, v in zip(outs, body.outvars, strict=True)
    )


def _inline(
    jaxpr: Any,
    ins: Sequence[Any],
    env: dict[Any, Any],
    here: tuple[int, ...],
    weight: int,
    alias: dict[Any, Any],
    ties: list[Tie] | None,
    ops: list[GraphOp],
) -> list[Any]:
    """Adds ``jaxpr``'s equations reading ``ins`` to ``ops``; the names of its results."""

    def name(v: Any) -> Any:
        return None if compat.is_literal(v) else env[v]

    env.update(zip(jaxpr.invars, ins, strict=True))
    for e in jaxpr.eqns:
        outs = tuple(None if compat.is_dropvar(v) else Inner(here, v) for v in e.outvars)
        ops.extend(expand_calls(GraphOp(e, tuple(map(name, e.invars)), outs, weight), alias, ties, here))
        env.update((v, n) for v, n in zip(e.outvars, outs, strict=True) if n is not None)
    return [name(v) for v in jaxpr.outvars]


def _expand_while(
    op: GraphOp,
    body: Any,
    skip: int,
    alias: dict[Any, Any],
    ties: list[Tie] | None,
    path: tuple[int, ...],
) -> list[GraphOp]:
    body_ins = op.ins[skip:]
    if _literal_results(body, body_ins, op.outs):
        return [op]
    ops: list[GraphOp] = []
    results = _inline(body, body_ins, {}, (*path, id(op.eqn)), op.weight, alias, ties, ops)
    carries = body_ins[len(body_ins) - len(results) :]
    for out, res, start in zip(op.outs, results, carries, strict=True):
        if ties is not None and start is not None and res != start:
            ties.append(Tie(out=res, into=start, weight=op.weight))
        if out is not None and res != out:
            alias[out] = res
    return ops


def _expand_cond(
    op: GraphOp, branches: Sequence[Any], alias: dict[Any, Any], ties: list[Tie] | None, path: tuple[int, ...]
) -> list[GraphOp]:
    if any(_literal_results(body, op.ins[1:], op.outs) for body in branches):
        return [op]
    ops: list[GraphOp] = []
    results = [
        _inline(body, op.ins[1:], {}, (*path, id(op.eqn), b), op.weight, alias, ties, ops)
        for b, body in enumerate(branches)
    ]
    for k, out in enumerate(op.outs):
        first = results[0][k]
        if ties is not None:
            ties.extend(Tie(out=r[k], into=first, weight=op.weight) for r in results[1:] if r[k] != first)
        if out is not None and first != out:
            alias[out] = first
    return ops


def region_ops(
    jaxpr: Any, where: Sequence[tuple[int, str]], num_layers: int
) -> tuple[list[GraphOp], dict[Any, Any], list[list[Tie]]]:
    """The grad region's equations as strategy-graph ops, calls and loops expanded.

    ``where`` gives each equation's ``(layer, pass)`` (see
    :func:`autopar._src.partition.layer_placement`), which becomes its ops' ``task``. Layer
    boundary markers are identities: their outputs are aliases of their operands.

    Returns:
      ``(ops, alias, ties)``: ``ties`` per layer (see :func:`expand_calls`).
    """
    alias: dict[Any, Any] = {}

    def name(v: Any) -> Any:
        return None if compat.is_literal(v) or compat.is_dropvar(v) else alias_root(alias, v)

    ops: list[GraphOp] = []
    ties: list[list[Tie]] = [[] for _ in range(num_layers)]
    for eqn, (layer, pass_) in zip(jaxpr.eqns, where, strict=True):
        if layers.is_boundary(eqn):
            for a, v in zip(eqn.invars, eqn.outvars, strict=True):
                if name(a) is not None and not compat.is_dropvar(v):
                    alias[v] = name(a)
            continue
        op = GraphOp(eqn, tuple(map(name, eqn.invars)), tuple(map(name, eqn.outvars)))
        ops += [o._replace(task=(layer, pass_)) for o in expand_calls(op, alias, ties[layer])]
    return ops, alias, ties
