"""From a step and its arguments to a traced step and a plan.

Three ways: reuse a given plan (checked against the step and the devices), split
evenly into a given number of stages, or (``num_stages="auto"``,
:mod:`autopar._src.autoplan`) let the clustering pick the layers and the stage DP
pick stages, submeshes and, if asked, the number of microbatches. This module holds
the first two and the helpers all three share.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from autopar._src import cluster as cluster_mod
from autopar._src import (
    compat,
    cost,
    profile,
    trace,
)
from autopar._src.plan import DATA_AXIS, Plan, StagePlan
from autopar._src.schedule import ScheduleName


def _abstract(x: Any, rows: int | None) -> Any:
    aval = jax.typeof(x)
    shape = tuple(aval.shape) if rows is None else (rows, *aval.shape[1:])
    return jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type)


def trace_at(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    batch_ids: Sequence[int],
    rows: int,
    options: trace.TraceOptions,
) -> trace.TracedStep:
    """Traces ``fn`` abstractly with the batch leaves cut to ``rows`` rows.

    Raises:
      ValueError: where the step fails at ``rows`` rows but traces at the batch's own, naming
        the error and that the step reads the batch size from elsewhere than its shapes. Where
        it fails at both, the batch's own error is raised.
    """
    leaves, in_tree = jax.tree.flatten(args)
    ids = set(batch_ids)

    def at(n: int) -> trace.TracedStep:
        abstract = [_abstract(x, n if i in ids else None) for i, x in enumerate(leaves)]
        return trace.trace_step(fn, jax.tree.unflatten(in_tree, abstract), options)

    full = next((int(jax.typeof(leaves[i]).shape[0]) for i in batch_ids if jax.typeof(leaves[i]).shape), rows)
    if rows == full:
        return at(rows)
    try:
        return at(rows)
    except Exception as e:
        at(full)  # the batch's own error, where it fails there too
        outside = _rows_outside(args, ids, full)
        written = (
            "takes the batch size from elsewhere than the batch's shapes (a number written in the "
            "code, as in x.reshape(8 * seq, d)). Read it from the arrays' shapes (x.reshape(-1, d), "
            "x.shape[0]), or use num_microbatches=1."
        )
        why = f"{outside} Otherwise it {written}" if outside else f" So it {written}"
        raise ValueError(
            f"The step fails when traced with {rows} rows in place of the batch's {full}, as autopar "
            f"traces it (one microbatch, or a probe of the layers' costs): {type(e).__name__}: {e} "
            f"At {full} rows it traces.{why}"
        ) from e


def _rows_outside(args: tuple[Any, ...], batch_leaves: set[int], full: int) -> str:
    """What to add where arrays outside the batch have as many rows as the batch: maybe a row per
    example (an RNN's carry kept in the state between steps), which is not split."""
    paths = [
        f"args{jax.tree_util.keystr(path)}"
        for i, (path, x) in enumerate(jax.tree_util.tree_flatten_with_path(args)[0])
        if i not in batch_leaves and jax.typeof(x).shape[:1] == (full,)
    ]
    if not paths or full < 2:
        return ""
    named = f" ({', '.join(paths)})" if len(paths) <= 4 else f" ({len(paths)} of them)"
    return (
        f" Arrays outside the batch have {full} rows too{named}: if one holds a row per example "
        "(an RNN's carry kept in the state between steps), pass it in the batch (an argument of "
        "batch_argnums), which is split into microbatches, and return it as per-example aux."
    )


def step_profile(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    batch_ids: Sequence[int],
    rows: int,
    step: trace.TracedStep,
) -> profile.LayerProfile:
    """The layer profile of ``step`` (``fn`` traced by :func:`trace_at` at ``rows``), its fixed
    traffic read off a second trace at twice the rows with the same layer cuts (abstract:
    nothing is allocated).

    Raises:
      ValueError: if the step has no grad region.
    """
    if rows <= 0 or not batch_ids:
        return profile.layer_profile(step, tuple(batch_ids))
    cuts = region_layers(step)[0]
    options = trace.TraceOptions(num_layers=len(cuts) + 1, cuts=cuts)
    doubled = trace_at(fn, args, batch_ids, 2 * rows, options)
    return profile.layer_profile(step, tuple(batch_ids), doubled=doubled)


def region_layers(step: trace.TracedStep) -> tuple[tuple[int, ...], tuple[float, ...], str]:
    """``(cuts, layer FLOPs, fingerprint)`` of the step's grad region (none: one empty layer)."""
    at = step.region_index()
    if at is None:
        return (), (0.0,), ""
    info = step.jaxpr.eqns[at].params["info"]
    return info.cuts, info.layer_flops, info.fingerprint


def stage_details(
    step: trace.TracedStep,
    args: tuple[Any, ...],
    prof: profile.LayerProfile | None,
    layers: tuple[int, int],
    spec_text: str,
) -> dict[str, Any]:
    """Source span and largest parameters of the stage holding ``layers``."""
    at = step.region_index()
    if at is None or prof is None:
        return {}
    sources = step.jaxpr.eqns[at].params["info"].layer_sources
    start, stop = layers
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    index = {v: i for i, v in enumerate(step.arg_vars)}
    owned = [v for v, layer in prof.param_layer.items() if start <= layer < stop and v in index]
    owned.sort(key=lambda v: (-cost.aval_bytes(v.aval), index[v]))
    largest = tuple(f"{paths[index[v]]} {v.aval.dtype}{list(v.aval.shape)} {spec_text}" for v in owned[:3])
    return {"source": (sources[start][0], sources[stop - 1][1]), "largest_params": largest}


def describe_layouts(
    plan: Plan, step: trace.TracedStep, args: tuple[Any, ...], specs: Sequence[dict[Any, Any] | None]
) -> Plan:
    """``plan`` with each stage's largest parameters shown in the layouts ``specs`` gives them."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    by_path = dict(zip(paths, step.arg_vars, strict=True))
    stages = []
    for st, chosen in zip(plan.stages, specs, strict=True):
        described = []
        for text in st.largest_params:
            v = by_path.get(text.split(" ")[0])
            if chosen is None or v is None or v not in chosen:
                described.append(text)
                continue
            spec = chosen[v]
            layout = "replicated" if all(a is None for a in spec) else str(jax.sharding.PartitionSpec(*spec))
            described.append(f"{text.split(' ')[0]} {v.aval.dtype}{list(v.aval.shape)} {layout}")
        stages.append(dataclasses.replace(st, largest_params=tuple(described)))
    return dataclasses.replace(plan, stages=tuple(stages))


def require_region(step: trace.TracedStep, num_microbatches: int, num_stages: int | str) -> None:
    """Raises unless ``step`` has a grad region to pipeline, where the options ask for
    microbatches or several stages (``num_stages``: an int, or ``"auto"`` as the user gave it)."""
    several = num_microbatches > 1 or (isinstance(num_stages, int) and num_stages > 1)
    if step.region_index() is None and several:
        nested = _nested_region(step.jaxpr)
        if nested is not None:
            raise ValueError(
                f"num_microbatches={num_microbatches} and num_stages={num_stages} need "
                "autopar.value_and_grad (or autopar.grad) called once at the top level of the step, "
                f"but the step calls it inside {nested.primitive.name} (at {compat.source_line(nested)}), "
                "e.g. a loop accumulating gradients, where it cannot be pipelined. Call it once on the "
                "whole batch (num_microbatches does the accumulation), or use num_microbatches=1 and "
                "num_stages=1."
            )
        raise ValueError(
            f"num_microbatches={num_microbatches} and num_stages={num_stages} need the step to compute "
            "its gradient with autopar.value_and_grad or autopar.grad at the top level of the step (it "
            "has none there: e.g. it uses jax.grad, or autopar.grad under jax.vmap); switch to "
            "autopar's on the whole batch, or use num_microbatches=1 and num_stages=1. A step that "
            "computes no gradient (an evaluation step) has nothing to pipeline: wrap it with "
            "num_microbatches=1 and num_stages=1, or run it with jax.jit."
        )


def _nested_region(jaxpr: Any) -> Any:
    """The top-level equation of ``jaxpr`` whose body holds a grad region, if any."""
    for eqn in jaxpr.eqns:
        bodies = compat.bodies(eqn)
        while bodies:
            body = bodies.pop()
            if trace.find_regions(body):
                return eqn
            for inner in body.eqns:
                bodies += compat.bodies(inner)
    return None


def uniform_plan(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    batch_ids: Sequence[int],
    batch_size: int,
    devices: Sequence[Any],
    num_stages: int,
    num_microbatches: int,
    schedule: ScheduleName,
    mesh_shape: tuple[int, ...] | None = None,
) -> tuple[trace.TracedStep, Plan]:
    """``num_stages`` FLOP-balanced layers, one per stage, on equal submeshes.

    Each stage's logical mesh is ``mesh_shape`` (``(data,)`` or ``(data, model)``), by
    default all of its devices on ``"data"``.

    Raises:
      ValueError: if ``mesh_shape`` does not hold each stage's devices.
    """
    per = len(devices) // num_stages
    shape = (per,) if mesh_shape is None else tuple(mesh_shape)
    if math.prod(shape) != per:
        raise ValueError(
            f"mesh_shape={shape} holds {math.prod(shape)} devices but each of the {num_stages} stages "
            f"has {per}; choose a mesh_shape whose product is {per}"
        )
    axes = (DATA_AXIS, "model")[: len(shape)]
    rows = batch_size // num_microbatches if batch_size else 0
    step = trace_at(fn, args, batch_ids, rows, trace.TraceOptions(num_layers=num_stages))
    require_region(step, num_microbatches, num_stages)
    cuts, flops, fingerprint = region_layers(step)
    prof = profile.layer_profile(step, tuple(batch_ids)) if step.region_index() is not None else None
    stage_plans = tuple(
        StagePlan(
            layers=(i, i + 1),
            device_ids=tuple(d.id for d in devices[i * per : (i + 1) * per]),
            mesh_shape=shape,
            axis_names=axes,
            forward_flops=flops[i]
            + (float(prof.before_flops[i]) if prof is not None and prof.before_flops.size else 0.0),
            **stage_details(step, args, prof, (i, i + 1), "replicated"),
        )
        for i in range(num_stages)
    )
    plan = Plan(
        num_microbatches=num_microbatches,
        schedule=schedule,
        cuts=cuts,
        layer_flops=flops,
        stages=stage_plans,
        fingerprint=fingerprint,
    )
    return step, plan


def reuse_plan(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    batch_ids: Sequence[int],
    batch_size: int,
    devices: Sequence[Any],
    plan: Plan,
) -> tuple[trace.TracedStep, Plan]:
    """Traces the step at the plan's cuts and checks that the plan fits it.

    Raises:
      ValueError: if the step's layers or the devices do not match the plan.
    """
    rows = batch_size // plan.num_microbatches if batch_size else 0
    step = trace_at(fn, args, batch_ids, rows, trace.TraceOptions(num_layers=plan.num_layers, cuts=plan.cuts))
    require_region(step, plan.num_microbatches, plan.num_stages)
    cuts, flops, fingerprint = region_layers(step)
    if tuple(cuts) != tuple(plan.cuts) or fingerprint != plan.fingerprint:
        raise ValueError(
            f"The plan does not match this step: it was made for a loss with fingerprint "
            f"{plan.fingerprint!r}, this step's loss has {fingerprint!r} (other operations or parameter "
            "shapes). Plan again for this step."
        )
    ids = {d.id for d in devices}
    used = {d for st in plan.stages for d in st.device_ids}
    missing = sorted(used - ids)
    if missing:
        raise ValueError(
            f"The plan uses device ids {missing} that are not among the available devices {sorted(ids)}; "
            "plan again for these devices."
        )
    if ids - used:
        raise ValueError(
            f"The plan uses {len(used)} of the {len(ids)} devices (ids {sorted(used)}), leaving "
            f"{sorted(ids - used)} idle; pass devices= with just the plan's devices to run it on them, "
            "or plan again for all of them."
        )
    return step, plan


def cluster_for(devices: Sequence[Any]) -> cluster_mod.ClusterSpec:
    """The cluster spec preset matching ``devices``: one host per process (``jax.distributed``)
    that owns some of them.

    Raises:
      ValueError: for a device kind without a preset, or devices that do not come as equal
        runs of one process each (the stage search places stages on hosts by position).
    """
    name = cluster_mod.preset_name_for(devices[0])
    if name is None:
        raise ValueError(
            f"No cluster spec preset for device kind {devices[0].device_kind!r}; pass "
            "cluster=autopar.ClusterSpec(...) (or a preset) to autoparallel."
        )
    owners = [d.process_index for d in devices]
    hosts = list(dict.fromkeys(owners))
    per_host = len(devices) // len(hosts)
    if owners != [h for h in hosts for _ in range(per_host)]:
        raise ValueError(
            f"devices= lists devices of processes {owners}; each process must own as many of them, "
            "listed together (e.g. sorted(devices, key=lambda d: (d.process_index, d.id))), or pass "
            "cluster= to say how they form hosts."
        )
    return cluster_mod.preset(name, len(hosts), devices_per_host=per_host)
