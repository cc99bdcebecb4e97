"""The intra-operator sharding ILP: one sharding strategy per op, least total time.

Alpa's intra-op pass as pure functions over cost arrays (no devices, no JAX). Every
node is an op with a few candidate strategies (batch split, column split, replicate,
...); every edge carries the resharding cost from the producer's output layout to the
layout the consumer's strategy needs. :func:`solve` picks one strategy per node to
minimise

    sum_v (compute + communication)[choice_v] + sum_(u, v) cost_uv[choice_u, choice_v]

subject to an optional per-device memory budget, as a MILP for HiGHS: its LP relaxation
first (:func:`scipy.optimize.linprog`), which is integral for most sharding problems, then,
if it is not, :func:`scipy.optimize.milp`. :mod:`autopar._src.ilp_merge` shrinks a problem before solving it;
:mod:`autopar._src.collectives` prices the edges on a mesh.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Sequence
from typing import Literal

import numpy as np
import scipy.sparse
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from autopar._src.collectives import Spec

SolveStatus = Literal["optimal", "time_limit", "fallback"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    """One way to shard one op, with what it costs."""

    name: str
    """Short label, e.g. ``"column"`` or ``"replicate"``."""
    compute_cost: float
    """Seconds of computation per device under this strategy."""
    communication_cost: float
    """Seconds of the collectives this strategy issues itself (e.g. the all-reduce after a row split)."""
    memory_bytes: float
    """Bytes per device this node keeps: its share of parameters, optimizer state and outputs."""
    latency_cost: float = 0.0
    """Of ``communication_cost``, the seconds its collectives take whatever their size (the ring's
    steps): what combining it with other independent collectives saves (see
    :func:`~autopar._src.deferred.priced_once`)."""
    output_specs: tuple[Spec, ...] = ()
    """Per output, the mesh axis (or None) of each tensor dim."""
    input_specs: tuple[Spec, ...] = ()
    """Per input, the mesh axis (or None) of each tensor dim that this strategy needs."""

    def __post_init__(self) -> None:
        for field in ("compute_cost", "communication_cost", "memory_bytes", "latency_cost"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"Strategy {self.name!r}: {field}={value} must be finite and >= 0")

    @property
    def cost(self) -> float:
        """Compute plus communication seconds."""
        return self.compute_cost + self.communication_cost


@dataclasses.dataclass(frozen=True, kw_only=True)
class Node:
    """An op (or a group of ops merged by :func:`merge_forced`) and its candidate strategies."""

    name: str
    """Label used in messages, e.g. the equation's primitive and output."""
    strategies: tuple[Strategy, ...]
    """The candidates; a solution picks exactly one."""

    def __post_init__(self) -> None:
        if not self.strategies:
            raise ValueError(f"Node {self.name!r} has no strategies; give it at least one")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Edge:
    """A value flowing from node ``src`` to node ``dst`` and what resharding it costs."""

    src: int
    """Index of the producing node."""
    dst: int
    """Index of the consuming node."""
    cost: np.ndarray
    """Seconds, shape (src strategies, dst strategies); ``np.inf`` marks a pair that is not allowed."""

    def __post_init__(self) -> None:
        cost = np.array(self.cost, dtype=float)
        if self.src < 0 or self.dst < 0 or self.src == self.dst:
            raise ValueError(f"Edge needs distinct node indices >= 0, got src={self.src}, dst={self.dst}")
        if cost.ndim != 2:
            raise ValueError(f"Edge {self.src}->{self.dst}: cost must be 2-D, got shape {cost.shape}")
        if np.isnan(cost).any() or (cost < 0).any():
            bad = cost[np.isnan(cost) | (cost < 0)][:3]
            raise ValueError(f"Edge {self.src}->{self.dst}: costs must be seconds >= 0 or inf, got {bad}")
        cost.setflags(write=False)
        object.__setattr__(self, "cost", cost)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingSolution:
    """One strategy per node and what the choice costs."""

    choices: tuple[int, ...]
    """Index of the chosen strategy of each node."""
    objective: float
    """Total seconds: node costs plus resharding costs of the choices."""
    status: SolveStatus
    """``optimal``: proven optimal; ``time_limit``: time ran out, the better of the solver's best
    and :func:`greedy`; ``fallback``: the solver gave nothing, the choices come from :func:`greedy`."""
    solve_seconds: float
    """Wall-clock seconds spent in :func:`solve`."""


def check_problem(nodes: Sequence[Node], edges: Sequence[Edge]) -> None:
    for k, edge in enumerate(edges):
        if max(edge.src, edge.dst) >= len(nodes):
            raise ValueError(f"edges[{k}] joins {edge.src}->{edge.dst} but there are {len(nodes)} nodes")
        want = (len(nodes[edge.src].strategies), len(nodes[edge.dst].strategies))
        if edge.cost.shape != want:
            raise ValueError(
                f"edges[{k}] ({edge.src}->{edge.dst}) has cost shape {edge.cost.shape}, want {want}"
            )


def total_cost(nodes: Sequence[Node], edges: Sequence[Edge], choices: Sequence[int]) -> float:
    """Objective of a choice vector: node costs plus edge costs (inf if a pair is not allowed)."""
    node_part = sum(node.strategies[c].cost for node, c in zip(nodes, choices, strict=True))
    return node_part + sum(float(e.cost[choices[e.src], choices[e.dst]]) for e in edges)


def total_memory(nodes: Sequence[Node], choices: Sequence[int]) -> float:
    """Bytes per device of a choice vector."""
    return sum(node.strategies[c].memory_bytes for node, c in zip(nodes, choices, strict=True))


def _fits(nodes: Sequence[Node], memory_budget: float | None, choices: Sequence[int]) -> bool:
    return memory_budget is None or total_memory(nodes, choices) <= memory_budget


def brute_force(
    nodes: Sequence[Node], edges: Sequence[Edge], memory_budget: float | None = None
) -> ShardingSolution:
    """Best choice vector by enumerating all of them; for tests on tiny problems.

    Raises:
      ValueError: if no choice vector has finite cost within the memory budget.
    """
    check_problem(nodes, edges)
    start = time.perf_counter()
    every = itertools.product(*(range(len(n.strategies)) for n in nodes))
    scored = ((total_cost(nodes, edges, c), c) for c in every if _fits(nodes, memory_budget, c))
    best = min(((cost, c) for cost, c in scored if math.isfinite(cost)), default=None)
    if best is None:
        raise ValueError(f"no choice vector has finite cost within memory_budget={memory_budget}")
    return ShardingSolution(
        choices=best[1], objective=best[0], status="optimal", solve_seconds=time.perf_counter() - start
    )


def greedy(
    nodes: Sequence[Node], edges: Sequence[Edge], *, memory_budget: float | None = None
) -> tuple[int, ...]:
    """Each node, in index order, takes its cheapest strategy given the nodes chosen before it.

    Cheapest counts the node's own cost plus the resharding costs to already-chosen neighbours.
    Candidates are, by preference: strategies with finite cost that keep the budget reachable
    (the memory so far, this strategy and every later node at its smallest strategy fit), then
    those that keep it reachable, then all; ties go to the lower index. The result may still
    cost inf or exceed the budget; :func:`solve` checks it.
    """
    check_problem(nodes, edges)
    incident: list[list[tuple[int, np.ndarray]]] = [[] for _ in nodes]
    for e in edges:
        incident[e.dst].append((e.src, e.cost.T))  # rows: this node's strategies
        incident[e.src].append((e.dst, e.cost))
    least = np.array([min(s.memory_bytes for s in n.strategies) for n in nodes])
    later_least = least.sum() - np.cumsum(least)  # every node after v on its smallest strategy
    choices: list[int] = []
    used = 0.0
    for v, node in enumerate(nodes):
        cost = np.array([s.cost for s in node.strategies])
        for u, matrix in incident[v]:
            if u < v:
                cost = cost + matrix[:, choices[u]]
        memory = np.array([s.memory_bytes for s in node.strategies])
        fits = used + memory + later_least[v] <= (np.inf if memory_budget is None else memory_budget)
        masks = (fits & np.isfinite(cost), fits, np.ones(len(cost), bool))
        candidates = np.flatnonzero(next(m for m in masks if m.any()))
        choices.append(int(candidates[np.argmin(cost[candidates])]))
        used += memory[choices[-1]]
    return tuple(choices)


def _solve_milp(
    nodes: Sequence[Node], edges: Sequence[Edge], memory_budget: float | None, time_limit: float
) -> tuple[tuple[int, ...] | None, SolveStatus]:
    """Solve the MILP; ``None`` choices when HiGHS returns no usable solution."""
    sizes = np.array([len(n.strategies) for n in nodes])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    costs = [np.array([s.cost for n in nodes for s in n.strategies])]
    memory = np.array([s.memory_bytes for n in nodes for s in n.strategies])
    # Equality rows: one strategy per node, then per edge the marginals of e_uv equal s_u and s_v.
    rows = [np.repeat(np.arange(len(nodes)), sizes)]
    cols = [np.arange(offsets[-1])]
    vals = [np.ones(offsets[-1])]
    num_rows, num_cols = len(nodes), int(offsets[-1])
    for e in edges:
        if not e.cost.any():  # all zeros: no term in the objective, no variables needed
            continue
        ii, jj = np.nonzero(np.isfinite(e.cost))  # infinite pairs get no variable, so they are 0
        ku, kv = e.cost.shape
        ids = num_cols + np.arange(len(ii))
        costs.append(e.cost[ii, jj])
        rows += [num_rows + ii, num_rows + ku + jj, num_rows + np.arange(ku + kv)]
        cols += [ids, ids, np.concatenate([offsets[e.src] + np.arange(ku), offsets[e.dst] + np.arange(kv)])]
        vals += [np.ones(len(ii)), np.ones(len(ii)), -np.ones(ku + kv)]
        num_rows, num_cols = num_rows + ku + kv, num_cols + len(ii)
    matrix = scipy.sparse.csr_array(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(num_rows, num_cols)
    )
    rhs = np.zeros(num_rows)
    rhs[: len(nodes)] = 1.0
    constraints = [LinearConstraint(matrix, rhs, rhs)]
    upper = np.ones(num_cols)
    if memory_budget is not None:
        upper[: len(memory)] = memory <= memory_budget
        if memory_budget > 0:  # scaled so HiGHS's absolute feasibility tolerance means a relative one
            row = scipy.sparse.csr_array(np.concatenate([memory, np.zeros(num_cols - len(memory))])[None])
            constraints.append(LinearConstraint(row / memory_budget, -np.inf, 1.0))
    objective = np.concatenate(costs)
    # HiGHS stops at an absolute gap of 1e-6; costs in seconds are often far smaller, so scale them up.
    scale = np.abs(objective).max(initial=0.0)
    objective = objective / scale if scale > 0 else objective
    start = time.perf_counter()
    x = _integral_relaxation(objective, constraints, upper, time_limit)
    if x is None:
        left = max(time_limit - (time.perf_counter() - start), 0.1 * time_limit)
        result = milp(
            objective,
            integrality=np.ones(num_cols),
            bounds=Bounds(np.zeros(num_cols), upper),
            constraints=constraints,
            options={"time_limit": left, "mip_rel_gap": 1e-9},
        )
        if result.x is None:
            return None, "fallback"
        x = result.x
        status: SolveStatus = "optimal" if result.status == 0 else "time_limit"
    else:
        status = "optimal"
    choices = tuple(int(np.argmax(x[offsets[v] : offsets[v + 1]])) for v in range(len(nodes)))
    # Rounding within the solver's tolerances can break a constraint; never return such a choice.
    if not (math.isfinite(total_cost(nodes, edges, choices)) and _fits(nodes, memory_budget, choices)):
        return None, "fallback"
    return choices, status


def _integral_relaxation(
    objective: np.ndarray, constraints: Sequence[LinearConstraint], upper: np.ndarray, time_limit: float
) -> np.ndarray | None:
    """The LP relaxation's optimum if it is integral (then it is the MILP's optimum too), else None.

    Sharding problems are mostly trees and chains, whose relaxations have integral optima; the
    simplex method finds one in a fraction of a second, where HiGHS's MILP root (probing the
    one-strategy-per-node cliques) can take minutes on a layer of a few hundred equations
    without looking at its time limit.
    """
    eq, *ub = constraints
    result = linprog(
        objective,
        A_eq=eq.A,
        b_eq=eq.ub,
        A_ub=ub[0].A if ub else None,
        b_ub=ub[0].ub if ub else None,
        bounds=np.stack([np.zeros_like(upper), upper], axis=1),
        method="highs-ds",
        options={"time_limit": time_limit},
    )
    if result.status != 0 or result.x is None:
        return None
    x = result.x
    return x if np.all(np.minimum(np.abs(x), np.abs(1.0 - x)) <= 1e-9) else None


class NoLayoutFitsError(ValueError):
    """No layout of a strategy graph fits its memory budget (or, from
    :func:`autopar._src.build.check_fits`, a stage's compiled program does not fit the device)."""

    def __init__(self, message: str, *, budget: float, least: float) -> None:
        super().__init__(message)
        self.budget = budget
        """The budget, bytes per device."""
        self.least = least
        """A lower bound on the bytes per device of any layout (each node on its smallest); for
        a compiled program, its peak."""


def _raise_unless_feasible(
    nodes: Sequence[Node], edges: Sequence[Edge], choices: Sequence[int], memory_budget: float | None
) -> None:
    if not _fits(nodes, memory_budget, choices):
        least = [min(s.memory_bytes for s in n.strategies) for n in nodes]
        top = ", ".join(f"{nodes[v].name!r} ({least[v]:.4g} B)" for v in np.argsort(least)[::-1][:3])
        raise NoLayoutFitsError(
            f"no sharding fits memory_budget={memory_budget:.4g} bytes per device; the minimum achievable is "
            f"at least {sum(least):.4g} bytes (every node on its smallest strategy). Largest nodes: {top}. "
            "Raise the budget, use more devices or add strategies that shard more.",
            budget=float(memory_budget or 0.0),
            least=float(sum(least)),
        )
    bad = [(e.src, e.dst) for e in edges if not np.isfinite(e.cost[choices[e.src], choices[e.dst]])]
    if bad:
        raise ValueError(
            f"no sharding found that avoids the disallowed (infinite-cost) resharding pairs; the greedy "
            f"fallback meets them on edges {bad[:5]}. Allow those pairs or give the nodes compatible "
            "strategies."
        )


def solve(
    nodes: Sequence[Node],
    edges: Sequence[Edge],
    *,
    memory_budget: float | None = None,
    time_limit: float = 30.0,
) -> ShardingSolution:
    """Choose one strategy per node minimising total seconds, within a per-device memory budget.

    Binary ``s[v, i]`` picks strategy ``i`` of node ``v``; binary ``e[uv, i, j]`` stands for the
    product ``s[u, i] * s[v, j]`` through ``sum_j e[i, j] = s[u, i]`` and ``sum_i e[i, j] = s[v, j]``.
    Pairs of infinite cost get no ``e`` (so they cannot be chosen); edges that cost zero
    everywhere get none at all. If time runs out, the better of HiGHS's best solution and
    :func:`greedy`'s comes back as ``time_limit``; if HiGHS has none (out of time, or no
    choice fits), :func:`greedy`'s comes back as ``fallback``, provided it is feasible.

    Example:
      >>> a = Node(name="a", strategies=(Strategy(name="r", compute_cost=1, communication_cost=0,
      ...     memory_bytes=0), Strategy(name="c", compute_cost=2, communication_cost=0, memory_bytes=0)))
      >>> solve([a, a], [Edge(src=0, dst=1, cost=np.array([[9.0, 9], [0, 0]]))]).choices
      (1, 0)

    Raises:
      ValueError: if HiGHS gives no solution and the greedy one breaks the memory budget
        (the message names the budget, the least memory possible and the largest nodes) or
        meets a pair that is not allowed.
    """
    check_problem(nodes, edges)
    if memory_budget is not None and not memory_budget >= 0:
        raise ValueError(f"memory_budget={memory_budget} must be >= 0 bytes or None")
    if not time_limit > 0:
        raise ValueError(f"time_limit={time_limit} must be > 0 seconds")
    start = time.perf_counter()
    choices, status = _solve_milp(nodes, edges, memory_budget, time_limit) if nodes else ((), "optimal")
    if choices is None:
        choices = greedy(nodes, edges, memory_budget=memory_budget)
        _raise_unless_feasible(nodes, edges, choices, memory_budget)
    elif status == "time_limit":
        fallback = greedy(nodes, edges, memory_budget=memory_budget)
        cheaper = total_cost(nodes, edges, fallback) < total_cost(nodes, edges, choices)
        if cheaper and _fits(nodes, memory_budget, fallback):
            choices = fallback  # cut short, HiGHS may hold an incumbent worse than the greedy
    return ShardingSolution(
        choices=tuple(choices),
        objective=total_cost(nodes, edges, choices),
        status=status,
        solve_seconds=time.perf_counter() - start,
    )
