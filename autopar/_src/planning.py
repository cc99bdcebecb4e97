"""From a step and its arguments to a traced step and a plan.

Three ways: reuse a given plan (checked against the step and the devices), split
evenly into a given number of stages, or (``num_stages="auto"``) let the
clustering pick the layers and the stage DP pick stages, submeshes and, if asked,
the number of microbatches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from autopar._src import cluster as cluster_mod
from autopar._src import cost, planner, profile, stages, trace
from autopar._src.plan import Plan, StagePlan

DATA_AXIS = "data"


def _abstract(x: Any, rows: int | None) -> Any:
    aval = jax.typeof(x)
    shape = tuple(aval.shape) if rows is None else (rows, *aval.shape[1:])
    return jax.ShapeDtypeStruct(shape, aval.dtype)


def trace_at(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    batch_ids: Sequence[int],
    rows: int,
    options: trace.TraceOptions,
) -> trace.TracedStep:
    """Traces ``fn`` abstractly with the batch leaves cut to ``rows`` rows."""
    leaves, in_tree = jax.tree.flatten(args)
    ids = set(batch_ids)
    abstract = [_abstract(x, rows if i in ids else None) for i, x in enumerate(leaves)]
    return trace.trace_step(fn, jax.tree.unflatten(in_tree, abstract), options)


def _region_layers(step: trace.TracedStep) -> tuple[tuple[int, ...], tuple[float, ...], str]:
    at = step.region_index()
    if at is None:
        return (), (0.0,), ""
    info = step.jaxpr.eqns[at].params["info"]
    return info.cuts, info.layer_flops, info.fingerprint


def _stage_details(
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


def _require_region(step: trace.TracedStep, num_microbatches: int, num_stages: int) -> None:
    if step.region_index() is None and (num_microbatches > 1 or num_stages > 1):
        raise ValueError(
            f"num_microbatches={num_microbatches} and num_stages={num_stages} need the step to compute "
            "its gradient with autopar.value_and_grad or autopar.grad (the step has none, e.g. it uses "
            "jax.grad); switch to autopar's, or use num_microbatches=1 and num_stages=1."
        )


def uniform_plan(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    batch_ids: Sequence[int],
    batch_size: int,
    devices: Sequence[Any],
    num_stages: int,
    num_microbatches: int,
    schedule: str,
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
    _require_region(step, num_microbatches, num_stages)
    cuts, flops, fingerprint = _region_layers(step)
    prof = profile.layer_profile(step, tuple(batch_ids)) if step.region_index() is not None else None
    stage_plans = tuple(
        StagePlan(
            layers=(i, i + 1),
            device_ids=tuple(d.id for d in devices[i * per : (i + 1) * per]),
            mesh_shape=shape,
            axis_names=axes,
            forward_flops=flops[i],
            **_stage_details(step, args, prof, (i, i + 1), "replicated"),
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
    _require_region(step, plan.num_microbatches, plan.num_stages)
    cuts, flops, fingerprint = _region_layers(step)
    if tuple(cuts) != tuple(plan.cuts) or fingerprint != plan.fingerprint:
        raise ValueError(
            f"The plan does not match this step: it was made for a loss with fingerprint "
            f"{plan.fingerprint!r}, this step's loss has {fingerprint!r} (other operations or parameter "
            "shapes). Plan again for this step."
        )
    ids = {d.id for d in devices}
    missing = sorted({d for st in plan.stages for d in st.device_ids} - ids)
    if missing:
        raise ValueError(
            f"The plan uses device ids {missing} that are not among the available devices {sorted(ids)}; "
            "plan again for these devices."
        )
    return step, plan


def cluster_for(devices: Sequence[Any]) -> cluster_mod.ClusterSpec:
    """The cluster spec preset matching ``devices`` (one host).

    Raises:
      ValueError: for a device kind without a preset.
    """
    kind = devices[0].device_kind.lower()
    platform = devices[0].platform
    names = {"h100": "h100", "a100": "a100", "v100": "v100"}
    name = "cpu" if platform == "cpu" else next((v for k, v in names.items() if k in kind), None)
    if name is None:
        raise ValueError(
            f"No cluster spec preset for device kind {devices[0].device_kind!r}; pass "
            "cluster=autopar.ClusterSpec(...) (or a preset) to autoparallel."
        )
    return cluster_mod.preset(name, devices_per_host=len(devices))


def assign_devices(sizes: Sequence[tuple[int, int]], spec: cluster_mod.ClusterSpec) -> list[list[int]]:
    """Physical device indices for submeshes ``(hosts, devices)``, in stage order.

    Whole-host submeshes take whole hosts; power-of-two slices of a host are packed
    largest first at aligned offsets (buddy allocation), which always succeeds when
    the sizes add up to the cluster.

    Raises:
      ValueError: if the submeshes do not tile the cluster.
    """
    per_host = spec.devices_per_host
    free = [[True] * per_host for _ in range(spec.num_hosts)]
    placed: dict[int, list[int]] = {}
    order = sorted(range(len(sizes)), key=lambda s: (-sizes[s][0] * sizes[s][1], s))
    for s in order:
        hosts, width = sizes[s]
        if hosts > 1 or width == per_host:
            start = next(
                (h for h in range(spec.num_hosts - hosts + 1) if all(all(free[h + i]) for i in range(hosts))),
                None,
            )
            if start is None:
                raise ValueError(f"Submeshes {list(sizes)} do not tile cluster {spec.name!r}")
            for i in range(hosts):
                free[start + i] = [False] * per_host
            placed[s] = [(start + i) * per_host + d for i in range(hosts) for d in range(per_host)]
            continue
        spot = next(
            (
                (h, o)
                for h in range(spec.num_hosts)
                for o in range(0, per_host, width)
                if all(free[h][o : o + width])
            ),
            None,
        )
        if spot is None:
            raise ValueError(f"Submeshes {list(sizes)} do not tile cluster {spec.name!r}")
        h, o = spot
        free[h][o : o + width] = [False] * width
        placed[s] = [h * per_host + o + d for d in range(width)]
    return [placed[s] for s in range(len(sizes))]


def auto_plan(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    batch_ids: Sequence[int],
    batch_size: int,
    device_ids: Sequence[int],
    num_microbatches: int | None,
    schedule: str,
    spec: cluster_mod.ClusterSpec,
    tensor_parallel: bool = False,
    sharding_costs: bool = False,
    platform: str = "",
    retrace: bool = True,
    measured_devices: Sequence[Any] | None = None,
    cost_cache: Any = None,
) -> tuple[trace.TracedStep, Plan]:
    """Clusters layers automatically and runs the stage DP.

    ``num_microbatches=None`` chooses it among the divisors of the batch size.
    With ``sharding_costs``, each stage's latency on each logical mesh is the sharding ILP's
    (:mod:`autopar._src.layer_sharding`) instead of the analytic estimate, for devices of
    ``platform``.
    ``tensor_parallel`` allows logical meshes with ``tp > 1`` (for planning only:
    the runtime shards stages over the batch).

    ``device_ids`` are the ids of the cluster's devices, host by host. With
    ``measured_devices`` every layer range is compiled and timed on data-parallel
    submeshes of those devices (cached in ``cost_cache``) instead of estimated. When the number
    of microbatches is chosen, the step is traced at the whole batch and, with
    ``retrace``, traced again at the chosen microbatch size (needed to run it; a dry
    run scales the per-microbatch FLOPs instead).

    Raises:
      ValueError: if the cluster spec does not describe ``device_ids``.
      NoFeasiblePlanError: if no plan fits the devices' memory.
    """
    if spec.num_devices != len(device_ids):
        raise ValueError(
            f"The cluster spec {spec.name!r} describes {spec.num_devices} devices but {len(device_ids)} "
            "devices were given; pass a matching cluster= or devices=."
        )
    trace_rows = batch_size // (num_microbatches or 1) if batch_size else 0
    step = trace_at(fn, args, batch_ids, trace_rows, trace.TraceOptions(num_layers=None))
    if step.region_index() is None:
        _require_region(step, num_microbatches or 1, 1)
        stage = StagePlan(
            layers=(0, 1),
            device_ids=tuple(device_ids),
            mesh_shape=(len(device_ids),),
            axis_names=(DATA_AXIS,),
            forward_flops=0.0,
        )
        return step, Plan(
            num_microbatches=num_microbatches or 1,
            schedule=schedule,  # type: ignore[arg-type]
            cuts=(),
            layer_flops=(0.0,),
            stages=(stage,),
        )
    prof = profile.layer_profile(step, tuple(batch_ids))

    measured = None
    if measured_devices is not None:
        if num_microbatches is None:
            raise ValueError(
                "cost_model='measured' needs num_microbatches as an int (each candidate count would "
                "need its own measurements)"
            )
        from autopar._src import measured as measured_mod

        sizes = [h * d for h, d in cluster_mod.submesh_shapes(spec)]
        measured = measured_mod.layer_range_latency(
            step, batch_ids, batch_size // num_microbatches, measured_devices, sizes, cache=cost_cache
        )

    def sharded_for(traced: trace.TracedStep) -> Any:
        if not sharding_costs:
            return None
        from autopar._src import layer_sharding

        submeshes = cluster_mod.submesh_shapes(spec)
        logical = tuple(
            tuple(s for s in cluster_mod.logical_shapes(m) if tensor_parallel or s[1] == 1) for m in submeshes
        )
        return layer_sharding.layer_latency(
            traced, spec, submeshes, logical, dtype=prof.dtype, platform=platform
        )

    # The ILP's seconds do not shrink in proportion to the microbatch (collective latencies
    # stay), so with the count to choose, it is chosen on the analytic costs at the traced
    # batch and the stages are then priced by the ILP at the chosen microbatch.
    sharded = None if num_microbatches is None else sharded_for(step)

    def solve(b: int, scale: float) -> tuple[stages.StageSolution, planner.StageCosts]:
        return planner.solve(
            prof,
            spec,
            num_microbatches=b,
            schedule=schedule,  # type: ignore[arg-type]
            batch_scale=scale,
            tensor_parallel=tensor_parallel,
            measured=measured,
            sharded=sharded,
        )

    if num_microbatches is None:
        candidates = planner.microbatch_candidates(batch_size) if batch_size else (1,)
        nmb, _ = stages.choose_num_microbatches(candidates, lambda b: solve(b, 1.0 / b)[0])
        cuts, flops, fingerprint = _region_layers(step)
        scale = 1.0 / nmb
        if retrace:
            step = trace_at(
                fn,
                args,
                batch_ids,
                batch_size // nmb if batch_size else 0,
                trace.TraceOptions(num_layers=len(cuts) + 1, cuts=cuts),
            )
            prof = profile.layer_profile(step, tuple(batch_ids))
            cuts, flops, fingerprint = _region_layers(step)
            scale = 1.0
        sharded = sharded_for(step)
        flops = tuple(f * scale for f in flops)
    else:
        nmb, scale = num_microbatches, 1.0
        cuts, flops, fingerprint = _region_layers(step)
    solution, costs = solve(nmb, scale)
    sizes = [costs.submeshes[c.submesh] for c in solution.stages]
    placement = assign_devices(sizes, spec)
    stage_plans = []
    for c, idx in zip(solution.stages, placement, strict=True):
        dp, tp = costs.logical[c.submesh][c.logical]
        shape, axes = ((dp,), (DATA_AXIS,)) if tp == 1 else ((dp, tp), (DATA_AXIS, "model"))
        sharding = "replicated" if tp == 1 else f"split {tp}-way over model"
        stage_plans.append(
            StagePlan(
                layers=(c.start, c.stop),
                device_ids=tuple(device_ids[i] for i in idx),
                mesh_shape=shape,
                axis_names=axes,
                forward_flops=float(sum(flops[c.start : c.stop])),
                latency=c.latency,
                memory_bytes=c.memory,
                compute_time=float(costs.compute[c.start, c.stop - 1, c.submesh, c.logical]),
                **_stage_details(step, args, prof, (c.start, c.stop), sharding),
            )
        )
    plan = Plan(
        num_microbatches=nmb,
        schedule=schedule,
        cuts=cuts,
        layer_flops=flops,  # type: ignore[arg-type]
        stages=tuple(stage_plans),
        predicted_step_time=solution.objective,
        memory_budget=float(spec.device.memory_bytes),
        fingerprint=fingerprint,
    )
    return step, plan
