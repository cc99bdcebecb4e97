"""Tests for the intra-operator sharding ILP: brute force, hand-solved cases, reductions, costs."""

import itertools
import math

import numpy as np
import pytest

from autopar._src import collectives, ilp_merge
from autopar._src import sharding_ilp as si
from autopar._src.sharding_ilp import Edge, Node, Strategy


def _strategy(cost: float, memory: float = 0.0, name: str = "s", comm: float = 0.0) -> Strategy:
    return Strategy(name=name, compute_cost=cost, communication_cost=comm, memory_bytes=memory)


def _node(name: str, costs, memories=None) -> Node:
    memories = memories if memories is not None else [0.0] * len(costs)
    return Node(
        name=name,
        strategies=tuple(
            _strategy(c, m, f"{name}{i}") for i, (c, m) in enumerate(zip(costs, memories, strict=True))
        ),
    )


def _random_problem(
    rng: np.random.Generator, *, forced: float = 0.0, max_nodes: int = 5, max_strategies: int = 3
):
    """Up to 5 nodes, up to 3 strategies, DAG edges with some inf pairs, zero and forced matrices."""
    num_nodes = int(rng.integers(1, max_nodes + 1))
    nodes = []
    for v in range(num_nodes):
        k = int(rng.integers(1, max_strategies + 1))
        memory = rng.integers(0, 10, k).astype(float) if rng.random() < 0.5 else rng.uniform(0, 10, k)
        nodes.append(
            Node(
                name=f"n{v}",
                strategies=tuple(
                    Strategy(
                        name=f"n{v}s{i}",
                        compute_cost=float(rng.uniform(0, 1)),
                        communication_cost=float(rng.uniform(0, 0.5)) if rng.random() < 0.5 else 0.0,
                        memory_bytes=float(memory[i]),
                    )
                    for i in range(k)
                ),
            )
        )
    edges = []
    rank = rng.permutation(num_nodes)  # a random topological order, so src > dst happens too
    for u, v in itertools.combinations(range(num_nodes), 2):
        if rng.random() > 0.5:
            continue
        u, v = (u, v) if rank[u] < rank[v] else (v, u)
        ku, kv = len(nodes[u].strategies), len(nodes[v].strategies)
        if rng.random() < forced:
            # Each dst strategy allows one src partner: v follows u (a one-to-one pairing if square).
            cost = np.full((ku, kv), np.inf)
            partner = rng.permutation(ku)[:kv] if ku >= kv else rng.integers(0, ku, kv)
            cost[partner, np.arange(kv)] = 0.0 if rng.random() < 0.5 else rng.uniform(0, 1, kv)
        elif rng.random() < 0.1:
            cost = np.zeros((ku, kv))
        else:
            cost = rng.uniform(0, 1, (ku, kv)) * (rng.random() < 0.7)
            cost[rng.random((ku, kv)) < 0.15] = np.inf
        edges.append(Edge(src=u, dst=v, cost=cost))
    memories = [[s.memory_bytes for s in n.strategies] for n in nodes]
    low, high = sum(map(min, memories)), sum(map(max, memories))
    budgets = [None, float(rng.uniform(low, high)), float(rng.uniform(low, high)), low - 1.0]
    budget = budgets[int(rng.integers(len(budgets)))]
    return nodes, edges, budget


def _chain():
    # Alone, a prefers strategy 0 (1 s against 2 s); but from strategy 0 every consumer layout costs 5 s.
    nodes = [_node("a", [1.0, 2.0]), _node("b", [1.0, 1.5])]
    return nodes, [Edge(src=0, dst=1, cost=np.array([[5.0, 5.0], [np.inf, 0.0]]))]


def _feasible(nodes, edges, choices, budget) -> bool:
    within = budget is None or si.total_memory(nodes, choices) <= budget
    return within and math.isfinite(si.total_cost(nodes, edges, choices))


@pytest.mark.parametrize("seed", range(150))
def test_matches_brute_force(seed):
    nodes, edges, budget = _random_problem(np.random.default_rng(seed))
    try:
        best = si.brute_force(nodes, edges, memory_budget=budget)
    except ValueError:
        with pytest.raises(ValueError):
            si.solve(nodes, edges, memory_budget=budget)
        return
    solution = si.solve(nodes, edges, memory_budget=budget)
    assert solution.status == "optimal"
    assert _feasible(nodes, edges, solution.choices, budget)
    assert math.isclose(solution.objective, si.total_cost(nodes, edges, solution.choices), rel_tol=1e-12)
    assert math.isclose(solution.objective, best.objective, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("seed", range(100))
def test_merge_forced_keeps_the_optimum(seed):
    nodes, edges, budget = _random_problem(np.random.default_rng(1000 + seed), forced=0.6)
    try:
        best = si.brute_force(nodes, edges, memory_budget=budget)
    except ValueError:
        with pytest.raises(ValueError):
            reduced, reduced_edges, _ = ilp_merge.merge_forced(nodes, edges)
            si.solve(reduced, reduced_edges, memory_budget=budget)
        return
    reduced, reduced_edges, mapping = ilp_merge.merge_forced(nodes, edges)
    assert len(reduced) <= len(nodes) and len(reduced_edges) <= len(edges)
    solution = ilp_merge.expand(si.solve(reduced, reduced_edges, memory_budget=budget), mapping)
    assert _feasible(nodes, edges, solution.choices, budget)
    assert math.isclose(si.total_cost(nodes, edges, solution.choices), best.objective, rel_tol=1e-9)
    # Every reduced choice vector costs and weighs what its expansion does.
    for choices in itertools.product(*(range(len(n.strategies)) for n in reduced)):
        fake = si.ShardingSolution(choices=choices, objective=0.0, status="optimal", solve_seconds=0.0)
        original = ilp_merge.expand(fake, mapping).choices
        assert math.isclose(
            si.total_cost(reduced, reduced_edges, choices),
            si.total_cost(nodes, edges, original),
            rel_tol=1e-9,
        )
        assert math.isclose(si.total_memory(reduced, choices), si.total_memory(nodes, original), rel_tol=1e-9)


def test_resharding_makes_locally_cheapest_choice_worse():
    nodes, edges = _chain()
    solution = si.solve(nodes, edges)
    assert solution.choices == (1, 1) and solution.objective == pytest.approx(3.5)
    assert si.greedy(nodes, edges) == (0, 0)  # 7 s: the greedy does not look ahead
    assert si.brute_force(nodes, edges).choices == (1, 1)


def test_memory_budget_forces_the_sharded_strategy():
    # Replicated: fast but 8 bytes; sharded: slower, 2 bytes; the all-gather edge prices the switch.
    a = _node("w", [1.0, 1.2], [8.0, 2.0])
    b = _node("x", [1.0, 2.0], [8.0, 2.0])
    edges = [Edge(src=0, dst=1, cost=np.array([[0.0, 0.0], [0.3, 0.0]]))]
    assert si.solve([a, b], edges).choices == (0, 0)
    assert si.solve([a, b], edges, memory_budget=10.0).choices == (1, 0)
    assert si.solve([a, b], edges, memory_budget=4.0).choices == (1, 1)


def test_infeasible_memory_raises_naming_budget_and_nodes():
    nodes = [_node("big", [1.0, 2.0], [50.0, 40.0]), _node("small", [1.0], [1.0])]
    with pytest.raises(ValueError, match=r"memory_budget=30 .*at least 41 bytes.*'big'"):
        si.solve(nodes, [], memory_budget=30.0)


def test_disallowed_pairs_everywhere_raise():
    nodes = [_node("a", [1.0, 1.0]), _node("b", [1.0, 1.0])]
    edges = [Edge(src=0, dst=1, cost=np.full((2, 2), np.inf))]
    with pytest.raises(ValueError, match="infinite-cost"):
        si.solve(nodes, edges)
    with pytest.raises(ValueError, match="infinite resharding cost"):
        ilp_merge.merge_forced(nodes, edges)


class _Result:
    def __init__(self, x, status):
        self.x, self.status = x, status


def test_no_incumbent_falls_back_to_greedy(monkeypatch):
    nodes, edges = _chain()
    monkeypatch.setattr(si, "_integral_relaxation", lambda *args: None)  # straight to the MILP
    monkeypatch.setattr(si, "milp", lambda *args, **kwargs: _Result(None, 1))
    solution = si.solve(nodes, edges)
    assert solution.status == "fallback" and solution.choices == (0, 0) and solution.objective == 7.0


def test_greedy_fallback_keeps_the_budget_reachable(monkeypatch):
    # Cheapest first would put both on 10 bytes; the budget leaves room for only one.
    nodes = [_node("a", [1.0, 3.0], [10.0, 1.0]), _node("b", [1.0, 2.0], [10.0, 1.0])]
    monkeypatch.setattr(si, "_integral_relaxation", lambda *args: None)  # straight to the MILP
    monkeypatch.setattr(si, "milp", lambda *args, **kwargs: _Result(None, 2))
    solution = si.solve(nodes, [], memory_budget=11.0)
    assert solution.status == "fallback" and solution.choices == (0, 1)


def test_an_integral_relaxation_is_the_answer_without_the_milp(monkeypatch):
    nodes, edges = _chain()
    monkeypatch.setattr(si, "milp", lambda *args, **kwargs: pytest.fail("the MILP ran"))
    solution = si.solve(nodes, edges)
    assert solution.status == "optimal" and solution.choices == si.brute_force(nodes, edges).choices


def test_a_fractional_relaxation_goes_to_the_milp(monkeypatch):
    # An odd cycle that wants every neighbour different: the LP's optimum takes each strategy
    # by halves, which no integral choice can.
    differ = np.array([[1.0, 0.0], [0.0, 1.0]])
    nodes = [_node(n, [0.0, 0.0]) for n in "abc"]
    edges = [
        Edge(src=0, dst=1, cost=differ),
        Edge(src=1, dst=2, cost=differ),
        Edge(src=0, dst=2, cost=differ),
    ]
    calls = []
    milp = si.milp
    monkeypatch.setattr(si, "milp", lambda *args, **kwargs: calls.append(1) or milp(*args, **kwargs))
    solution = si.solve(nodes, edges)
    assert calls and solution.status == "optimal" and solution.objective == 1.0


def test_time_limit_with_incumbent_is_reported(monkeypatch):
    nodes, edges = _chain()
    # Variables: s_a (2), s_b (2), then e for the finite pairs (0, 0), (0, 1), (1, 1).
    incumbent = np.array([0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    monkeypatch.setattr(si, "_integral_relaxation", lambda *args: None)  # straight to the MILP
    monkeypatch.setattr(si, "milp", lambda *args, **kwargs: _Result(incumbent, 1))
    solution = si.solve(nodes, edges)
    assert solution.status == "time_limit" and solution.choices == (1, 1) and solution.objective == 3.5


def test_time_limit_keeps_the_greedy_when_it_beats_the_incumbent(monkeypatch):
    nodes, edges = _chain()
    incumbent = np.array([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0])  # (0, 1): 7.5 s; the greedy's (0, 0) is 7 s
    monkeypatch.setattr(si, "_integral_relaxation", lambda *args: None)  # straight to the MILP
    monkeypatch.setattr(si, "milp", lambda *args, **kwargs: _Result(incumbent, 1))
    solution = si.solve(nodes, edges)
    assert solution.status == "time_limit" and solution.choices == (0, 0) and solution.objective == 7.0


@pytest.mark.parametrize("time_limit", [0.01, 0.3])
def test_short_time_limit_on_a_larger_problem_is_never_wrong(time_limit):
    # Random dense costs on 50 nodes take HiGHS far longer than this to prove optimal.
    rng = np.random.default_rng(3)
    nodes = [_node(f"n{v}", rng.uniform(0, 1, 4), rng.uniform(0, 10, 4)) for v in range(50)]
    edges = [
        Edge(src=u, dst=v, cost=rng.uniform(0, 2, (4, 4)))
        for u in range(50)
        for v in range(u + 1, min(u + 6, 50))
        if rng.random() < 0.7
    ]
    budget = 0.4 * sum(max(s.memory_bytes for s in n.strategies) for n in nodes)
    solution = si.solve(nodes, edges, memory_budget=budget, time_limit=time_limit)
    assert solution.status in ("optimal", "time_limit", "fallback")
    assert _feasible(nodes, edges, solution.choices, budget)
    assert solution.objective == si.total_cost(nodes, edges, solution.choices)
    assert solution.objective <= si.total_cost(nodes, edges, si.greedy(nodes, edges, memory_budget=budget))


def test_merge_forced_collapses_an_elementwise_chain_and_single_strategy_nodes():
    follow = np.array([[0.0, np.inf], [np.inf, 0.0]])
    nodes = [
        _node("param", [0.5], [4.0]),
        _node("matmul", [1.0, 2.0], [2.0, 1.0]),
        _node("relu", [0.1, 0.2]),
        _node("add", [0.1, 0.2]),
    ]
    edges = [
        Edge(src=0, dst=1, cost=np.array([[0.0, 0.7]])),
        Edge(src=1, dst=2, cost=follow),
        Edge(src=2, dst=3, cost=follow[::-1]),  # crossed pairing: add's strategy 1 follows relu's 0
    ]
    reduced, reduced_edges, mapping = ilp_merge.merge_forced(nodes, edges)
    assert len(reduced) == 1 and reduced_edges == ()
    assert reduced[0].name == "param+matmul+relu+add"
    assert [s.cost for s in reduced[0].strategies] == pytest.approx(
        [0.5 + 1.0 + 0.1 + 0.2, 0.5 + 2.7 + 0.2 + 0.1]
    )
    assert [s.memory_bytes for s in reduced[0].strategies] == [6.0, 5.0]
    by_member = [dict(zip(mapping.members[0], row, strict=True)) for row in mapping.choices[0]]
    assert by_member == [{0: 0, 1: 0, 2: 0, 3: 1}, {0: 0, 1: 1, 2: 1, 3: 0}]
    solution = ilp_merge.expand(si.solve(reduced, reduced_edges), mapping)
    assert solution.choices == (0, 0, 0, 1) == si.brute_force(nodes, edges).choices


def test_merge_forced_folds_an_input_into_the_op_that_fixes_its_layout():
    # The dot's strategies 0 and 1 read the input row-split, strategy 2 column-split.
    nodes = [_node("x", [0.0, 0.0], [4.0, 2.0]), _node("dot", [3.0, 2.0, 1.0])]
    edges = [Edge(src=0, dst=1, cost=np.array([[0.0, 0.5, np.inf], [np.inf, np.inf, 0.0]]))]
    reduced, reduced_edges, mapping = ilp_merge.merge_forced(nodes, edges)
    assert [n.name for n in reduced] == ["x+dot"] and reduced_edges == ()
    assert [s.name for s in reduced[0].strategies] == ["dot0", "dot1", "dot2"]
    assert [s.cost for s in reduced[0].strategies] == [3.0, 2.5, 1.0]
    assert [s.memory_bytes for s in reduced[0].strategies] == [4.0, 4.0, 2.0]
    assert mapping.members == ((1, 0),) and mapping.choices == (((0, 0), (1, 0), (2, 1)),)


def test_solve_validates_inputs():
    a = _node("a", [1.0, 2.0])
    with pytest.raises(ValueError, match=r"cost shape \(3, 2\), want \(2, 2\)"):
        si.solve([a, a], [Edge(src=0, dst=1, cost=np.zeros((3, 2)))])
    with pytest.raises(ValueError, match="2 nodes"):
        si.solve([a, a], [Edge(src=0, dst=5, cost=np.zeros((2, 2)))])
    with pytest.raises(ValueError, match="memory_budget=-1"):
        si.solve([a], [], memory_budget=-1)
    with pytest.raises(ValueError, match="compute_cost=-1"):
        _strategy(-1.0)
    with pytest.raises(ValueError, match="no strategies"):
        Node(name="empty", strategies=())
    with pytest.raises(ValueError, match="src=1, dst=1"):
        Edge(src=1, dst=1, cost=np.zeros((1, 1)))
    assert si.solve([], []).choices == ()


MESH = {"x": 2, "y": 4}
BANDWIDTH = {"x": 1e9, "y": 1e10}
LATENCY = {"x": 1e-6, "y": 2e-6}


def _reshard(src, dst, shape=(8, 16)):
    return collectives.resharding_cost(src, dst, shape, 4, MESH, BANDWIDTH, LATENCY)


def test_resharding_cost_hand_computed():
    # 8 x 16 float32 = 512 bytes.
    assert _reshard(("x", "y"), ("x", "y")) == 0.0
    assert _reshard((None, None), ("x", "y")) == 0.0  # local slices
    assert _reshard(("x", None), (None, None)) == pytest.approx(0.5 * 512 / 1e9 + 1e-6)  # all-gather over x
    assert _reshard(("x", None), (None, "x")) == pytest.approx(0.5 * 256 / 1e9 + 1e-6)  # all-to-all over x
    assert _reshard((None, "y"), ("x", None)) == pytest.approx(
        0.75 * 512 / 1e10 + 3 * 2e-6
    )  # gather y, slice x
    # Swap: x cannot move onto y's dim, so gather x (64 -> 128 B), then y moves by all-to-all, then slice x.
    swap = (0.5 * 128 / 1e9 + 1e-6) + (0.75 * 128 / 1e10 + 3 * 2e-6)
    assert _reshard(("x", "y"), ("y", "x")) == pytest.approx(swap)
    assert _reshard(("x",), ("x", None)) == 0.0  # trailing dims are replicated


def test_resharding_cost_with_dims_over_several_axes():
    # 8 x 16 float32 = 512 bytes; split over x (2) and y (4) together, 64 bytes per device.
    xy = ("x", "y")
    assert _reshard((xy, None), (xy, None)) == 0.0
    assert _reshard(("x", None), (xy, None)) == 0.0  # y is a local slice
    gather_y = 0.75 * 256 / 1e10 + 3 * 2e-6
    assert _reshard((xy, None), ("x", None)) == pytest.approx(gather_y)
    assert _reshard((xy, None), ("x", "y")) == pytest.approx(0.75 * 64 / 1e10 + 3 * 2e-6)  # y: all-to-all
    assert _reshard((xy, None), (None, None)) == pytest.approx(gather_y + 0.5 * 512 / 1e9 + 1e-6)
    # y keeps its dim but not its place behind x: gather x, then y moves by all-to-all.
    assert _reshard((xy, None), ("y", None)) == pytest.approx(
        0.5 * 128 / 1e9 + 1e-6 + 0.75 * 128 / 1e10 + 3 * 2e-6
    )


def test_resharding_cost_rejects_bad_specs():
    with pytest.raises(ValueError, match="distinct axes"):
        _reshard((("x", "x"), None), (None, None))
    with pytest.raises(ValueError, match="distinct axes"):
        _reshard((("x", "y"), "y"), (None, None))
    with pytest.raises(ValueError, match="distinct axes"):
        _reshard(("x", "x"), (None, None))
    with pytest.raises(ValueError, match="distinct axes"):
        _reshard(("z", None), (None, None))
    with pytest.raises(ValueError, match="more entries"):
        _reshard(("x", None, None), (None, None))
    with pytest.raises(ValueError, match="missing"):
        collectives.resharding_cost(("x",), (None,), (4,), 4, MESH, {}, {})


def test_collective_costs():
    link = {"bandwidth": 1e9, "latency": 1e-6}
    assert collectives.all_reduce_cost(1e6, 4, **link) == pytest.approx(2 * 0.75 * 1e-3 + 6e-6)
    assert collectives.all_gather_cost(1e6, 4, **link) == pytest.approx(0.75 * 1e-3 + 3e-6)
    assert collectives.reduce_scatter_cost(1e6, 4, **link) == pytest.approx(0.75 * 1e-3 + 3e-6)
    assert collectives.all_to_all_cost(1e6, 8, **link) == pytest.approx(0.875 * 1e-3 + 7e-6)
    assert collectives.all_reduce_cost(1e6, 1, **link) == 0.0
    with pytest.raises(ValueError, match="bandwidth=0"):
        collectives.all_gather_cost(1.0, 2, bandwidth=0.0, latency=0.0)
