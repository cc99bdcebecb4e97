"""The inter-operator planner: layer profile + cluster spec -> stages on submeshes.

Analytic costs feed Alpa's stage DP (:func:`autopar._src.stages.solve_stages`):
a stage's latency per microbatch is its forward+backward FLOPs over the devices'
peak and the bytes its memory-bound equations move (:mod:`autopar._src.fusion`) over
their memory bandwidth, plus tensor-parallel all-reduces of activations, the data-parallel gradient
all-reduce spread over the step's microbatches, the point-to-point copy of its
boundary activations and a fixed dispatch cost per task; its memory is parameters,
gradients and optimizer state (divided over the tensor-parallel axis) plus the
activations one microbatch stashes for the backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from autopar._src import cluster as cluster_mod
from autopar._src import stages
from autopar._src.plan import DATA_AXIS, Plan
from autopar._src.profile import LayerProfile
from autopar._src.schedule import ScheduleName
from autopar._src.stage_problem import num_in_flight

MEMORY_HEADROOM = 0.15
"""Fraction of device memory kept free: the memory model's validated error bound
(``benchmarks/memory_model.py``), so that a plan the model says fits does fit."""

DEFAULT_TASK_OVERHEAD = 1e-4
"""Seconds of fixed cost per task the driver runs (``benchmarks/task_overhead.py``: 93 us on an
H200, 57 us on one CPU device, with a forward and a backward task per microbatch)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Cost arrays over (first layer, last layer, submesh, logical mesh)."""

    latency: np.ndarray
    """Seconds per microbatch (forward + backward) of each candidate stage."""
    param_memory: np.ndarray
    """Per-device bytes of parameters, gradients and optimizer state."""
    activation_memory: np.ndarray
    """Per-device bytes one in-flight microbatch keeps for the backward."""
    compute: np.ndarray
    """The part of ``latency`` spent computing (the rest is communication and dispatch)."""
    submeshes: tuple[tuple[int, int], ...]
    """Submesh shapes ``(hosts, devices)``."""
    logical: tuple[tuple[tuple[int, int], ...], ...]
    """Logical meshes ``(dp, tp)`` of each submesh."""


def _allreduce(num_bytes: np.ndarray | float, n: int, link: cluster_mod.Link) -> np.ndarray | float:
    """Ring all-reduce time of ``num_bytes`` over ``n`` devices."""
    if n <= 1:
        return 0.0 * num_bytes
    return 2 * (n - 1) / n * num_bytes / link.bandwidth + 2 * (n - 1) * link.latency


def stage_memory(
    profile: LayerProfile,
    start: int,
    stop: int,
    *,
    dp: int,
    tp: int,
    num_microbatches: int,
    batch_scale: float = 1.0,
) -> tuple[float, float]:
    """Per-device bytes of a stage holding layers ``start..stop-1``: ``(fixed, per_in_flight)``.

    Fixed: parameters, their gradient sums and optimizer state (split over ``tp``),
    plus, while a backward runs, one microbatch's parameter gradients and the
    largest value the backward makes; and the batch inputs of every microbatch,
    which are placed at the start of the step. Per in-flight microbatch: the
    activations its forward keeps for its backward. The caller multiplies the
    second by the schedule's in-flight count.
    """
    params = float(profile.param_bytes[start:stop].sum())
    borrowed = float(profile.borrowed_bytes[start, stop - 1])
    # A parameter an earlier stage owns: a copy and the running sum of this stage's gradient part.
    state = (params * (2.0 + profile.state_per_param) + 2 * borrowed) / tp
    largest = max(
        float(profile.backward_peak_bytes[start:stop].max(initial=0.0)) * batch_scale / dp,
        float(profile.backward_peak_replicated_bytes[start:stop].max(initial=0.0)) * batch_scale,
    )
    transient = (params + borrowed) / tp + largest
    inputs = num_microbatches * float(profile.batch_bytes[start:stop].sum()) * batch_scale / dp
    stash = (
        (
            float(profile.stash_bytes[start:stop].sum()) / dp
            + float(profile.stash_replicated_bytes[start:stop].sum())
        )
        * batch_scale
        / tp
    )
    return state + transient + inputs, stash


class PeakParts(NamedTuple):
    """The memory model's per-device peak of a stage, in the parts the sharding ILP sees."""

    inputs: float
    """Parameters and optimizer state (split over the model axis) and the batch inputs: the
    stage's inputs, which the ILP lays out and counts."""
    stashes: float
    """What the in-flight microbatches' forwards keep for their backwards, which the ILP
    counts too (as the program holds them, its ``count_held``)."""
    gradient_sums: float
    """The running sums of the gradients over microbatches, which the ILP counts as well."""
    rest: float
    """The backward's transients, which it does not (with one microbatch, also its gradients,
    which are the sums)."""


def in_flight(plan: Plan, stage: int) -> int:
    """Microbatches whose forward has run on ``stage`` and backward not yet, at most at once."""
    return num_in_flight(plan.num_stages - 1 - stage, plan.num_microbatches, plan.schedule)


def planned_peak(profile: LayerProfile, plan: Plan, stage: int) -> PeakParts:
    """The memory model's per-device peak of ``stage`` of ``plan`` (:func:`stage_memory` with the
    schedule's in-flight stashes): the sum of its first four parts."""
    st = plan.stages[stage]
    dp = st.mesh_shape[st.axis_names.index(DATA_AXIS)]
    tp = len(st.device_ids) // dp
    start, stop = st.layers
    nmb = plan.num_microbatches
    fixed, per_flight = stage_memory(profile, start, stop, dp=dp, tp=tp, num_microbatches=nmb)
    params = float(profile.param_bytes[start:stop].sum())
    borrowed = float(profile.borrowed_bytes[start, stop - 1])
    inputs = (params * (1.0 + profile.state_per_param) + borrowed) / tp + nmb * float(
        profile.batch_bytes[start:stop].sum()
    ) / dp
    sums = (params + borrowed) / tp if nmb > 1 else 0.0  # one microbatch's gradients are the sums
    return PeakParts(
        inputs=inputs,
        stashes=in_flight(plan, stage) * per_flight,
        gradient_sums=sums,
        rest=fixed - inputs - sums,
    )


def stage_costs(
    profile: LayerProfile,
    spec: cluster_mod.ClusterSpec,
    *,
    num_microbatches: int,
    batch_scale: float = 1.0,
    tensor_parallel: bool = True,
    task_overhead: float = DEFAULT_TASK_OVERHEAD,
    measured: np.ndarray | None = None,
    sharded: np.ndarray | None = None,
) -> StageCosts:
    """Analytic cost arrays for every contiguous layer range on every submesh.

    Args:
      profile: per-layer costs of one traced microbatch.
      spec: the cluster.
      num_microbatches: microbatches per step (the gradient all-reduce is spread over them).
      batch_scale: microbatch size relative to the traced one (costs that grow with
        the batch are scaled by it).
      tensor_parallel: whether logical meshes may split tensors (``tp > 1``).
      task_overhead: fixed seconds per forward or backward task.
      measured: measured seconds of one microbatch's forward+backward per layer range on
        data-parallel submeshes, ``[start, last, k]`` for the submeshes in order (see
        :func:`autopar._src.measured.layer_range_latency`); they replace the analytic
        compute, collective and dispatch terms of the logical meshes ``(n, 1)``.
      sharded: the sharding ILP's seconds per layer ``[layer, k, q]`` (see
        :func:`autopar._src.layer_sharding.layer_latency`); a stage's are the sum over its
        layers, and they replace the analytic compute and collective terms.
    """
    submeshes = cluster_mod.submesh_shapes(spec)
    logical = tuple(
        tuple(s for s in cluster_mod.logical_shapes(m) if tensor_parallel or s[1] == 1) for m in submeshes
    )
    n_layers = profile.num_layers
    q_max = max(len(q) for q in logical)
    shape = (n_layers, n_layers, len(submeshes), q_max)
    latency = np.full(shape, np.inf)
    param_mem = np.full(shape, np.inf)
    act_mem = np.full(shape, np.inf)
    compute_time = np.full(shape, np.inf)

    def ranges(x: np.ndarray) -> np.ndarray:
        def prefix(y: np.ndarray) -> np.ndarray:
            p = np.concatenate([[0.0], np.cumsum(y)])
            return p[None, 1:] - p[:-1, None]  # [i, j] = sum of y[i..j]

        unpriced = ~np.isfinite(x)  # e.g. a mesh the sharding costs leave out: inf over any range
        return np.where(prefix(unpriced) > 0, np.inf, prefix(np.where(unpriced, 0.0, x)))

    flops = ranges((profile.forward_flops + profile.backward_flops) * batch_scale)
    peak = spec.device.flops(profile.dtype)
    # Seconds of the code before the loss function that the layers' forwards run per microbatch
    # (in forward_flops too), split over the batch like the rest.
    before = ranges(profile.before_flops * batch_scale) / peak if profile.before_flops.size else 0.0
    traffic = profile.forward_traffic + profile.backward_traffic
    traffic = traffic if traffic.size else np.zeros(n_layers)
    weight_sized = profile.fixed_traffic if profile.fixed_traffic.size else np.zeros(n_layers)
    # Weight-sized traffic is the same for any microbatch and on every data-parallel device.
    fixed_traffic = ranges(weight_sized)
    traffic = ranges((traffic - weight_sized) * batch_scale)
    params = ranges(profile.param_bytes) + profile.borrowed_bytes  # the gradients each range sums
    # Every device of a stage runs each of its kernels once per microbatch, however small.
    launches = (
        ranges(profile.kernels if profile.kernels.size else np.zeros(n_layers)) * spec.device.kernel_time
    )
    acts = ranges(profile.boundary_bytes * batch_scale)
    out_bytes = np.broadcast_to(profile.boundary_bytes[None, :] * batch_scale, (n_layers, n_layers))
    valid = np.triu(np.ones((n_layers, n_layers), dtype=bool))
    for k, mesh in enumerate(submeshes):
        link = cluster_mod.link_for(spec, mesh)
        for q, (dp, tp) in enumerate(logical[k]):
            # Both shrink with the devices: each one's share of the batch, or of the split dims.
            bandwidth = spec.device.memory_bandwidth
            compute = (
                (flops / peak + traffic / bandwidth) / (dp * tp) + fixed_traffic / bandwidth / tp + launches
            )
            # Each axis over the links it spans (the model axis innermost, within a host if it fits).
            dp_link, tp_link = cluster_mod.axis_links(spec, (dp, tp))
            # Megatron-style: two all-reduces of the activations per layer, forward and backward.
            tp_comm = 4 * _allreduce(acts / dp, tp, tp_link)
            grad_sync = _allreduce(params / tp, dp, dp_link) / num_microbatches
            send = 2 * (out_bytes / dp / link.bandwidth + link.latency)
            if sharded is not None:  # the ILP prices the loss function; not the code before it
                lat = (
                    ranges(sharded[:, k, q] * batch_scale)
                    + before / (dp * tp)
                    + launches
                    + send
                    + 2 * task_overhead
                )
            else:
                lat = compute + tp_comm + grad_sync + send + 2 * task_overhead
            if measured is not None and tp == 1:
                compute = measured[:, :, k] + before / dp
                lat = compute + send
            latency[:, :, k, q] = np.where(valid, lat, np.inf)
            compute_time[:, :, k, q] = np.where(valid, compute, np.inf)
            for i in range(n_layers):
                for j in range(i, n_layers):
                    fixed, per_flight = stage_memory(
                        profile,
                        i,
                        j + 1,
                        dp=dp,
                        tp=tp,
                        num_microbatches=num_microbatches,
                        batch_scale=batch_scale,
                    )
                    param_mem[i, j, k, q] = fixed
                    act_mem[i, j, k, q] = per_flight
    return StageCosts(
        latency=latency,
        param_memory=param_mem,
        activation_memory=act_mem,
        compute=compute_time,
        submeshes=submeshes,
        logical=logical,
    )


def solve(
    profile: LayerProfile,
    spec: cluster_mod.ClusterSpec,
    *,
    num_microbatches: int,
    schedule: ScheduleName,
    batch_scale: float = 1.0,
    tensor_parallel: bool = True,
    layer_names: Sequence[str] | None = None,
    memory_headroom: float = MEMORY_HEADROOM,
    measured: np.ndarray | None = None,
    sharded: np.ndarray | None = None,
    one_stage: bool = False,
) -> tuple[stages.StageSolution, StageCosts]:
    """Runs the stage DP on the analytic costs, keeping ``memory_headroom`` of memory free;
    with ``one_stage``, over plans of one stage on the whole cluster only.

    Raises:
      NoFeasiblePlanError: if no plan fits the devices' memory.
    """
    if not 0.0 <= memory_headroom < 1.0:
        raise ValueError(f"memory_headroom must be in [0, 1), got {memory_headroom!r}")
    budget = float(spec.device.memory_bytes) * (1.0 - memory_headroom)
    costs = stage_costs(
        profile,
        spec,
        num_microbatches=num_microbatches,
        batch_scale=batch_scale,
        tensor_parallel=tensor_parallel,
        measured=measured,
        sharded=sharded,
    )
    if one_stage:
        whole = np.array([h * d == spec.num_devices for h, d in costs.submeshes])
        costs = dataclasses.replace(costs, latency=np.where(whole[:, None], costs.latency, np.inf))
    try:
        solution = _solve(costs, spec, budget, num_microbatches, schedule, layer_names)
    except stages.NoFeasiblePlanError as e:
        raise stages.NoFeasiblePlanError(
            f"{e} (The budget is the device's {spec.device.memory_bytes / 2**20:.2f} MiB less the memory "
            f"model's {memory_headroom:.0%} error margin.)"
        ) from None
    return solution, costs


def _solve(
    costs: StageCosts,
    spec: cluster_mod.ClusterSpec,
    budget: float,
    num_microbatches: int,
    schedule: ScheduleName,
    layer_names: Sequence[str] | None,
) -> stages.StageSolution:
    return stages.solve_stages(
        costs.latency,
        costs.param_memory,
        costs.activation_memory,
        submesh_devices=[h * d for h, d in costs.submeshes],
        memory_budget=budget,
        num_devices=spec.num_devices,
        num_microbatches=num_microbatches,
        schedule=schedule,
        layer_names=layer_names,
        submesh_shapes=costs.submeshes,
        logical_shapes=costs.logical,
    )


def microbatch_candidates(batch_size: int, *, max_microbatches: int = 64) -> tuple[int, ...]:
    """Microbatch counts that divide the batch, up to ``max_microbatches``."""
    return tuple(b for b in range(1, min(batch_size, max_microbatches) + 1) if batch_size % b == 0)
