"""One plan-quality cell: a model on a cluster, traced abstractly, priced (analytically or by
the sharding ILP) and planned by autopar's stage search, every Megatron-style grid and data
parallelism; see ``benchmarks/plan_quality.py``."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from benchmarks import _plan_ilp
from benchmarks._plan_table import faster, grid_name

DTYPES = {"v100": "float16", "h100": "bfloat16", "a100": "bfloat16", "cpu": "float32"}
"""Compute dtype per preset: V100 has no bfloat16 arithmetic."""
SCHEDULE = "1f1b"


def abstract_step(model: str, dtype: str, batch_size: int | None = None):
    """``(step, state, batch, kind, batch_size)`` of a preset, all abstract (nothing allocated).

    GPT blocks are rematerialised, as large GPTs are trained.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from models import registry, train

    kind, config = registry.lookup(model)
    overrides: dict[str, Any] = {"dtype": jnp.dtype(dtype)}
    if kind == "gpt":
        overrides["remat"] = True
    config = type(config).preset(model, **overrides)
    batch_size = batch_size or registry.DEFAULT_BATCH[kind]
    sample = train.make_batch(kind, config, 2)
    batch = {k: jax.ShapeDtypeStruct((batch_size, *v.shape[1:]), v.dtype) for k, v in sample.items()}
    state = jax.eval_shape(lambda: train.linen_state(kind, config, optax.adamw(1e-4)))
    return train.linen_step(kind), state, batch, kind, batch_size


def stage_options(spec, costs, num_microbatches: int) -> dict[str, Any]:
    """The stage DP's and the grids' options for ``costs`` on ``spec``'s devices."""
    return dict(
        memory_budget=float(spec.device.memory_bytes),
        num_devices=spec.num_devices,
        num_microbatches=num_microbatches,
        schedule=SCHEDULE,
        submesh_devices=[h * d for h, d in costs.submeshes],
    )


def solve(costs, common: dict[str, Any]):
    """autopar's stage DP on ``costs`` (raises ``NoFeasiblePlanError`` if nothing fits)."""
    from autopar._src import stages

    return stages.solve_stages(
        costs.latency,
        costs.param_memory,
        costs.activation_memory,
        **common,
        submesh_shapes=costs.submeshes,
        logical_shapes=costs.logical,
    )


def _stage_search(costs, common: dict[str, Any]) -> dict[str, Any] | None:
    """autopar's stage DP on one microbatch count's costs, as plain data (None if nothing fits)."""
    from autopar._src import stages

    try:
        sol = solve(costs, common)
    except stages.NoFeasiblePlanError:
        return None
    return {
        "seconds": sol.objective,
        "microbatches": common["num_microbatches"],
        "layers": len(costs.latency),
        "stages": [
            {
                "layers": [c.start, c.stop],
                "submesh": list(costs.submeshes[c.submesh]),
                "logical": list(costs.logical[c.submesh][c.logical]),
            }
            for c in sol.stages
        ],
    }


def _cluster(preset: str, num_devices: int, kernel_time: float = 0.0):
    """The preset's cluster of ``num_devices`` (8 per host), its devices' time per kernel set to
    ``kernel_time`` (the presets have none)."""
    from autopar._src.cluster import preset as cluster_preset

    per_host = min(num_devices, 8)
    spec = cluster_preset(preset, num_devices // per_host, devices_per_host=per_host)
    return dataclasses.replace(spec, device=dataclasses.replace(spec.device, kernel_time=kernel_time))


def _ilp_candidates(batch_size: int, ilp_microbatches: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(b for b in ilp_microbatches if batch_size % b == 0)


def _compute_bound(prof, spec) -> float:
    """The analytic costs' lower bound on any plan's step: the step's FLOPs over all devices'
    peak plus its memory traffic over all devices' bandwidth (every stage's compute term is
    both over its devices), plus its kernels' time over the most stages a plan can have (every
    device of a stage runs the stage's kernels for each microbatch: only stages share them)."""
    flops = float((prof.forward_flops + prof.backward_flops).sum())
    traffic = float((prof.forward_traffic + prof.backward_traffic).sum())
    device = spec.device
    launches = float(prof.kernels.sum()) * device.kernel_time / min(spec.num_devices, prof.num_layers)
    return (
        flops / device.flops(prof.dtype) + traffic / device.memory_bandwidth
    ) / spec.num_devices + launches


def plan_cell(
    model: str,
    preset: str,
    num_devices: int,
    *,
    batch_size: int | None = None,
    max_microbatches: int = 64,
    costs: str = "analytic",
    ilp_microbatches: tuple[int, ...] = (64,),
    num_layers: int | None = None,
    kernel_time: float = 0.0,
) -> dict[str, Any]:
    """Traces, profiles and plans one (model, cluster) cell on one clustering (``num_layers``
    layers; None: the first automatic one); returns its results as plain data. ``kernel_time``:
    the devices' seconds per kernel (:attr:`autopar.cluster.DeviceSpec.kernel_time`).

    ``costs="ilp"`` prices both sides with the sharding ILP (see ``benchmarks/_plan_ilp.py``)
    at the microbatch counts ``ilp_microbatches``. ``_plan_table.combine`` takes a cell's clusterings.
    """
    import numpy as np

    from autopar._src import baselines, planner

    t0 = time.perf_counter()
    step, state, batch, kind, batch_size = abstract_step(model, DTYPES[preset], batch_size)
    spec = _cluster(preset, num_devices, kernel_time)
    if costs == "ilp":
        candidates = _ilp_candidates(batch_size, ilp_microbatches)
        priced, bounds = {}, []
        for b in candidates:
            free, pinned, prof, traced = _plan_ilp.ilp_costs(
                step,
                state,
                batch,
                spec,
                batch_size=batch_size,
                num_microbatches=b,
                dtype=DTYPES[preset],
                num_layers=num_layers,
            )
            # On the microbatch just traced: the bound only adds each layer's (trivial) 1x1 solve.
            # Every device of a stage runs its kernels for each microbatch: only stages share them.
            stages = min(spec.num_devices, prof.num_layers)
            launches = float(prof.kernels.sum()) * spec.device.kernel_time * b / stages
            bounds.append(
                _plan_ilp.step_bound(traced, spec, num_microbatches=b, dtype=DTYPES[preset]) + launches
            )
            data_parallel = np.array(
                [[s[1] == 1 for s in q] + [False] * (free.latency.shape[3] - len(q)) for q in free.logical]
            )
            only_dp = dataclasses.replace(free, latency=np.where(data_parallel, free.latency, np.inf))
            priced[b] = {"autopar": free, "autopar_tp1": only_dp, "grids": pinned}
    else:
        prof = _plan_ilp.trace_microbatch(
            step,
            state,
            batch,
            batch_size=batch_size,
            num_microbatches=1,
            num_layers=num_layers,
            rescaled=True,
        )[1]
        bounds = [_compute_bound(prof, spec)]
        candidates = planner.microbatch_candidates(batch_size, max_microbatches=max_microbatches)
    trace_seconds = time.perf_counter() - t0

    t1 = time.perf_counter()
    found: dict[str, dict[str, Any] | None] = {"autopar": None, "autopar_tp1": None}
    grids: dict[tuple[int, int, int], dict[str, Any] | None] = {}
    for b in candidates:
        if costs == "ilp":
            plans = priced[b]
        else:
            tp, dp = (
                planner.stage_costs(prof, spec, num_microbatches=b, batch_scale=1.0 / b, tensor_parallel=t)
                for t in (True, False)
            )
            plans = {"autopar": tp, "autopar_tp1": dp, "grids": tp}
        for role, c in plans.items():
            common = stage_options(spec, c, b)
            if role == "grids":  # Megatron-style grids
                arrays = (c.latency, c.param_memory, c.activation_memory)
                for grid, g in baselines.uniform_grid_plans(
                    *arrays, logical_shapes=c.logical, **common
                ).items():
                    grid_plan = (
                        None
                        if g is None
                        else {"seconds": g.objective, "microbatches": b, "layers": prof.num_layers}
                    )
                    grids[grid] = faster(grids.get(grid), grid_plan)
                continue
            found[role] = faster(found[role], _stage_search(c, common))
    plan_seconds = time.perf_counter() - t1
    return {
        "model": model,
        "family": kind,
        "preset": preset,
        "devices": num_devices,
        "cluster": spec.name,
        "dtype": DTYPES[preset],
        "batch": batch_size,
        "layers": prof.num_layers,
        "costs": costs,
        "microbatch_candidates": list(candidates),
        "autopar": found["autopar"],
        "autopar_tp1": found["autopar_tp1"],
        "grids": {grid_name(k): v for k, v in grids.items()},
        "bound": min(bounds),
        "trace_seconds": trace_seconds,
        "plan_seconds": plan_seconds,
    }


def layer_counts(model: str, preset: str, options: dict[str, Any]) -> tuple[int, ...]:
    """The automatic clusterings' layer counts of a cell (``clustering.BYTES_FACTORS``), on the
    microbatch :func:`plan_cell` traces first."""
    step, state, batch, _, batch_size = abstract_step(model, DTYPES[preset], options["batch_size"])
    b = 1 if options["costs"] == "analytic" else _ilp_candidates(batch_size, options["ilp_microbatches"])[0]
    traced = _plan_ilp.trace_microbatch(step, state, batch, batch_size=batch_size, num_microbatches=b)[0]
    info = traced.jaxpr.eqns[traced.region_index()].params["info"]
    return (len(info.cuts) + 1, *info.other_layer_counts)


def plan_job(model: str, preset: str, num_devices: int, num_layers: int, **options: Any) -> dict[str, Any]:
    """:func:`plan_cell` of one journal task (job ``(model, preset, devices, layers)``)."""
    return plan_cell(model, preset, num_devices, num_layers=num_layers, **options)
