"""The stage search's problem: validated cost arrays, the solutions built from them, and the
error that explains why none fits.

Arrays are indexed ``[i, j, k, q]``: a stage holding layers ``i..j`` (inclusive) on submesh
``k`` viewed as logical mesh ``q``. :mod:`autopar._src.stages` solves the problem;
:mod:`autopar._src.baselines` scores hand-made plans on the same problem.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from autopar._src.schedule import ScheduleName

StageSchedule = ScheduleName
STAGE_SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe")


class NoFeasiblePlanError(ValueError):
    """No partition of the layers into stages fits the devices and their memory."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageChoice:
    """One stage of a solution."""

    start: int
    """First layer of the stage."""
    stop: int
    """One past the last layer of the stage."""
    submesh: int
    """Index of the stage's submesh shape."""
    logical: int
    """Index of the stage's logical mesh among its submesh's logical meshes."""
    latency: float
    """Seconds of one microbatch's forward and backward on the stage."""
    memory: float
    """Peak bytes per device: parameters and optimizer state plus in-flight activations."""

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"StageChoice needs 0 <= start < stop, got start={self.start}, stop={self.stop}")
        if self.submesh < 0 or self.logical < 0:
            raise ValueError(f"StageChoice.submesh={self.submesh} and logical={self.logical} must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageSolution:
    """A pipeline: stages in order and its predicted latency per step."""

    stages: tuple[StageChoice, ...]
    """The stages, first to last; together they hold every layer once, in order."""
    objective: float
    """Sum of stage latencies plus (num_microbatches - 1) times the largest one, in seconds."""
    max_stage_latency: float
    """Latency of the slowest stage, in seconds."""

    def __post_init__(self) -> None:
        bounds = [(st.start, st.stop) for st in self.stages]
        if not bounds or bounds[0][0] != 0 or any(a[1] != b[0] for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"StageSolution.stages must be contiguous from layer 0, got layers {bounds}")

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return len(self.stages)


def num_in_flight(stages_after: int, num_microbatches: int, schedule: StageSchedule) -> int:
    """Microbatches of activations a stage keeps at its peak.

    Under 1F1B a stage with ``s`` stages after it starts ``s + 1`` forwards before its first
    backward; under GPipe every stage runs all forwards first.
    """
    if schedule == "gpipe":
        return num_microbatches
    return min(stages_after + 1, num_microbatches)


@dataclasses.dataclass(frozen=True)
class Problem:
    """Validated inputs; ``latency`` is inf wherever a choice is unusable."""

    latency: np.ndarray
    param_memory: np.ndarray
    activation_memory: np.ndarray
    devices: np.ndarray
    memory_budget: float
    num_devices: int
    num_microbatches: int
    schedule: StageSchedule
    layer_names: tuple[str, ...]
    submesh_names: tuple[str, ...]
    logical_names: tuple[tuple[str, ...], ...]

    def fits(self, in_flight: int) -> np.ndarray:
        """Usable choices whose memory fits with ``in_flight`` microbatches of activations."""
        memory = self.param_memory + in_flight * self.activation_memory
        return np.isfinite(self.latency) & (memory <= self.memory_budget)


def make_problem(
    latency: np.ndarray,
    param_memory: np.ndarray,
    activation_memory: np.ndarray,
    *,
    submesh_devices: Sequence[int] | np.ndarray,
    memory_budget: float,
    num_devices: int,
    num_microbatches: int,
    schedule: StageSchedule,
    layer_names: Sequence[str] | None = None,
    submesh_shapes: Sequence[tuple[int, int]] | None = None,
    logical_shapes: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> Problem:
    """Checks the arguments shared by the stage searches and the baselines."""
    lat = np.array(latency, dtype=np.float64)
    if lat.ndim != 4 or lat.shape[0] != lat.shape[1] or 0 in lat.shape:
        raise ValueError(f"latency must have shape (L, L, K, Q) with L, K, Q >= 1, got {lat.shape}")
    num_layers, _, num_submeshes, num_logical = lat.shape
    if np.isnan(lat).any() or (lat < 0).any():
        raise ValueError("latency must hold no NaN and no negative values (np.inf marks unusable choices)")
    devices = np.asarray(submesh_devices)
    if devices.shape != (num_submeshes,) or devices.dtype.kind not in "iu" or (devices < 1).any():
        raise ValueError(f"submesh_devices must be {num_submeshes} ints >= 1, got {submesh_devices!r}")
    for name, value in (("num_devices", num_devices), ("num_microbatches", num_microbatches)):
        if not (isinstance(value, int | np.integer) and value >= 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not (np.isfinite(memory_budget) and memory_budget > 0):
        raise ValueError(f"memory_budget must be positive and finite, got {memory_budget!r}")
    if schedule not in STAGE_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {STAGE_SCHEDULES}")
    # Only j >= i is a stage, and a submesh larger than the cluster is never usable.
    upper = np.triu(np.ones((num_layers, num_layers), dtype=bool))[:, :, None, None]
    lat = np.where(upper & (devices <= num_devices)[:, None], lat, np.inf)
    usable = np.isfinite(lat)
    mems = []
    for name, arr in (("param_memory", param_memory), ("activation_memory", activation_memory)):
        arr = np.asarray(arr, dtype=np.float64)
        if arr.shape != lat.shape:
            raise ValueError(f"{name} has shape {arr.shape}, expected latency's shape {lat.shape}")
        if np.isnan(arr[usable]).any() or (arr[usable] < 0).any():
            raise ValueError(f"{name} must hold no NaN and no negative values where latency is finite")
        mems.append(np.where(usable, arr, 0.0))
    for name, given, size in (
        ("layer_names", layer_names, num_layers),
        ("submesh_shapes", submesh_shapes, num_submeshes),
        ("logical_shapes", logical_shapes, num_submeshes),
    ):
        if given is not None and len(given) != size:
            raise ValueError(f"{name} has {len(given)} entries, expected {size}")
    return Problem(
        latency=lat,
        param_memory=mems[0],
        activation_memory=mems[1],
        devices=devices.astype(np.int64),
        memory_budget=float(memory_budget),
        num_devices=int(num_devices),
        num_microbatches=int(num_microbatches),
        schedule=schedule,
        layer_names=tuple(layer_names or (f"layer {i}" for i in range(num_layers))),
        submesh_names=tuple(
            str(tuple(submesh_shapes[k]))
            if submesh_shapes
            else f"#{k} ({devices[k]} device{'s' if devices[k] > 1 else ''})"
            for k in range(num_submeshes)
        ),
        logical_names=tuple(
            tuple(
                str(tuple(logical_shapes[k][q])) if logical_shapes and q < len(logical_shapes[k]) else f"#{q}"
                for q in range(num_logical)
            )
            for k in range(num_submeshes)
        ),
    )


def make_solution(prob: Problem, choices: Sequence[tuple[int, int, int, int]]) -> StageSolution | None:
    """Builds the solution for ``(start, stop, submesh, logical)`` stages, or None if infeasible."""
    num_stages = len(choices)
    stages = []
    for pos, (start, stop, k, q) in enumerate(choices):
        lat = float(prob.latency[start, stop - 1, k, q])
        in_flight = num_in_flight(num_stages - 1 - pos, prob.num_microbatches, prob.schedule)
        mem = float(
            prob.param_memory[start, stop - 1, k, q]
            + in_flight * prob.activation_memory[start, stop - 1, k, q]
        )
        if not np.isfinite(lat) or mem > prob.memory_budget:
            return None
        stages.append(StageChoice(start=start, stop=stop, submesh=k, logical=q, latency=lat, memory=mem))
    bounds = [c[0] for c in choices] + [choices[-1][1]] if choices else []
    if not bounds or bounds[0] != 0 or bounds[-1] != prob.latency.shape[0] or np.any(np.diff(bounds) <= 0):
        return None
    if sum(int(prob.devices[c[2]]) for c in choices) != prob.num_devices:
        return None
    # Summed last to first, exactly as the dynamic program adds them, so objectives compare bit for bit.
    total = 0.0
    for st in reversed(stages):
        total = st.latency + total
    worst = max(st.latency for st in stages)
    return StageSolution(
        stages=tuple(stages), objective=total + (prob.num_microbatches - 1) * worst, max_stage_latency=worst
    )


def format_bytes(num: float) -> str:
    """``num`` bytes in GiB, MiB or KiB with two decimals."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= scale:
            return f"{num / scale:.2f} {unit}"
    return f"{num:.0f} B"


def no_plan_error(prob: Problem) -> NoFeasiblePlanError:
    """Explains infeasibility through the layer that is hardest to place on its own."""
    in_flight = num_in_flight(0, prob.num_microbatches, prob.schedule)
    budget = format_bytes(prob.memory_budget)
    layers = np.arange(prob.latency.shape[0])
    lat = prob.latency[layers, layers]  # (L, K, Q): each layer alone
    mem = np.where(
        np.isfinite(lat),
        prob.param_memory[layers, layers] + in_flight * prob.activation_memory[layers, layers],
        np.inf,
    )
    best = mem.reshape(len(layers), -1).min(axis=1)
    if np.isinf(best).any():
        layer = int(np.argmax(np.isinf(best)))
        return NoFeasiblePlanError(
            f"No pipeline plan: {prob.layer_names[layer]} has no usable stage (every latency is inf or "
            f"needs more than the {prob.num_devices} devices available)."
        )
    sums = {0}
    for _ in range(len(layers)):  # device totals of up to L stages
        sums |= {t + int(n) for t in sums for n in prob.devices if t + n <= prob.num_devices}
    if prob.num_devices not in sums:
        return NoFeasiblePlanError(
            f"No pipeline plan: stages of {sorted(set(prob.devices.tolist()))} devices cannot add up to "
            f"exactly {prob.num_devices} devices with at most {len(layers)} stages; pass submesh shapes "
            "whose device counts can."
        )
    layer = int(np.argmax(best))
    k, q = np.unravel_index(int(np.argmin(mem[layer])), mem[layer].shape)
    params, acts = prob.param_memory[layer, layer, k, q], prob.activation_memory[layer, layer, k, q]
    breakdown = (
        f"alone on submesh {prob.submesh_names[k]} with logical mesh {prob.logical_names[k][q]} it needs "
        f"{format_bytes(params)} of parameters/gradients/optimizer state/temporaries + {format_bytes(acts)} "
        "of activations x "
        f"{in_flight} in-flight microbatch(es) = {format_bytes(best[layer])} per device, against a budget of "
        f"{budget} per device"
    )
    if best[layer] > prob.memory_budget:
        return NoFeasiblePlanError(
            f"No pipeline plan fits in {budget} per device: the largest layer, {prob.layer_names[layer]}, "
            f"does not fit anywhere: {breakdown}. Use more devices per stage, more microbatches (each "
            "holds fewer rows of activations), rematerialisation or a larger memory budget."
        )
    return NoFeasiblePlanError(
        f"No pipeline plan fits in {budget} per device: every layer fits alone, but no split into stages "
        f"on exactly {prob.num_devices} devices does ({_in_flight_rule(prob)}). The largest layer is "
        f"{prob.layer_names[layer]}: {breakdown}. Use more microbatches (each holds fewer rows of "
        "activations), more memory, or another device count."
    )


def _in_flight_rule(prob: Problem) -> str:
    b = prob.num_microbatches
    if prob.schedule == "gpipe":
        return f"under gpipe every stage keeps the activations of all {b} microbatches"
    return (
        f"under {prob.schedule} a stage with s stages after it keeps the activations of min(s + 1, {b}) "
        "microbatches"
    )
