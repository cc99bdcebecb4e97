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
from collections.abc import Callable, Sequence

import numpy as np

from autopar._src.stage_problem import (
    NoFeasiblePlanError,
    Problem,
    StageChoice,
    StageSchedule,
    StageSolution,
    make_problem,
    make_solution,
    no_plan_error,
)

__all__ = [
    "NoFeasiblePlanError",
    "StageChoice",
    "StageSchedule",
    "StageSolution",
    "choose_num_microbatches",
    "solve_stages",
]


def _capacity(prob: Problem) -> tuple[np.ndarray, int]:
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


def _bounded(prob: Problem, capacity: np.ndarray, max_states: int, t_max: float) -> _Bounded:
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


def _backtrack(prob: Problem, bounded: _Bounded, table: np.ndarray) -> list[tuple[int, int, int, int]]:
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
    prob: Problem, capacity: np.ndarray, max_states: int, t_max: float
) -> tuple[float, StageSolution] | None:
    """The best plan whose stages all take at most ``t_max``: (latency sum, solution), or None."""
    bounded = _bounded(prob, capacity, max_states, t_max)
    table = _dp(bounded, prob.devices, prob.num_devices)
    total = float(table[1:, 0, prob.num_devices].min())
    if not np.isfinite(total):
        return None
    sol = make_solution(prob, _backtrack(prob, bounded, table))
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
    prob = make_problem(
        latency, param_memory, activation_memory, submesh_devices=submesh_devices,
        memory_budget=memory_budget, num_devices=num_devices, num_microbatches=num_microbatches,
        schedule=schedule, layer_names=layer_names, submesh_shapes=submesh_shapes,
        logical_shapes=logical_shapes,
    )  # fmt: skip
    capacity, max_states = _capacity(prob)
    unbounded = _solve_at(prob, capacity, max_states, np.inf)
    if unbounded is None:
        raise no_plan_error(prob)
    if prob.num_microbatches == 1:
        return unbounded[1]  # no max term: the unbounded sum is the objective
    return _search_t_max(prob, capacity, max_states, *unbounded)


def _search_t_max(
    prob: Problem, capacity: np.ndarray, max_states: int, min_sum: float, plan: StageSolution
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
    candidates: Sequence[int],
    solve: Callable[[int], StageSolution],
    *,
    fallback: Sequence[int] = (),
) -> tuple[int, StageSolution]:
    """Picks the number of microbatches whose solution has the smallest objective.

    Args:
      candidates: microbatch counts to try.
      solve: the stage search for one count (costs depend on the microbatch size).
      fallback: counts to try only if no candidate has a plan (e.g. larger ones, whose
        smaller microbatches hold fewer activations).

    Returns:
      ``(num_microbatches, solution)``; ties go to the smaller count.

    Raises:
      NoFeasiblePlanError: the last one raised, with every count tried, if no count has a plan.
    """
    if not candidates or any(int(b) != b or b < 1 for b in (*candidates, *fallback)):
        raise ValueError(
            f"candidates must be a non-empty sequence of ints >= 1 (fallback too), got {candidates!r} "
            f"and {fallback!r}"
        )
    best: tuple[int, StageSolution] | None = None
    error: NoFeasiblePlanError | None = None
    tried: list[int] = []
    for group in (candidates, fallback):
        for b in sorted(set(int(c) for c in group) - set(tried)):
            tried.append(b)
            try:
                sol = solve(b)
            except NoFeasiblePlanError as e:
                error = e
                continue
            if best is None or sol.objective < best[1].objective:
                best = (b, sol)
        if best is not None:
            return best
    assert error is not None
    raise NoFeasiblePlanError(f"{error} (num_microbatches tried: {tried})") from error
