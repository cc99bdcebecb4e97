"""``num_stages="auto"``: automatic layers, then the stage DP over submeshes and logical meshes.

The step is traced once with the first automatic clustering
(:data:`autopar._src.clustering.BYTES_FACTORS`); each other distinct clustering (the other
factors', then :data:`autopar._src.clustering.UNBALANCED_FACTORS`') is traced and
planned too, and the plan with the lowest predicted step time is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from autopar._src import cluster as cluster_mod
from autopar._src import planner, stages, trace, user_constraints
from autopar._src.plan import DATA_AXIS, Plan, StagePlan
from autopar._src.planning import region_layers, require_region, stage_details, step_profile, trace_at
from autopar._src.schedule import ScheduleName


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
    schedule: ScheduleName,
    spec: cluster_mod.ClusterSpec,
    tensor_parallel: bool = False,
    sharding_costs: bool = False,
    platform: str = "",
    retrace: bool = True,
    measured_devices: Sequence[Any] | None = None,
    cost_cache: Any = None,
) -> tuple[trace.TracedStep, Plan]:
    """Clusters layers automatically and runs the stage DP, once per distinct automatic
    clustering (:func:`autopar._src.clustering.candidate_layer_counts`), keeping the fastest plan.

    ``num_microbatches=None`` chooses it among the divisors of the batch size.
    With ``sharding_costs``, each stage's latency on each logical mesh is the sharding ILP's
    (:mod:`autopar._src.layer_sharding`) instead of the analytic estimate, for devices of
    ``platform``.
    ``tensor_parallel`` allows logical meshes with ``tp > 1`` (``sharding="auto"``; the
    runtime lays them out with each stage's sharding ILP).

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
        require_region(step, num_microbatches or 1, "auto")
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

    # A step that binds a mesh of its own (shard_map) runs as one stage on it (check_meshes).
    one_stage = bool(user_constraints.bound_to_meshes(step.jaxpr))

    def plan_layers(step: trace.TracedStep) -> tuple[trace.TracedStep, Plan]:
        """The plan for the layers ``step`` is cut into."""
        prof = step_profile(fn, args, batch_ids, trace_rows, step)

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

        def sharded_for(traced: trace.TracedStep, nmb: int) -> Any:
            if not sharding_costs:
                return None
            from autopar._src import layer_sharding

            submeshes = cluster_mod.submesh_shapes(spec)
            logical = tuple(
                tuple(s for s in cluster_mod.logical_shapes(m) if tensor_parallel or s[1] == 1)
                for m in submeshes
            )
            return layer_sharding.layer_latency(
                traced, spec, submeshes, logical, dtype=prof.dtype, platform=platform, microbatches=nmb
            )

        sharded = None

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
                one_stage=one_stage,
            )

        # The ILP's seconds do not shrink in proportion to the microbatch (collective latencies
        # stay), so with the count to choose, it is chosen on the analytic costs at the traced
        # batch and the stages are then priced by the ILP at the chosen microbatch. Memory does
        # not depend on the latencies: a step that no plan fits fails on the analytic costs,
        # before the ILP prices its layers.
        if num_microbatches is not None and sharding_costs:
            solve(num_microbatches, 1.0)
            sharded = sharded_for(step, num_microbatches)
        if num_microbatches is None:
            candidates = planner.microbatch_candidates(batch_size) if batch_size else (1,)
            # Smaller microbatches hold fewer activations: where no count up to the usual most
            # fits, the larger divisors of the batch may.
            more = planner.microbatch_candidates(batch_size, max_microbatches=max(batch_size, 1))
            nmb, _ = stages.choose_num_microbatches(candidates, lambda b: solve(b, 1.0 / b)[0], fallback=more)
            cuts, flops, fingerprint = region_layers(step)
            scale = 1.0 / nmb
            if retrace:
                rows = batch_size // nmb if batch_size else 0
                step = trace_at(
                    fn, args, batch_ids, rows, trace.TraceOptions(num_layers=len(cuts) + 1, cuts=cuts)
                )
                prof = step_profile(fn, args, batch_ids, rows, step)
                cuts, flops, fingerprint = region_layers(step)
                scale = 1.0
            sharded = sharded_for(step, nmb)
            flops = tuple(f * scale for f in flops)
        else:
            nmb, scale = num_microbatches, 1.0
            cuts, flops, fingerprint = region_layers(step)
        solution, costs = solve(nmb, scale)
        # The code before the loss function that the stages' forwards run per microbatch.
        before = prof.before_flops if prof.before_flops.size else np.zeros(len(flops))
        shapes = [costs.submeshes[c.submesh] for c in solution.stages]
        placement = assign_devices(shapes, spec)
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
                    forward_flops=float(
                        sum(flops[c.start : c.stop]) + before[c.start : c.stop].sum() * scale
                    ),
                    latency=c.latency,
                    memory_bytes=c.memory,
                    compute_time=float(costs.compute[c.start, c.stop - 1, c.submesh, c.logical]),
                    **stage_details(step, args, prof, (c.start, c.stop), sharding),
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

    # Each automatic clustering is planned and the fastest plan kept (candidate_layer_counts);
    # with measured costs only the first, as each would need its own measurements.
    info = step.jaxpr.eqns[step.region_index()].params["info"]
    counts = (None,) if measured_devices is not None else (None, *info.other_layer_counts)
    best, error = None, None
    for num in counts:
        traced = (
            step
            if num is None
            else trace_at(fn, args, batch_ids, trace_rows, trace.TraceOptions(num_layers=num))
        )
        try:
            found = plan_layers(traced)
        except stages.NoFeasiblePlanError as e:
            error = error or e
            continue
        if best is None or found[1].predicted_step_time < best[1].predicted_step_time:
            best = found
    if best is None:
        raise error  # type: ignore[misc]
    return best
