"""The function a task's executable runs: its ops in order, each output pinned to its layout.

A task is a list of equations and accumulator ops over keyed values (:mod:`autopar._src.program`).
:func:`task_fn` interprets it inside one ``jax.jit``: every equation is bound again with its
output pinned by ``with_sharding_constraint`` to the layout the sharding ILP chose; nested calls,
loops and branches run their bodies with the values inside pinned too (:func:`bind_pinned`);
gradients kept as partial sums run as :mod:`autopar._src.deferred` says.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar._src import compat, deferred, microbatch_keys
from autopar._src.expansion import expandable_branches
from autopar._src.program import Key, Op, Task
from autopar._src.strategy_graph import Inner


def _acc(op: Op, vals: list[Any], stacked: deferred.Stacked | None, mesh: Mesh | None) -> Any:
    if op.mode == "zeros":
        return deferred.zeros(op.aval, stacked, mesh)
    if op.mode in ("add", "sum"):
        return functools.reduce(operator.add, vals)
    if op.mode == "mean":
        return deferred.finish(vals[0], stacked) / op.divisor
    if op.mode == "concat":
        return jnp.concatenate(vals, axis=op.axis)
    return vals[0]


@dataclasses.dataclass(frozen=True)
class Inside:
    """What bodies run with: the layouts of their values (``pins``, see
    :func:`~autopar._src.expansion.expand_calls`) and those kept as stacked partial sums over
    ``mesh`` (``sums``, see :mod:`autopar._src.deferred`; their pins are the stacked layouts)."""

    pins: dict[Inner, NamedSharding] = dataclasses.field(default_factory=dict)
    sums: deferred.Deferred = deferred.NONE
    mesh: Mesh | None = None


def grouped_conv_operands(eqn: Any, vals: list[Any], out: NamedSharding | None) -> list[Any]:
    """``vals``, but for a grouped convolution (``feature_group_count`` or ``batch_group_count``
    above 1, as ``vmap`` of a convolution's gradient makes) with its output pinned to ``out``:
    its operands pinned to the layout the ILP priced for it (the input's batch dim as the
    output's, the rest whole; :func:`~autopar._src.strategies.eqn_strategies`). XLA's partitioner,
    left to reshard an input split along its feature groups by itself, makes a program its own
    verifier rejects."""
    p = eqn.params
    if out is None or eqn.primitive.name != "conv_general_dilated":
        return vals
    if p.get("feature_group_count", 1) == 1 and p.get("batch_group_count", 1) == 1:
        return vals
    dn, spec = p["dimension_numbers"], tuple(out.spec) + (None,) * len(eqn.outvars[0].aval.shape)
    lhs = [None] * len(eqn.invars[0].aval.shape)
    if p.get("batch_group_count", 1) == 1:
        lhs[dn.lhs_spec[0]] = spec[dn.out_spec[0]]
    layouts = [PartitionSpec(*lhs), PartitionSpec()]
    return [
        jax.lax.with_sharding_constraint(x, NamedSharding(out.mesh, layout))
        for x, layout in zip(vals, layouts, strict=True)
    ]


def bind_pinned(eqn: Any, vals: list[Any], inside: Inside, path: tuple[int, ...] = ()) -> list[Any]:
    """Applies ``eqn`` to ``vals``. A nested call, loop or ``cond`` runs its bodies with the
    values the ILP laid out inside them pinned (``inside``): a ``jit`` body inline; a
    rematerialised ``scan`` or ``while`` body re-traced into the same equation; ``cond``
    branches re-traced by ``lax.switch``. Values inside kept as partial sums come out of their
    ``jit`` or rematerialised call or ``scan`` stacked."""
    here = (*path, id(eqn))
    pinned = bool(inside.pins)
    branches = expandable_branches(eqn) if pinned else None
    if branches is not None:
        fns = [functools.partial(_run_pinned, body, inside, (*here, b)) for b, body in enumerate(branches)]
        return list(jax.lax.switch(vals[0], fns, *vals[1:]))
    while_loop = compat.while_body(eqn) if pinned else None
    if while_loop is not None:
        body = while_loop[0]
        return compat.bind_with_body(eqn, body, functools.partial(_run_pinned, body, inside, here), vals)
    body = compat.inlinable_body(eqn) if pinned else None
    if body is None:
        return compat.bind_eqn(eqn, vals)
    run = functools.partial(_run_pinned, body, inside, here)
    return run(*vals) if compat.is_call(eqn) else compat.bind_with_body(eqn, body, run, vals)


def _run_pinned(body: Any, inside: Inside, here: tuple[int, ...], *xs: Any) -> list[Any]:
    env = dict(zip(body.invars, xs, strict=True))

    def read(a: Any) -> Any:
        return compat.literal_value(a) if compat.is_literal(a) else env[a]

    for e in body.eqns:
        vals = [read(a) for a in e.invars]
        name = Inner(here, e.outvars[0]) if len(e.outvars) == 1 else None
        stacked = inside.sums.values.get(name)
        if stacked is not None and name is not None and deferred.made_stacked(e):
            outs = [deferred.bind(e, vals, stacked, stacked.base(inside.pins[name].spec), inside.mesh)]
        else:
            vals = grouped_conv_operands(
                e, vals, inside.pins.get(Inner(here, e.outvars[0])) if e.outvars else None
            )
            outs = bind_pinned(e, vals, inside, here)
        for v, x in zip(e.outvars, outs, strict=True):
            if not compat.is_dropvar(v):
                pin = inside.pins.get(Inner(here, v))
                env[v] = x if pin is None else jax.lax.with_sharding_constraint(x, pin)
    return [read(a) for a in body.outvars]


def task_fn(
    task: Task, pins: dict[Key, NamedSharding], inside: Inside = Inside()
) -> Callable[..., tuple[Any, ...]]:
    """The function a task's executable runs: its ops in order, outputs pinned to ``pins``,
    values inside calls as ``inside`` says; ``inside.sums`` are kept as stacked partial sums."""
    ops, in_keys, out_keys = task.ops, task.in_keys, task.out_keys
    sums, mesh = inside.sums, inside.mesh

    def fn(*args: Any) -> tuple[Any, ...]:
        env: dict[Key, Any] = dict(zip(in_keys, args, strict=True))

        def read(a: Any) -> Any:
            return env[a] if isinstance(a, tuple) else compat.literal_value(a)

        for op in ops:
            vals = [read(a) for a in op.ins]
            var = op.outs[0][0] if op.outs and op.outs[0] is not None else None
            if op.kind == "acc" and op.mode == "fold":
                outs = microbatch_keys.fold(vals[0], len(op.outs), op.key_impl)
            elif op.kind == "acc" and op.mode == "index":
                outs = [jnp.asarray(j, jnp.uint32) for j in range(len(op.outs))]
            elif op.kind == "acc":
                outs = [_acc(op, vals, sums.accumulators.get(op.out[0]), mesh)]
                if op.out[0].aval.weak_type:  # sums start from strong zeros; the step's value is weak
                    outs = [compat.weakly_typed(outs[0])]
            elif var in sums.values and deferred.made_stacked(op.eqn):
                stacked = sums.values[var]
                outs = [deferred.bind(op.eqn, vals, stacked, stacked.base(pins[op.out].spec), mesh)]
            else:
                vals = grouped_conv_operands(
                    op.eqn, vals, pins.get(op.outs[0]) if op.outs and op.outs[0] else None
                )
                outs = bind_pinned(op.eqn, vals, inside)
            for k, x in zip(op.outs, outs, strict=True):
                if k is not None:
                    env[k] = jax.lax.with_sharding_constraint(x, pins[k]) if k in pins else x
        return tuple(env[k] for k in out_keys)

    return fn
