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
import heapq
import itertools
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
class _Problem:
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
    layer_names: Sequence[str] | None = None,
    submesh_shapes: Sequence[tuple[int, int]] | None = None,
    logical_shapes: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> _Problem:
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
    return _Problem(
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


def _solution(prob: _Problem, choices: Sequence[tuple[int, int, int, int]]) -> StageSolution | None:
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


def _no_plan_error(prob: _Problem) -> NoFeasiblePlanError:
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
            f"does not fit anywhere: {breakdown}. Use more devices per stage, fewer microbatches in "
            "flight, rematerialisation or a larger memory budget."
        )
    return NoFeasiblePlanError(
        f"No pipeline plan fits in {budget} per device: every layer fits alone, but no split into stages "
        f"on exactly {prob.num_devices} devices does ({prob.schedule} keeps up to {prob.num_microbatches} "
        f"microbatches of activations in flight on early stages). The largest layer is "
        f"{prob.layer_names[layer]}: {breakdown}. Use fewer microbatches, more memory, or another device "
        "count."
    )


def _capacity(prob: _Problem) -> tuple[np.ndarray, int]:
    """How many of the DP's stage-count states each choice fits in, and the number of states.

    State ``c`` means "this stage and the ones after it are ``c`` stages"; under 1F1B its
    first stage keeps ``min(c, B)`` microbatches in flight, so a choice that fits in state
    ``c`` fits in every smaller one. GPipe has a single state (``B`` in flight).
    """
    if prob.schedule == "gpipe":
        return prob.fits(prob.num_microbatches).astype(np.int64), 1
    max_states = min(prob.latency.shape[0], prob.num_devices)
    top = min(max_states, prob.num_microbatches)
    usable = np.isfinite(prob.latency)
    param, act, budget = prob.param_memory, prob.activation_memory, prob.memory_budget

    def fits(flights: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore"):  # 0 * inf activations where nothing is in flight
            return usable & (flights >= 1) & (param + flights * act <= budget)

    with np.errstate(divide="ignore", invalid="ignore"):
        guess = np.where(act > 0, np.floor((budget - param) / act), np.where(param <= budget, top, 0))
    flights = np.clip(np.nan_to_num(guess, posinf=top, neginf=0), 0, top).astype(np.int64)
    flights[~usable] = 0
    # The division can be off by one against the exact test the plan is checked with: settle it.
    while (down := (flights >= 1) & ~fits(flights)).any():
        flights -= down
    while (up := (flights < top) & fits(flights + 1)).any():
        flights += up
    # A stage is followed by at most one stage per remaining layer and per smallest submesh; a
    # choice that fits every count it can reach is as good as one that fits all.
    num_layers = prob.latency.shape[0]
    after = np.minimum(
        num_layers - 1 - np.arange(num_layers)[None, :, None],
        (prob.num_devices - prob.devices[None, None, :]) // prob.devices.min(),
    )
    lifted = (flights >= top) | ((flights >= 1) & (flights > after[..., None]))
    return np.where(lifted, max_states, flights), max_states


@dataclasses.dataclass(frozen=True)
class _Bounded:
    """The stage choices whose latency is within one bound t_max, as the DP's states see them."""

    latency: np.ndarray
    """``[i, j, k, q]`` latency, inf outside the bound or the memory budget."""
    level: np.ndarray
    """``[i, j, k, q]`` the last state the choice fits, at most ``num_states``."""
    num_states: int
    """States of the DP; the last one stands for itself and every larger stage count."""

    def row(self, i: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """``cost[c - 1, j - lo, k]``: fastest fitting latency of layers i..j on submesh k in state c."""
        states = np.arange(1, self.num_states + 1)[:, None, None, None]
        lat, level = self.latency[i, lo:hi], self.level[i, lo:hi]
        return np.where(level >= states, lat, np.inf).min(axis=-1)


def _bounded(prob: _Problem, capacity: np.ndarray, max_states: int, t_max: float) -> _Bounded:
    """Restricts the choices to ``t_max`` and merges the states memory cannot tell apart.

    The last state is one past the largest capacity short of all states among the choices
    within ``t_max``: from there on every count admits the same choices. Small bounds
    therefore need few states.
    """
    relevant = (capacity >= 1) & (prob.latency <= t_max)
    partial = capacity[relevant & (capacity < max_states)]
    num_states = min(max_states, 1 + int(partial.max())) if partial.size else 1
    return _Bounded(
        latency=np.where(relevant, prob.latency, np.inf),
        level=np.minimum(capacity, num_states),
        num_states=num_states,
    )


def _rest(table: np.ndarray) -> np.ndarray:
    """What may follow a stage in each state: one state fewer, or the capped state itself."""
    rest = table[:-1].copy()
    rest[-1] = np.minimum(table[-2], table[-1])
    return rest


def _dp(bounded: _Bounded, devices: np.ndarray, num_devices: int) -> np.ndarray:
    """Minimum latency sums ``table[c, i, d]``: layers i.. on exactly d devices, suffix state c."""
    num_states, num_layers = bounded.num_states, bounded.latency.shape[0]
    table = np.full((num_states + 1, num_layers + 1, num_devices + 1), np.inf)
    table[0, num_layers, 0] = 0.0
    shift = np.arange(num_devices + 1)[None, :] - devices[:, None]  # (K, D + 1): devices left after
    valid, shift = shift >= 0, np.maximum(shift, 0)
    # after[c - 1, s, k, d]: best continuation from layer s with d devices minus submesh k's.
    after = np.empty((num_states, num_layers + 1, len(devices), num_devices + 1))  # rows set before use
    after[:, num_layers] = np.where(valid, _rest(table[:, num_layers])[:, shift], np.inf)
    finite = np.isfinite(bounded.latency).any(axis=(2, 3))  # (L, L): some stage i..j exists
    for i in range(num_layers - 1, -1, -1):
        js = np.flatnonzero(finite[i])
        if len(js):
            lo, hi = js[0], js[-1] + 1
            states = min(num_states, num_layers - i)  # c stages need c layers
            total = bounded.row(i, lo, hi)[:states, ..., None] + after[:states, lo + 1 : hi + 1]
            table[1 : states + 1, i] = total.reshape(states, -1, num_devices + 1).min(axis=1)
        after[:, i] = np.where(valid, _rest(table[:, i])[:, shift], np.inf)
    return table


def _backtrack(prob: _Problem, bounded: _Bounded, table: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Reads the plan off the table, taking at each stage the first optimal choice in the order
    longer stage, smaller submesh index, smaller logical index, fewer remaining stages."""
    num_states, num_layers = bounded.num_states, bounded.latency.shape[0]
    rest = _rest(table)
    allowed = np.arange(1, num_states + 1)
    i, d = 0, prob.num_devices
    choices = []
    while i < num_layers:
        left = d - prob.devices
        after = np.where(left >= 0, rest[:, i + 1 :, np.maximum(left, 0)], np.inf)  # (C, L - i, K)
        total = bounded.row(i, i) + after
        blocked = np.ones(num_states, dtype=bool)
        blocked[allowed - 1] = False
        total[blocked] = np.inf
        order = total[:, ::-1].transpose(1, 2, 0)  # (j descending, k, c)
        j_rev, k, c_idx = np.unravel_index(int(np.argmin(order)), order.shape)
        j, c = num_layers - 1 - int(j_rev), int(c_idx) + 1
        lat = np.where(bounded.level[i, j, k] >= c, bounded.latency[i, j, k], np.inf)
        choices.append((i, j + 1, int(k), int(np.argmin(lat))))
        allowed = np.array([c - 1]) if c < num_states else np.array([c - 1, c])
        allowed = allowed[allowed >= 1]
        i, d = j + 1, d - int(prob.devices[k])
    return choices


def _solve_at(
    prob: _Problem, capacity: np.ndarray, max_states: int, t_max: float
) -> tuple[float, StageSolution] | None:
    """The best plan whose stages all take at most ``t_max``: (latency sum, solution), or None."""
    bounded = _bounded(prob, capacity, max_states, t_max)
    table = _dp(bounded, prob.devices, prob.num_devices)
    total = float(table[1:, 0, prob.num_devices].min())
    if not np.isfinite(total):
        return None
    sol = _solution(prob, _backtrack(prob, bounded, table))
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

    Alpa's algorithm: for a bound ``t_max`` on stage latency (candidates: the distinct
    latencies), a dynamic program from the last layer backwards, over (start layer, devices
    left, stages after), minimises the sum of stage latencies; the best
    ``sum + (B - 1) * t_max`` wins. Rather than scanning every candidate in increasing order
    until ``(B - 1) * t_max`` exceeds the best, a branch and bound over the candidates
    skips those that provably cannot win; the result is the same.

    Exact ties go to the smallest ``t_max`` (when B > 1); within it, the plan is read off stage by stage
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
        latency, param_memory, activation_memory, submesh_devices=submesh_devices,
        memory_budget=memory_budget, num_devices=num_devices, num_microbatches=num_microbatches,
        schedule=schedule, layer_names=layer_names, submesh_shapes=submesh_shapes,
        logical_shapes=logical_shapes,
    )  # fmt: skip
    capacity, max_states = _capacity(prob)
    unbounded = _solve_at(prob, capacity, max_states, np.inf)
    if unbounded is None:
        raise _no_plan_error(prob)
    if prob.num_microbatches == 1:
        return unbounded[1]  # no max term: the unbounded sum is the objective
    return _search_t_max(prob, capacity, max_states, *unbounded)


def _search_t_max(
    prob: _Problem, capacity: np.ndarray, max_states: int, min_sum: float, plan: StageSolution
) -> StageSolution:
    """Finds the best bound t_max among the candidate latencies, by branch and bound.

    ``S(t)``, the least latency sum with stages of at most ``t``, falls as ``t`` grows, so
    over a range of unexplored candidates ``(a, b)`` the objective is at least
    ``S(b) + (B - 1) * t[a + 1]``; ranges that cannot beat the best are skipped. A solution
    for ``t`` whose slowest stage takes ``m`` also settles every bound in ``[m, t]``. The
    candidates are those of Alpa's increasing scan and so is the plan returned, but far
    fewer dynamic programs are solved.
    """
    scale = prob.num_microbatches - 1
    usable = np.where(capacity >= 1, prob.latency, np.inf)
    # Every layer sits in some stage, so t_max is at least the largest of the layers' cheapest covers.
    cheapest = usable.min(axis=(2, 3))
    floor = max(cheapest[: layer + 1, layer:].min() for layer in range(cheapest.shape[0]))
    candidates = np.unique(usable[np.isfinite(usable) & (usable >= floor)])
    cache: dict[int, tuple[float, StageSolution] | None] = {}

    def solve(idx: int) -> tuple[float, StageSolution] | None:
        if idx not in cache:
            cache[idx] = _solve_at(prob, capacity, max_states, float(candidates[idx]))
        return cache[idx]

    def index(t_max: float) -> int:
        idx = int(np.searchsorted(candidates, t_max))
        assert candidates[idx] == t_max
        return idx

    top = index(plan.max_stage_latency)
    # (objective, candidate index): the smaller t_max wins exact ties.
    best = (min_sum + scale * candidates[top], top)
    # Ranges (bound, a, S(a), b, S(b)) of unexplored candidates a + 1 .. b - 1; a = -1 is "below all".
    ranges = [(min_sum + scale * candidates[0], -1, np.inf, top, min_sum)]
    while ranges:
        bound, lo, lo_sum, hi, hi_sum = heapq.heappop(ranges)
        if hi - lo < 2 or lo_sum == hi_sum or (bound, lo + 1) >= best:
            continue
        mid = (lo + hi) // 2
        found = solve(mid)
        if found is None:  # so is every smaller bound
            heapq.heappush(ranges, (hi_sum + scale * candidates[mid + 1], mid, np.inf, hi, hi_sum))
            continue
        total, sol = found
        slowest = index(sol.max_stage_latency)
        best = min(best, (total + scale * candidates[slowest], slowest))
        heapq.heappush(ranges, (total + scale * candidates[lo + 1], lo, lo_sum, slowest, total))
        heapq.heappush(ranges, (hi_sum + scale * candidates[mid + 1], mid, total, hi, hi_sum))
    found = solve(best[1])
    assert found is not None and found[1].objective == best[0]
    return found[1]


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
