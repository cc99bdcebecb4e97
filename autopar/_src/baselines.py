"""Reference and baseline stage plans in the stage search's cost model.

:func:`brute_force` enumerates every plan (tests only, small inputs); the baselines are the
fixed recipes the stage search is compared against: equal layers per stage, equal operators
per stage, and Megatron-style ``(dp, tp, pp)`` grids. All take the arrays of
:func:`autopar._src.stages.solve_stages` and return a :class:`StageSolution`, or None when
the recipe does not fit.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np

from autopar._src.stage_problem import (
    Problem,
    StageSchedule,
    StageSolution,
    make_problem,
    make_solution,
    no_plan_error,
    num_in_flight,
)


def brute_force(
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
    """The optimum by enumerating every partition x submesh x logical choice (small inputs only).

    Same arguments, result and errors as :func:`~autopar._src.stages.solve_stages`, but
    ties go to whichever optimal plan is enumerated first.
    """
    prob = make_problem(
        latency, param_memory, activation_memory, submesh_devices=submesh_devices,
        memory_budget=memory_budget, num_devices=num_devices, num_microbatches=num_microbatches,
        schedule=schedule, layer_names=layer_names, submesh_shapes=submesh_shapes,
        logical_shapes=logical_shapes,
    )  # fmt: skip
    num_layers, _, num_submeshes, num_logical = prob.latency.shape
    best: tuple[float, list[tuple[int, int, int, int]]] | None = None
    for num_cuts in range(min(num_layers, prob.num_devices)):
        for cuts in itertools.combinations(range(1, num_layers), num_cuts):
            bounds = (0, *cuts, num_layers)
            options = []
            for pos in range(len(bounds) - 1):
                i, j = bounds[pos], bounds[pos + 1] - 1
                fits = prob.fits(num_in_flight(len(bounds) - 2 - pos, prob.num_microbatches, schedule))
                options.append(
                    [
                        (k, q, float(prob.latency[i, j, k, q]))
                        for k, q in itertools.product(range(num_submeshes), range(num_logical))
                        if fits[i, j, k, q]
                    ]
                )
            for combo in _assignments(options, prob.devices, prob.num_devices):
                lats = [lat for _, _, lat in combo]
                objective = sum(lats) + (prob.num_microbatches - 1) * max(lats)
                if best is None or objective < best[0]:
                    best = (
                        objective,
                        [(bounds[p], bounds[p + 1], k, q) for p, (k, q, _) in enumerate(combo)],
                    )
    if best is None:
        raise no_plan_error(prob)
    sol = make_solution(prob, best[1])
    assert sol is not None
    return sol


def _assignments(options: list, devices: np.ndarray, left: int) -> Iterator[tuple]:
    """Every pick of one option per stage whose submeshes' device counts add up to ``left``."""
    if not options:
        if left == 0:
            yield ()
        return
    for option in options[0]:
        used = int(devices[option[0]])
        if used <= left:
            for rest in _assignments(options[1:], devices, left - used):
                yield (option, *rest)


def _fixed_groups(
    prob: Problem, bounds: Sequence[int], allowed: np.ndarray | None = None
) -> StageSolution | None:
    """Stages on ``bounds``, each on a submesh with an equal share of the devices.

    Each stage takes its fastest fitting (submesh, logical) choice, which is optimal for
    fixed groups since the objective grows with every stage's latency. ``allowed[k, q]``
    restricts the choices.
    """
    num_stages = len(bounds) - 1
    if prob.num_devices % num_stages:
        return None
    share = prob.num_devices // num_stages
    choices = []
    for pos in range(num_stages):
        i, j = bounds[pos], bounds[pos + 1] - 1
        in_flight = num_in_flight(num_stages - 1 - pos, prob.num_microbatches, prob.schedule)
        memory = prob.param_memory[i, j] + in_flight * prob.activation_memory[i, j]
        fits = (memory <= prob.memory_budget) & (prob.devices == share)[:, None]
        if allowed is not None:
            fits &= allowed
        lat = np.where(fits, prob.latency[i, j], np.inf)
        if not np.isfinite(lat).any():
            return None
        k, q = np.unravel_index(int(np.argmin(lat)), lat.shape)
        choices.append((i, j + 1, int(k), int(q)))
    return make_solution(prob, choices)


def _best(solutions: Sequence[StageSolution | None]) -> StageSolution | None:
    """The smallest objective; ties to the earliest."""
    best = None
    for sol in solutions:
        if sol is not None and (best is None or sol.objective < best.objective):
            best = sol
    return best


def _stage_counts(prob: Problem) -> list[int]:
    num_layers = prob.latency.shape[0]
    return [s for s in range(1, min(num_layers, prob.num_devices) + 1) if prob.num_devices % s == 0]


def _equal_bounds(num_layers: int, num_stages: int) -> tuple[int, ...]:
    sizes = [num_layers // num_stages + (s < num_layers % num_stages) for s in range(num_stages)]
    return (0, *itertools.accumulate(sizes))


def equal_layer_plan(
    latency: np.ndarray,
    param_memory: np.ndarray,
    activation_memory: np.ndarray,
    *,
    submesh_devices: Sequence[int] | np.ndarray,
    memory_budget: float,
    num_devices: int,
    num_microbatches: int,
    schedule: StageSchedule = "1f1b",
) -> StageSolution | None:
    """Best plan with equal layer counts per stage (earlier stages take the remainder) and equal
    device shares, over every stage count dividing ``num_devices``; None if none fits."""
    prob = make_problem(
        latency, param_memory, activation_memory, submesh_devices=submesh_devices,
        memory_budget=memory_budget, num_devices=num_devices, num_microbatches=num_microbatches,
        schedule=schedule, layer_names=None, submesh_shapes=None, logical_shapes=None,
    )  # fmt: skip
    num_layers = prob.latency.shape[0]
    return _best([_fixed_groups(prob, _equal_bounds(num_layers, s)) for s in _stage_counts(prob)])


def _operator_bounds(layer_ops: np.ndarray, num_stages: int) -> tuple[int, ...]:
    """Cuts whose operator prefix counts are closest to equal shares, each stage non-empty."""
    num_layers = len(layer_ops)
    prefix = np.concatenate([[0.0], np.cumsum(layer_ops)])
    bounds = [0]
    for s in range(1, num_stages):
        lo, hi = bounds[-1] + 1, num_layers - (num_stages - s)
        target = prefix[-1] * s / num_stages
        bounds.append(lo + int(np.argmin(np.abs(prefix[lo : hi + 1] - target))))
    return (*bounds, num_layers)


def equal_operator_plan(
    latency: np.ndarray,
    param_memory: np.ndarray,
    activation_memory: np.ndarray,
    *,
    layer_ops: np.ndarray,
    submesh_devices: Sequence[int] | np.ndarray,
    memory_budget: float,
    num_devices: int,
    num_microbatches: int,
    schedule: StageSchedule = "1f1b",
) -> StageSolution | None:
    """Like :func:`equal_layer_plan`, but cut so that stages hold about equal numbers of
    operators (``layer_ops[l]`` in layer l)."""
    prob = make_problem(
        latency, param_memory, activation_memory, submesh_devices=submesh_devices,
        memory_budget=memory_budget, num_devices=num_devices, num_microbatches=num_microbatches,
        schedule=schedule, layer_names=None, submesh_shapes=None, logical_shapes=None,
    )  # fmt: skip
    ops = np.asarray(layer_ops, dtype=np.float64)
    if ops.shape != (prob.latency.shape[0],) or not np.isfinite(ops).all() or (ops < 0).any():
        raise ValueError(f"layer_ops must be {prob.latency.shape[0]} finite counts >= 0, got {layer_ops!r}")
    return _best([_fixed_groups(prob, _operator_bounds(ops, s)) for s in _stage_counts(prob)])


def uniform_grid_plans(
    latency: np.ndarray,
    param_memory: np.ndarray,
    activation_memory: np.ndarray,
    *,
    submesh_devices: Sequence[int] | np.ndarray,
    logical_shapes: Sequence[Sequence[tuple[int, int]]],
    memory_budget: float,
    num_devices: int,
    num_microbatches: int,
    schedule: StageSchedule = "1f1b",
) -> dict[tuple[int, int, int], StageSolution | None]:
    """Every Megatron-style grid: ``pp`` stages of equal layers, each a ``(dp, tp)`` logical mesh.

    Returns:
      ``{(dp, tp, pp): solution or None}`` for every ``dp * tp * pp == num_devices`` with
      ``pp`` at most the number of layers, ordered by ``pp`` then ``dp``. None marks a grid
      that does not fit or has no matching submesh or logical shape.
    """
    prob = make_problem(
        latency, param_memory, activation_memory, submesh_devices=submesh_devices,
        memory_budget=memory_budget, num_devices=num_devices, num_microbatches=num_microbatches,
        schedule=schedule, layer_names=None, submesh_shapes=None, logical_shapes=logical_shapes,
    )  # fmt: skip
    num_layers, _, num_submeshes, num_logical = prob.latency.shape
    plans: dict[tuple[int, int, int], StageSolution | None] = {}
    for pp in _stage_counts(prob):
        share = prob.num_devices // pp
        for dp in (d for d in range(1, share + 1) if share % d == 0):
            allowed = np.zeros((num_submeshes, num_logical), dtype=bool)
            for k, shapes in enumerate(logical_shapes):
                for q, shape in enumerate(shapes[:num_logical]):
                    allowed[k, q] = tuple(shape) == (dp, share // dp)
            plans[(dp, share // dp, pp)] = _fixed_groups(prob, _equal_bounds(num_layers, pp), allowed)
    return plans
