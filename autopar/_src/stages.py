"""The inter-operator stage search: contiguous layers -> pipeline stages, each on a submesh.

Alpa's dynamic program over cost arrays (no devices, no JAX). With ``L`` layers, ``K``
submesh shapes and up to ``Q`` logical meshes per submesh, every array is indexed
``[i, j, k, q]``: a stage holding layers ``i..j`` (inclusive) on submesh ``k`` viewed as
logical mesh ``q``. The objective is the pipeline latency

    sum of stage latencies + (B - 1) * max stage latency

over ``B`` microbatches, with the stages' device counts adding up to the cluster and
every stage's memory within the per-device budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

StageSchedule = Literal["1f1b", "gpipe"]
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageSolution:
    """A pipeline: stages in order and its predicted latency per step."""

    stages: tuple[StageChoice, ...]
    """The stages, first to last; together they hold every layer once, in order."""
    objective: float
    """Sum of stage latencies plus (num_microbatches - 1) times the largest one, in seconds."""
    max_stage_latency: float
    """Latency of the slowest stage, in seconds."""

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
class _Problem:
    """Validated inputs; ``latency`` is inf wherever a choice is unusable."""

    latency: np.ndarray
    param_memory: np.ndarray
    activation_memory: np.ndarray
    devices: np.ndarray
    memory_budget: float
    num_devices: int
    num_microbatches: int
    schedule: str
    layer_names: tuple[str, ...]
    submesh_names: tuple[str, ...]
    logical_names: tuple[tuple[str, ...], ...]

    def fits(self, in_flight: int) -> np.ndarray:
        """Usable choices whose memory fits with ``in_flight`` microbatches of activations."""
        memory = self.param_memory + in_flight * self.activation_memory
        return np.isfinite(self.latency) & (memory <= self.memory_budget)


def _problem(
    latency: np.ndarray,
    param_memory: np.ndarray,
    activation_memory: np.ndarray,
    *,
    submesh_devices: Sequence[int] | np.ndarray,
    memory_budget: float,
    num_devices: int,
    num_microbatches: int,
    schedule: StageSchedule,
    layer_names: Sequence[str] | None,
    submesh_shapes: Sequence[tuple[int, int]] | None,
    logical_shapes: Sequence[Sequence[tuple[int, int]]] | None,
) -> _Problem:
    lat = np.array(latency, dtype=np.float64)
    if lat.ndim != 4 or lat.shape[0] != lat.shape[1] or 0 in lat.shape:
        raise ValueError(f"latency must have shape (L, L, K, Q) with L, K, Q >= 1, got {lat.shape}")
    num_layers, _, num_submeshes, num_logical = lat.shape
    mems = []
    for name, arr in (("param_memory", param_memory), ("activation_memory", activation_memory)):
        arr = np.asarray(arr, dtype=np.float64)
        if arr.shape != lat.shape:
            raise ValueError(f"{name} has shape {arr.shape}, expected latency's shape {lat.shape}")
        mems.append(arr)
    if np.isnan(lat).any() or (lat < 0).any():
        raise ValueError("latency must hold no NaN and no negative values (np.inf marks unusable choices)")
    devices = np.asarray(submesh_devices)
    if (
        devices.shape != (num_submeshes,)
        or not np.issubdtype(devices.dtype, np.integer)
        or (devices < 1).any()
    ):
        raise ValueError(f"submesh_devices must be {num_submeshes} ints >= 1, got {submesh_devices!r}")
    if not (isinstance(num_devices, int | np.integer) and num_devices >= 1):
        raise ValueError(f"num_devices must be an int >= 1, got {num_devices!r}")
    if not (isinstance(num_microbatches, int | np.integer) and num_microbatches >= 1):
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
    if not (np.isfinite(memory_budget) and memory_budget > 0):
        raise ValueError(f"memory_budget must be positive and finite, got {memory_budget!r}")
    if schedule not in STAGE_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {STAGE_SCHEDULES}")
    # Only j >= i is a stage, and a submesh larger than the cluster is never usable.
    upper = np.triu(np.ones((num_layers, num_layers), dtype=bool))[:, :, None, None]
    lat = np.where(upper & (devices <= num_devices)[None, None, :, None], lat, np.inf)
    usable = np.isfinite(lat)
    for name, arr in zip(("param_memory", "activation_memory"), mems, strict=True):
        if np.isnan(arr[usable]).any() or (arr[usable] < 0).any():
            raise ValueError(f"{name} must hold no NaN and no negative values where latency is finite")
    param, act = (np.where(usable, arr, 0.0) for arr in mems)
    names = tuple(layer_names) if layer_names is not None else tuple(f"layer {i}" for i in range(num_layers))
    if len(names) != num_layers:
        raise ValueError(f"layer_names has {len(names)} names, expected {num_layers}")
    if submesh_shapes is not None and len(submesh_shapes) != num_submeshes:
        raise ValueError(f"submesh_shapes has {len(submesh_shapes)} shapes, expected {num_submeshes}")
    if logical_shapes is not None and len(logical_shapes) != num_submeshes:
        raise ValueError(f"logical_shapes has {len(logical_shapes)} entries, expected {num_submeshes}")
    sub_names = tuple(
        str(tuple(submesh_shapes[k])) if submesh_shapes is not None else f"#{k} ({devices[k]} devices)"
        for k in range(num_submeshes)
    )
    log_names = tuple(
        tuple(
            str(tuple(logical_shapes[k][q]))
            if logical_shapes is not None and q < len(logical_shapes[k])
            else f"#{q}"
            for q in range(num_logical)
        )
        for k in range(num_submeshes)
    )
    return _Problem(
        latency=lat,
        param_memory=param,
        activation_memory=act,
        devices=devices.astype(np.int64),
        memory_budget=float(memory_budget),
        num_devices=int(num_devices),
        num_microbatches=int(num_microbatches),
        schedule=schedule,
        layer_names=names,
        submesh_names=sub_names,
        logical_names=log_names,
    )


def _solution(prob: _Problem, choices: Sequence[tuple[int, int, int, int]]) -> StageSolution | None:
    """Builds the solution for ``(start, stop, submesh, logical)`` stages, or None if infeasible."""
    num_stages = len(choices)
    stages = []
    for pos, (start, stop, k, q) in enumerate(choices):
        lat = float(prob.latency[start, stop - 1, k, q])
        in_flight = num_in_flight(num_stages - 1 - pos, prob.num_microbatches, prob.schedule)  # type: ignore[arg-type]
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


def _fmt_bytes(num: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= scale:
            return f"{num / scale:.2f} {unit}"
    return f"{num:.0f} B"


def _no_plan_error(prob: _Problem) -> NoFeasiblePlanError:
    """Explains infeasibility through the layer that is hardest to place on its own."""
    in_flight = num_in_flight(0, prob.num_microbatches, prob.schedule)  # type: ignore[arg-type]
    budget = _fmt_bytes(prob.memory_budget)
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
    layer = int(np.argmax(best))
    k, q = np.unravel_index(int(np.argmin(mem[layer])), mem[layer].shape)
    params, acts = prob.param_memory[layer, layer, k, q], prob.activation_memory[layer, layer, k, q]
    breakdown = (
        f"alone on submesh {prob.submesh_names[k]} with logical mesh {prob.logical_names[k][q]} it needs "
        f"{_fmt_bytes(params)} of parameters/gradients/optimizer state + {_fmt_bytes(acts)} of activations x "
        f"{in_flight} in-flight microbatch(es) = {_fmt_bytes(best[layer])} per device, against a budget of "
        f"{budget} per device"
    )
    if best[layer] > prob.memory_budget:
        return NoFeasiblePlanError(
            f"No pipeline plan fits in {budget} per device: the largest layer, {prob.layer_names[layer]}, does "
            f"not fit anywhere: {breakdown}. Use more devices per stage, fewer microbatches in flight, "
            "rematerialisation or a larger memory budget."
        )
    return NoFeasiblePlanError(
        f"No pipeline plan fits in {budget} per device: every layer fits alone, but no split into stages on "
        f"exactly {prob.num_devices} devices does ({prob.schedule} keeps up to {prob.num_microbatches} "
        f"microbatches of activations in flight on early stages). The largest layer is "
        f"{prob.layer_names[layer]}: {breakdown}. Use fewer microbatches, more memory, or another device count."
    )


def _state_flights(prob: _Problem) -> tuple[np.ndarray, np.ndarray]:
    """In-flight counts of the DP's stage-count states, and the usable-and-fitting mask of each.

    State ``c`` is "the suffix from here has ``c`` stages"; its first stage keeps
    ``min(c, B)`` microbatches in flight (one for GPipe's single state, which keeps ``B``).
    The last state also stands for every larger count: it is the first whose mask equals
    the mask of the largest possible count, so memory cannot tell those counts apart.
    """
    if prob.schedule == "gpipe":
        return np.array([prob.num_microbatches]), prob.fits(prob.num_microbatches)[None]
    max_stages = min(prob.latency.shape[0], prob.num_devices)
    last = prob.fits(min(max_stages, prob.num_microbatches))
    masks = []
    for c in range(1, max_stages + 1):
        masks.append(prob.fits(min(c, prob.num_microbatches)))
        if np.array_equal(masks[-1], last):
            break
    flights = np.minimum(np.arange(1, len(masks) + 1), prob.num_microbatches)
    return flights, np.stack(masks)


def _rest(table: np.ndarray) -> np.ndarray:
    """What may follow a stage in each state: one state fewer, or the capped state itself."""
    rest = table[:-1].copy()
    rest[-1] = np.minimum(table[-2], table[-1])
    return rest


def _dp(cost: np.ndarray, devices: np.ndarray, num_devices: int) -> np.ndarray:
    """Minimum latency sums ``table[c, i, d]``: layers i.. on exactly d devices, suffix state c.

    ``cost[c - 1, i, j, k]`` is the best stage latency for layers i..j on submesh k in state c.
    """
    num_states, num_layers = cost.shape[0], cost.shape[1]
    table = np.full((num_states + 1, num_layers + 1, num_devices + 1), np.inf)
    table[0, num_layers, 0] = 0.0
    shift = np.arange(num_devices + 1)[None, :] - devices[:, None]  # (K, D + 1): devices left after
    valid, shift = shift >= 0, np.maximum(shift, 0)
    # after[c - 1, s, k, d]: best continuation from layer s with d devices minus submesh k's.
    after = np.full((num_states, num_layers + 1, len(devices), num_devices + 1), np.inf)
    after[:, num_layers] = np.where(valid, _rest(table[:, num_layers])[:, shift], np.inf)
    finite = np.isfinite(cost).any(axis=(0, 3))  # (L, L): some stage i..j exists
    for i in range(num_layers - 1, -1, -1):
        js = np.flatnonzero(finite[i])
        if len(js):
            lo, hi = js[0], js[-1] + 1
            total = cost[:, i, lo:hi, :, None] + after[:, lo + 1 : hi + 1]
            table[1:, i] = total.reshape(num_states, -1, num_devices + 1).min(axis=1)
        after[:, i] = np.where(valid, _rest(table[:, i])[:, shift], np.inf)
    return table


def _backtrack(
    prob: _Problem, masks: np.ndarray, cost: np.ndarray, table: np.ndarray, t_max: float
) -> list[tuple[int, int, int, int]]:
    """Reads the plan off the table, taking at each stage the first optimal choice in the order
    longer stage, smaller submesh index, smaller logical index, fewer remaining stages."""
    num_states, num_layers = cost.shape[0], cost.shape[1]
    rest = _rest(table)
    allowed = np.arange(1, num_states + 1)
    i, d = 0, prob.num_devices
    choices = []
    while i < num_layers:
        left = d - prob.devices
        after = np.where(left >= 0, rest[:, i + 1 :, np.maximum(left, 0)], np.inf)  # (C, L - i, K)
        total = cost[:, i, i:] + after
        blocked = np.ones(num_states, dtype=bool)
        blocked[allowed - 1] = False
        total[blocked] = np.inf
        order = total[:, ::-1].transpose(1, 2, 0)  # (j descending, k, c)
        flat = int(np.argmin(order))
        j_rev, k, c_idx = np.unravel_index(flat, order.shape)
        j, c = num_layers - 1 - int(j_rev), int(c_idx) + 1
        lat = np.where(
            masks[c - 1, i, j, k] & (prob.latency[i, j, k] <= t_max), prob.latency[i, j, k], np.inf
        )
        choices.append((i, j + 1, int(k), int(np.argmin(lat))))
        allowed = np.array([c - 1]) if c < num_states else np.array([c - 1, c])
        allowed = allowed[allowed >= 1]
        i, d = j + 1, d - int(prob.devices[k])
    return choices


def _solve_at(prob: _Problem, masks: np.ndarray, t_max: float) -> tuple[float, StageSolution] | None:
    """The best plan whose stages all take at most ``t_max``: (latency sum, solution), or None."""
    lat = np.where(masks & (prob.latency <= t_max), prob.latency, np.inf)
    cost = lat.min(axis=-1)
    table = _dp(cost, prob.devices, prob.num_devices)
    total = float(table[1:, 0, prob.num_devices].min())
    if not np.isfinite(total):
        return None
    sol = _solution(prob, _backtrack(prob, masks, cost, table, t_max))
    assert sol is not None, "the dynamic program produced an infeasible plan"
    return total, sol


def solve_stages(
    latency: np.ndarray,
    param_memory: np.ndarray,
    activation_memory: np.ndarray,
    *,
    submesh_devices: Sequence[int] | np.ndarray,
    memory_budget: float,
    num_devices: int,
    num_microbatches: int,
    schedule: StageSchedule = "1f1b",
    layer_names: Sequence[str] | None = None,
    submesh_shapes: Sequence[tuple[int, int]] | None = None,
    logical_shapes: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> StageSolution:
    """Splits layers into pipeline stages on submeshes, minimising Alpa's pipeline latency.

    For each candidate bound ``t_max`` on stage latency (the distinct latencies, in
    increasing order) a dynamic program from the last layer backwards minimises the sum of
    stage latencies; the best ``sum + (B - 1) * t_max`` wins. The scan stops once even the
    unbounded minimum sum plus ``(B - 1) * t_max`` cannot beat the best found.

    Exact ties go to the smallest ``t_max``; within it, the plan is read off stage by stage
    from the first, preferring a longer stage, then a smaller submesh index, then a smaller
    logical index, then fewer stages after it. Equal inputs always give equal plans.

    Args:
      latency: ``[i, j, k, q]`` seconds of one microbatch's forward and backward for layers
        i..j on submesh k as logical mesh q; ``np.inf`` where not applicable.
      param_memory: ``[i, j, k, q]`` bytes per device of parameters, gradients, optimizer state.
      activation_memory: ``[i, j, k, q]`` bytes per device of activations one in-flight
        microbatch keeps for the backward.
      submesh_devices: device count of each submesh shape.
      memory_budget: bytes per device.
      num_devices: devices the stages must use in total, exactly.
      num_microbatches: microbatches per step (B).
      schedule: ``"1f1b"`` (a stage with s stages after it keeps min(s + 1, B) microbatches of
        activations) or ``"gpipe"`` (every stage keeps B).
      layer_names, submesh_shapes, logical_shapes: descriptions used in error messages.

    Returns:
      The optimal :class:`StageSolution`.

    Raises:
      NoFeasiblePlanError: if no plan fits; the message names the hardest layer to place.
      ValueError: on malformed inputs.
    """
    prob = _problem(
        latency,
        param_memory,
        activation_memory,
        submesh_devices=submesh_devices,
        memory_budget=memory_budget,
        num_devices=num_devices,
        num_microbatches=num_microbatches,
        schedule=schedule,
        layer_names=layer_names,
        submesh_shapes=submesh_shapes,
        logical_shapes=logical_shapes,
    )
    _, masks = _state_flights(prob)
    unbounded = _solve_at(prob, masks, np.inf)
    if unbounded is None:
        raise _no_plan_error(prob)
    min_sum, best = unbounded
    best_t = np.inf
    scale = prob.num_microbatches - 1
    if scale == 0:
        return best
    # Every layer sits in some stage, so t_max is at least the largest of the layers' cheapest covers.
    usable = np.where(masks[0], prob.latency, np.inf)  # the first state has the loosest memory rule
    cheapest = usable.min(axis=(2, 3))
    floor = max(cheapest[: layer + 1, layer:].min() for layer in range(cheapest.shape[0]))
    candidates = np.unique(usable[(usable >= floor) & (usable <= best.max_stage_latency)])
    # Feasibility grows with t_max: gallop, then bisect, to the first feasible bound.
    cache: dict[int, tuple[float, StageSolution] | None] = {}

    def at(idx: int) -> tuple[float, StageSolution] | None:
        if idx not in cache:
            cache[idx] = _solve_at(prob, masks, float(candidates[idx]))
        return cache[idx]

    lo, step = 0, 1
    while lo < len(candidates) - 1 and at(lo) is None:
        hi = min(lo + step, len(candidates) - 1)
        if at(hi) is None:
            lo, step = hi + 1, step * 2
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if at(mid) is None else (lo, mid)
    for idx in range(lo, len(candidates)):
        t_max = float(candidates[idx])
        if min_sum + scale * t_max > best.objective:
            break
        found = at(idx)
        if found is None:
            continue
        total, sol = found
        if sol.objective < best.objective or (sol.objective == best.objective and t_max < best_t):
            best, best_t = sol, t_max
        if total == min_sum:
            break  # larger bounds cannot lower the sum, only the max term
    return best


def choose_num_microbatches(
    candidates: Sequence[int], solve: Callable[[int], StageSolution]
) -> tuple[int, StageSolution]:
    """Picks the number of microbatches whose solution has the smallest objective.

    Args:
      candidates: microbatch counts to try.
      solve: the stage search for one count (costs depend on the microbatch size).

    Returns:
      ``(num_microbatches, solution)``; ties go to the smaller count.

    Raises:
      NoFeasiblePlanError: the last one raised, if no candidate has a plan.
    """
    if not candidates or any(int(b) != b or b < 1 for b in candidates):
        raise ValueError(f"candidates must be a non-empty sequence of ints >= 1, got {candidates!r}")
    best: tuple[int, StageSolution] | None = None
    error: NoFeasiblePlanError | None = None
    for b in sorted(set(int(c) for c in candidates)):
        try:
            sol = solve(b)
        except NoFeasiblePlanError as e:
            error = e
            continue
        if best is None or sol.objective < best[1].objective:
            best = (b, sol)
    if best is None:
        assert error is not None
        raise error
    return best
