"""The inter-operator stage search against brute force, hand-solved cases and baselines."""

import itertools
import time

import numpy as np
import pytest

from autopar._src import stages
from autopar._src.baselines import brute_force, equal_layer_plan, equal_operator_plan, uniform_grid_plans
from autopar._src.cluster import logical_shapes
from autopar._src.stage_problem import make_problem
from autopar._src.stages import (
    NoFeasiblePlanError,
    StageChoice,
    StageSolution,
    choose_num_microbatches,
    solve_stages,
)

SUBMESHES = ((1, 1), (1, 2), (1, 4), (1, 8))
NUM_RANDOM = 240
GiB, MiB = 2**30, 2**20


def random_instance(seed: int) -> dict:
    """At most 8 layers on at most 8 devices; memory so that some instances have no plan."""
    rng = np.random.default_rng(seed)
    num_layers, num_devices = int(rng.integers(1, 9)), int(rng.integers(1, 9))
    shapes = [s for s in SUBMESHES if s[0] * s[1] <= num_devices]
    logical = [logical_shapes(s) for s in shapes]
    shape = (num_layers, num_layers, len(shapes), max(len(q) for q in logical))
    if rng.random() < 0.3:  # small integers: many exact ties
        latency = rng.integers(1, 4, size=shape).astype(float)
    else:
        latency = rng.uniform(0.1, 1.0, size=shape)
    for k, qs in enumerate(logical):
        latency[:, :, k, len(qs) :] = np.inf
    latency[rng.random(shape) < 0.1] = np.inf
    return dict(
        latency=latency,
        param_memory=rng.uniform(0.0, 1.0, size=shape),
        activation_memory=rng.uniform(0.0, 0.5, size=shape),
        submesh_devices=[s[0] * s[1] for s in shapes],
        memory_budget=float(rng.uniform(0.5, 3.0)),
        num_devices=num_devices,
        num_microbatches=int(rng.integers(1, 9)),
        schedule=("1f1b", "gpipe")[int(rng.integers(2))],
        submesh_shapes=shapes,
        logical_shapes=logical,
    )


def solve_or_error(fn, inst):
    try:
        return fn(**inst)
    except NoFeasiblePlanError as e:
        return e


def check_plan(sol: StageSolution, inst: dict) -> None:
    """The plan covers the layers in order, uses every device once and fits memory when in flight."""
    num_stages, b = sol.num_stages, inst["num_microbatches"]
    assert sol.stages[0].start == 0 and sol.stages[-1].stop == inst["latency"].shape[0]
    assert all(a.stop == n.start for a, n in itertools.pairwise(sol.stages))
    assert sum(inst["submesh_devices"][st.submesh] for st in sol.stages) == inst["num_devices"]
    lats = []
    for pos, st in enumerate(sol.stages):
        in_flight = b if inst["schedule"] == "gpipe" else min(num_stages - pos, b)
        idx = (st.start, st.stop - 1, st.submesh, st.logical)
        memory = inst["param_memory"][idx] + in_flight * inst["activation_memory"][idx]
        assert memory <= inst["memory_budget"] and memory == pytest.approx(st.memory)
        assert np.isfinite(inst["latency"][idx]) and st.latency == inst["latency"][idx]
        lats.append(st.latency)
    assert sol.objective == pytest.approx(sum(lats) + (b - 1) * max(lats), rel=1e-12)
    assert sol.max_stage_latency == max(lats)


@pytest.mark.parametrize("seed", range(NUM_RANDOM))
def test_matches_brute_force(seed):
    inst = random_instance(seed)
    dp, ref = solve_or_error(solve_stages, inst), solve_or_error(brute_force, inst)
    if isinstance(ref, NoFeasiblePlanError):
        assert isinstance(dp, NoFeasiblePlanError)
        return
    assert isinstance(dp, StageSolution)
    assert np.isclose(dp.objective, ref.objective, rtol=1e-12, atol=0.0)
    check_plan(dp, inst)
    check_plan(ref, inst)


def test_random_instances_cover_both_outcomes():
    feasible = [
        isinstance(solve_or_error(solve_stages, random_instance(s)), StageSolution) for s in range(60)
    ]
    assert 0 < sum(feasible) < len(feasible)


@pytest.mark.parametrize("seed", range(0, NUM_RANDOM, 4))
def test_baselines_never_beat_the_search(seed):
    inst = random_instance(seed)
    dp = solve_or_error(solve_stages, inst)
    common = {k: inst[k] for k in ("latency", "param_memory", "activation_memory", "submesh_devices")}
    common.update({k: inst[k] for k in ("memory_budget", "num_devices", "num_microbatches", "schedule")})
    ops = np.random.default_rng(seed).integers(1, 20, size=inst["latency"].shape[0])
    baselines = [equal_layer_plan(**common), equal_operator_plan(**common, layer_ops=ops)]
    baselines += uniform_grid_plans(**common, logical_shapes=inst["logical_shapes"]).values()
    for sol in baselines:
        if sol is None:
            continue
        check_plan(sol, inst)
        assert not isinstance(dp, NoFeasiblePlanError)
        assert sol.objective >= dp.objective * (1 - 1e-12)


def alpa_scan(inst: dict) -> StageSolution:
    """Alpa's plain scan: every candidate t_max in increasing order, stop when (B - 1) t_max >= best."""
    prob = make_problem(**inst)
    capacity, max_states = stages._capacity(prob)
    candidates = np.unique(prob.latency[np.isfinite(prob.latency) & (capacity >= 1)])
    best = None
    for t_max in candidates:
        if best is not None and (prob.num_microbatches - 1) * t_max >= best.objective:
            break
        found = stages._solve_at(prob, capacity, max_states, float(t_max))
        if found is not None and (best is None or found[1].objective < best.objective):
            best = found[1]
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(12))
def test_branch_and_bound_equals_plain_scan(seed):
    """Medium instances: the pruned search returns exactly the plan of the plain scan."""
    rng = np.random.default_rng(1000 + seed)
    num_layers, num_devices = int(rng.integers(10, 17)), int(rng.choice([8, 12, 16]))
    shapes = [(1, 1), (1, 2), (1, 4), (1, 8)] + [(h, 8) for h in range(2, num_devices // 8 + 1)]
    logical = [logical_shapes(s)[-3:] for s in shapes]
    work = rng.uniform(0.5, 1.5, num_layers)
    prefix = np.concatenate([[0.0], np.cumsum(work)])
    i, j = np.meshgrid(np.arange(num_layers), np.arange(num_layers), indexing="ij")
    shape = (num_layers, num_layers, len(shapes), 3)
    latency, param, act = np.full(shape, np.inf), np.zeros(shape), np.zeros(shape)
    for k, qs in enumerate(logical):
        n = shapes[k][0] * shapes[k][1]
        for q, (dp, tp) in enumerate(qs):
            span = np.where(j >= i, prefix[np.minimum(j + 1, num_layers)] - prefix[i], 0.0)
            noise = rng.uniform(1.0, 1.2, size=span.shape)
            lat = span / n * noise + 0.05 * (tp - 1) + 0.02 * (dp - 1) * span / n
            latency[:, :, k, q] = np.where(j >= i, lat, np.inf)
            param[:, :, k, q], act[:, :, k, q] = span / tp, 0.3 * span / dp
    inst = dict(
        latency=latency,
        param_memory=param,
        activation_memory=act,
        submesh_devices=[h * d for h, d in shapes],
        memory_budget=float(rng.uniform(4.0, 10.0)),
        num_devices=num_devices,
        num_microbatches=int(rng.choice([2, 4, 8, 16])),
        schedule=("1f1b", "gpipe")[seed % 2],
    )
    try:
        expected = alpa_scan(inst)
    except AssertionError:
        with pytest.raises(NoFeasiblePlanError):
            solve_stages(**inst)
        return
    assert solve_stages(**inst) == expected


def two_layer_instance(full_stage_latency: float, num_microbatches: int) -> dict:
    """Two layers, two devices: 1.0 per layer on one device, ``full_stage_latency`` for both on two."""
    latency = np.full((2, 2, 2, 1), np.inf)
    latency[0, 0, 0, 0] = latency[1, 1, 0, 0] = 1.0  # one layer, one device
    latency[0, 1, 0, 0] = 2.0  # both layers, one device
    latency[0, 0, 1, 0] = latency[1, 1, 1, 0] = 0.6  # one layer, two devices
    latency[0, 1, 1, 0] = full_stage_latency  # both layers, two devices
    zeros = np.zeros_like(latency)
    return dict(
        latency=latency,
        param_memory=zeros,
        activation_memory=zeros,
        submesh_devices=[1, 2],
        memory_budget=1.0,
        num_devices=2,
        num_microbatches=num_microbatches,
    )


def test_hand_solved_one_stage_vs_two():
    # B = 1: one stage on two devices takes 1.5, two one-device stages 1.0 + 1.0 = 2.0.
    sol = solve_stages(**two_layer_instance(1.5, num_microbatches=1))
    assert [(s.start, s.stop, s.submesh) for s in sol.stages] == [(0, 2, 1)]
    assert sol.objective == 1.5
    # B = 4: one stage costs 1.5 + 3 * 1.5 = 6.0; two stages 2.0 + 3 * 1.0 = 5.0.
    sol = solve_stages(**two_layer_instance(1.5, num_microbatches=4))
    assert [(s.start, s.stop, s.submesh) for s in sol.stages] == [(0, 1, 0), (1, 2, 0)]
    assert sol.objective == 5.0 and sol.max_stage_latency == 1.0
    # Better scaling on two devices (1.2): 1.2 * 4 = 4.8 beats 5.0 again.
    sol = solve_stages(**two_layer_instance(1.2, num_microbatches=4))
    assert [(s.start, s.stop, s.submesh) for s in sol.stages] == [(0, 2, 1)]
    assert sol.objective == pytest.approx(4.8)


def memory_instance(schedule: str) -> dict:
    """Both layers on two devices is fastest but needs 9.5 + 1 > 10 bytes; split stages fit under 1F1B."""
    inst = two_layer_instance(1.2, num_microbatches=4)
    param, act = np.zeros_like(inst["latency"]), np.zeros_like(inst["latency"])
    param[[0, 1], [0, 1], 0, 0], act[[0, 1], [0, 1], 0, 0] = 4.0, 2.0
    param[0, 1, 1, 0], act[0, 1, 1, 0] = 9.5, 1.0
    param[0, 1, 0, 0] = param[[0, 1], [0, 1], 1, 0] = 20.0
    inst.update(param_memory=param, activation_memory=act, memory_budget=10.0, schedule=schedule)
    return inst


def test_hand_solved_memory_forces_split():
    sol = solve_stages(**memory_instance("1f1b"))
    # The first stage keeps 2 microbatches in flight (4 + 2 * 2 = 8), the last 1 (4 + 2 = 6).
    assert [(s.start, s.stop, s.submesh, s.memory) for s in sol.stages] == [(0, 1, 0, 8.0), (1, 2, 0, 6.0)]
    assert sol.objective == 5.0
    # GPipe keeps all 4 in flight: 4 + 4 * 2 = 12 > 10, so nothing fits.
    with pytest.raises(NoFeasiblePlanError):
        solve_stages(**memory_instance("gpipe"))
    with pytest.raises(NoFeasiblePlanError):
        brute_force(**memory_instance("gpipe"))


def test_error_names_the_largest_layer():
    latency = np.full((3, 3, 2, 2), np.inf)
    latency[:, :, 0, 0] = latency[:, :, 1, :] = 1.0
    param, act = np.full(latency.shape, 0.5 * GiB), np.full(latency.shape, 64 * MiB)
    # Every stage holding the last layer: its best option is submesh (1, 2) as logical (1, 2).
    param[:, 2] = [[4 * GiB, 4 * GiB], [3 * GiB, 5 * GiB]]
    act[:, 2, 1, 0] = 512 * MiB
    kwargs = dict(
        submesh_devices=[1, 2],
        memory_budget=2 * GiB,
        num_devices=2,
        num_microbatches=4,
        schedule="1f1b",
        layer_names=["embed", "block", "head"],
        submesh_shapes=[(1, 1), (1, 2)],
        logical_shapes=[[(1, 1)], [(1, 2), (2, 1)]],
    )
    with pytest.raises(NoFeasiblePlanError) as info:
        solve_stages(latency, param, act, **kwargs)
    message = str(info.value)
    for part in (
        "head",
        "(1, 2)",
        "3.00 GiB",
        "512.00 MiB",
        "x 1 in-flight",
        "3.50 GiB",
        "budget of 2.00 GiB",
    ):
        assert part in message, (part, message)
    with pytest.raises(NoFeasiblePlanError, match="head"):
        brute_force(latency, param, act, **kwargs)


def test_error_when_devices_cannot_be_matched():
    inst = two_layer_instance(1.5, num_microbatches=2)
    inst.update(submesh_devices=[2, 2], num_devices=3)
    with pytest.raises(NoFeasiblePlanError, match=r"stages of \[2\] devices cannot add up to exactly 3"):
        solve_stages(**inst)


@pytest.mark.parametrize("seed", range(0, NUM_RANDOM, 3))
def test_deterministic(seed):
    inst = random_instance(seed)
    first, second = solve_or_error(solve_stages, inst), solve_or_error(solve_stages, inst)
    if isinstance(first, NoFeasiblePlanError):
        assert str(first) == str(second)
    else:
        assert first == second


def test_tie_breaking_rule():
    # Every split of 4 layers into 1-layer stages costs the same; equal ties prefer longer first stages.
    latency = np.ones((4, 4, 1, 1))
    zeros = np.zeros_like(latency)
    kwargs = dict(submesh_devices=[1], memory_budget=1.0, num_devices=2, num_microbatches=1)
    sol = solve_stages(latency, zeros, zeros, **kwargs)
    assert [(s.start, s.stop) for s in sol.stages] == [(0, 3), (3, 4)]
    # B = 2: stages (2, 2) and (1, 2.5) both cost 6; the smaller t_max (2) wins over the longer first stage.
    latency = np.full((3, 3, 1, 1), np.inf)
    latency[0, 0], latency[1, 2], latency[0, 1], latency[2, 2] = 2.0, 2.0, 1.0, 2.5
    zeros = np.zeros_like(latency)
    sol = solve_stages(latency, zeros, zeros, **{**kwargs, "num_microbatches": 2})
    assert [(s.start, s.stop) for s in sol.stages] == [(0, 1), (1, 3)]
    assert (sol.objective, sol.max_stage_latency) == (6.0, 2.0)


def test_invalid_inputs():
    inst = two_layer_instance(1.5, num_microbatches=2)
    for field, value in (
        ("num_microbatches", 0),
        ("num_devices", 0),
        ("memory_budget", -1.0),
        ("schedule", "interleaved"),
        ("submesh_devices", [1]),
        ("param_memory", np.zeros((2, 2, 2, 2))),
        ("layer_names", ["only one"]),
    ):
        with pytest.raises(ValueError, match=field):
            solve_stages(**{**inst, field: value})
    bad = inst["latency"].copy()
    bad[0, 0, 0, 0] = -1.0
    with pytest.raises(ValueError, match="latency"):
        solve_stages(**{**inst, "latency": bad})


def fake_solution(objective: float) -> StageSolution:
    stage = StageChoice(start=0, stop=1, submesh=0, logical=0, latency=objective, memory=0.0)
    return StageSolution(stages=(stage,), objective=objective, max_stage_latency=objective)


def test_solution_validation():
    with pytest.raises(ValueError, match="start < stop"):
        StageChoice(start=2, stop=2, submesh=0, logical=0, latency=1.0, memory=0.0)
    stage = StageChoice(start=1, stop=2, submesh=0, logical=0, latency=1.0, memory=0.0)
    with pytest.raises(ValueError, match="StageSolution.stages"):
        StageSolution(stages=(stage,), objective=1.0, max_stage_latency=1.0)


def test_choose_num_microbatches():
    costs = {1: 5.0, 2: 3.0, 4: 3.0, 8: 4.0}
    b, sol = choose_num_microbatches([8, 4, 2, 1], lambda b: fake_solution(costs[b]))
    assert (b, sol.objective) == (2, 3.0)

    def partly(b):
        if b < 4:
            raise NoFeasiblePlanError(f"B={b} does not fit")
        return fake_solution(10.0 / b)

    assert choose_num_microbatches([1, 2, 4, 8], partly)[0] == 8

    def never(b):
        raise NoFeasiblePlanError(f"B={b} does not fit")

    with pytest.raises(NoFeasiblePlanError, match=r"B=8 does not fit \(num_microbatches tried: \[2, 4, 8\]"):
        choose_num_microbatches([2, 8, 4], never)
    with pytest.raises(ValueError, match="candidates"):
        choose_num_microbatches([], never)
    # The fallback counts run only where no candidate fits, and the best of them is kept.
    seen = []

    def large_only(b):
        seen.append(b)
        if b < 16:
            raise NoFeasiblePlanError(f"B={b} does not fit")
        return fake_solution(100.0 / b + b)

    assert choose_num_microbatches([1, 2, 4, 8], large_only, fallback=[1, 8, 16, 32, 64])[0] == 16
    assert seen == [1, 2, 4, 8, 16, 32, 64]
    assert choose_num_microbatches([4, 8, 16], large_only, fallback=[32])[0] == 16
    assert seen[-3:] == [4, 8, 16]  # 32 not tried: a candidate fits
    with pytest.raises(NoFeasiblePlanError, match=r"tried: \[2, 4\]"):
        choose_num_microbatches([2], never, fallback=[4])


def large_instance(num_microbatches: int, memory_budget: float) -> dict:
    """96 layers, 8 submesh shapes of a 4 x 16 cluster, 4 logical meshes each, 64 devices."""
    rng = np.random.default_rng(7)
    num_layers = 96
    shapes = [(1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (2, 16), (3, 16), (4, 16)]
    prefix = [
        np.concatenate([[0.0], np.cumsum(rng.uniform(0.8, 1.2, num_layers) * s)]) for s in (1e-2, 2e8, 1e8)
    ]
    i, j = np.meshgrid(np.arange(num_layers), np.arange(num_layers), indexing="ij")
    ok = j >= i
    flops, params, acts = (np.where(ok, p[np.minimum(j + 1, num_layers)] - p[i], 0.0) for p in prefix)
    shape = (num_layers, num_layers, len(shapes), 4)
    latency, param, act = np.full(shape, np.inf), np.zeros(shape), np.zeros(shape)
    for k, (hosts, per_host) in enumerate(shapes):
        n = hosts * per_host
        bandwidth = 50e9 if hosts > 1 else 450e9
        for q, (dp, tp) in enumerate(logical_shapes((hosts, per_host))[-4:]):
            lat = (
                flops / n * 1.1 + (j - i + 1) * 1e-4 * (tp - 1) / tp + params * 2 * (dp - 1) / dp / bandwidth
            )
            latency[:, :, k, q] = np.where(ok, lat + 1e-5 * np.log2(n + 1), np.inf)
            param[:, :, k, q], act[:, :, k, q] = params * 16 / tp, acts / dp
    return dict(
        latency=latency,
        param_memory=param,
        activation_memory=act,
        submesh_devices=[h * d for h, d in shapes],
        memory_budget=memory_budget,
        num_devices=64,
        num_microbatches=num_microbatches,
    )


@pytest.mark.parametrize(("num_microbatches", "memory_budget"), [(16, 12e9), (32, 80e9)])
def test_large_instance_is_fast(num_microbatches, memory_budget):
    inst = large_instance(num_microbatches, memory_budget)
    start = time.perf_counter()
    sol = solve_stages(**inst)
    elapsed = time.perf_counter() - start
    check_plan(sol, {**inst, "schedule": "1f1b"})
    assert sol.num_stages > 1
    assert elapsed < 30.0, f"stage search took {elapsed:.1f} s"


def test_baselines_layouts():
    num_layers = 8
    shapes = list(SUBMESHES)
    logical = [logical_shapes(s) for s in shapes]
    latency = np.full((num_layers, num_layers, 4, 4), np.inf)
    for k, qs in enumerate(logical):
        latency[:, :, k, : len(qs)] = 1.0 + k
    zeros = np.zeros_like(latency)
    common = dict(submesh_devices=[1, 2, 4, 8], memory_budget=1.0, num_devices=8, num_microbatches=4)
    grids = uniform_grid_plans(latency, zeros, zeros, logical_shapes=logical, **common)
    assert sorted(grids) == sorted(
        [
            (1, 8, 1),
            (2, 4, 1),
            (4, 2, 1),
            (8, 1, 1),
            (1, 4, 2),
            (2, 2, 2),
            (4, 1, 2),
            (1, 2, 4),
            (2, 1, 4),
            (1, 1, 8),
        ]
    )
    grid = grids[(2, 2, 2)]
    assert [(s.start, s.stop, s.submesh) for s in grid.stages] == [(0, 4, 2), (4, 8, 2)]
    assert all(logical[2][s.logical] == (2, 2) for s in grid.stages)
    # Equal layers, 7 of them: 1, 2 or 4 stages; four on 2-device submeshes win, earlier ones take the extra.
    plan = equal_layer_plan(latency[:7, :7], zeros[:7, :7], zeros[:7, :7], **common)
    assert [(s.start, s.stop) for s in plan.stages] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    # Equal operators: the last layer holds 9 of 16 operators, so two stages cut before it.
    two = {**common, "submesh_devices": [1], "num_devices": 2}
    ops = np.array([1, 1, 1, 1, 1, 1, 1, 9])
    plan = equal_operator_plan(
        latency[..., :1, :1], zeros[..., :1, :1], zeros[..., :1, :1], layer_ops=ops, **two
    )
    assert [(s.start, s.stop) for s in plan.stages] == [(0, 7), (7, 8)]
