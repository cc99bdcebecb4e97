"""Shrinking a sharding ILP before solving it: forced choices merged, solutions mapped back.

:func:`merge_forced` folds the nodes whose choice another node fixes (an elementwise op
following its operand), single-strategy nodes and parallel edges into fewer decision
groups with the same optimum; :func:`expand` maps a solution of the reduced problem back;
:func:`solve_merged` does both around :func:`autopar._src.sharding_ilp.solve`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from autopar._src.sharding_ilp import Edge, Node, ShardingSolution, check_problem, solve


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReductionMapping:
    """How the nodes of a problem reduced by :func:`merge_forced` stand for the original ones."""

    num_nodes: int
    """Number of nodes of the original problem."""
    members: tuple[tuple[int, ...], ...]
    """Per reduced node, the original nodes it stands for."""
    choices: tuple[tuple[tuple[int, ...], ...], ...]
    """Per reduced node and per its strategy, the original strategy of each member."""


class _Reducer:
    """The working state of one :func:`merge_forced` call."""

    def __init__(self, nodes: Sequence[Node], edges: Sequence[Edge]) -> None:
        self.nodes = nodes
        self.members = {v: [v] for v in range(len(nodes))}
        # Per group and strategy: the original strategy of each member, and compute, communication, memory.
        self.table = {v: np.arange(len(n.strategies))[:, None] for v, n in enumerate(nodes)}
        self.values = {
            v: np.array([[s.compute_cost, s.communication_cost, s.memory_bytes] for s in n.strategies], float)
            for v, n in enumerate(nodes)
        }
        self.adjacent: dict[int, set[int]] = {v: set() for v in self.members}
        self.edges: dict[tuple[int, int], np.ndarray] = {}  # key (a, b) with a < b; rows are a's strategies
        # Pairs whose edge may reduce; (g, g) asks whether group g is an isolated single strategy.
        self.work = [(v, v) for v in reversed(self.members)]
        for e in edges:
            self.add_edge(e.src, e.dst, e.cost)

    def edge(self, a: int, b: int) -> np.ndarray:
        return self.edges[(a, b)] if a < b else self.edges[(b, a)].T

    def add_edge(self, a: int, b: int, cost: np.ndarray) -> None:
        key, cost = ((a, b), cost) if a < b else ((b, a), cost.T)
        self.edges[key] = self.edges[key] + cost if key in self.edges else np.array(cost)
        self.adjacent[a].add(b)
        self.adjacent[b].add(a)
        self.work.append(key)

    def pop_edge(self, a: int, b: int) -> np.ndarray:
        cost = self.edge(a, b)
        del self.edges[(min(a, b), max(a, b))]
        self.adjacent[a].discard(b)
        self.adjacent[b].discard(a)
        self.work += [(a, a), (b, b)]
        return cost

    def restrict(self, g: int, keep: np.ndarray) -> None:
        """Drop the strategies of group ``g`` that ``keep`` rules out."""
        if keep.all():
            return
        if not keep.any():
            names = [self.nodes[m].name for m in self.members[g]]
            raise ValueError(f"every strategy of node(s) {names} meets an infinite resharding cost")
        self.table[g], self.values[g] = self.table[g][keep], self.values[g][keep]
        for w in self.adjacent[g]:
            key = (min(g, w), max(g, w))
            self.edges[key] = self.edges[key][keep] if g < w else self.edges[key][:, keep]
            self.work.append(key)
        self.work.append((g, g))

    def add_communication(self, g: int, cost: np.ndarray) -> None:
        self.values[g][:, 1] += cost
        self.restrict(g, np.isfinite(self.values[g][:, 1]))

    def absorb(self, keep: int, drop: int, follow: np.ndarray) -> None:
        """Merge group ``drop`` into ``keep``; ``follow[j]`` is drop's strategy when keep picks ``j``."""
        self.members[keep] += self.members.pop(drop)
        self.table[keep] = np.hstack([self.table[keep], self.table.pop(drop)[follow]])
        self.values[keep] = self.values[keep] + self.values.pop(drop)[follow]
        between = np.zeros(len(follow))
        for w in sorted(self.adjacent[drop]):
            cost = self.pop_edge(drop, w)[follow]
            if w == keep:
                between += np.diagonal(cost)
            else:
                self.add_edge(keep, w, cost)
        del self.adjacent[drop]
        self.add_communication(keep, between)

    def reduce_edge(self, a: int, b: int) -> None:
        finite = np.isfinite(self.edges[(a, b)])
        self.restrict(a, finite.any(axis=1))
        self.restrict(b, finite.any(axis=0))
        cost = self.edges[(a, b)]
        finite = np.isfinite(cost)
        if (cost == cost[:1]).all():  # depends on b's choice only (always so when a has one strategy)
            self.add_communication(b, self.pop_edge(a, b)[0])
        elif (cost == cost[:, :1]).all():
            self.add_communication(a, self.pop_edge(a, b)[:, 0])
        elif (finite.sum(axis=1) == 1).all():  # a's choice fixes b's: b follows a
            self.absorb(a, b, np.argmax(finite, axis=1))
        elif (finite.sum(axis=0) == 1).all():
            self.absorb(b, a, np.argmax(finite, axis=0))

    def run(self) -> None:
        while self.work:
            a, b = self.work.pop()
            if a != b and (a, b) in self.edges:
                self.reduce_edge(a, b)
            elif a == b and a in self.members and len(self.members) > 1:
                if len(self.table[a]) == 1 and not self.adjacent[a]:
                    other = next(v for v in self.members if v != a)  # the lowest index: dicts keep order
                    self.absorb(other, a, np.zeros(len(self.table[other]), int))


def merge_forced(
    nodes: Sequence[Node], edges: Sequence[Edge]
) -> tuple[tuple[Node, ...], tuple[Edge, ...], ReductionMapping]:
    """Shrink a problem without changing its optimum; :func:`expand` maps solutions back.

    Applied until nothing changes:

    1. Parallel edges (either direction) between two nodes are summed into one.
    2. A strategy that meets only infinite costs on some edge is dropped.
    3. An edge whose cost depends on one endpoint's choice only (every edge at a
       single-strategy node is such) is folded into that endpoint's communication cost;
       strategies that become infinite are dropped. An all-zero edge is simply removed.
    4. An edge on which one endpoint's choice fixes the other's (every strategy of the first
       has exactly one finite-cost partner; e.g. an elementwise op forced to follow its
       operand: 0 on a one-to-one pairing, inf elsewhere) merges the follower into the
       leader, the lower index leading when both qualify. The merged node keeps the leader's
       strategies, each with the compute, communication and memory of its follower's
       partner and the edge's cost added; the follower's other edges move to the leader.
    5. A single-strategy node left without edges is absorbed by the lowest-index other node
       (its costs and memory are added to every strategy there), unless it is the last node.

    Every reduced choice vector has the cost and memory of its expansion, and every
    original choice vector of finite cost is the expansion of one, so the optimum and a
    memory budget carry over unchanged. A merged node is named by its members' names in
    index order joined with ``+``; its strategies keep the names and specs of the leader's.

    Raises:
      ValueError: if some node has no strategy of finite cost left (the problem is infeasible).
    """
    check_problem(nodes, edges)
    reducer = _Reducer(nodes, edges)
    reducer.run()
    order = sorted(reducer.members)
    reduced = []
    for g in order:
        first, table, values = nodes[reducer.members[g][0]], reducer.table[g], reducer.values[g].tolist()
        strategies = tuple(
            dataclasses.replace(first.strategies[i], compute_cost=c, communication_cost=t, memory_bytes=m)
            for i, (c, t, m) in zip(table[:, 0], values, strict=True)
        )
        reduced.append(
            Node(name="+".join(nodes[m].name for m in sorted(reducer.members[g])), strategies=strategies)
        )
    index = {g: k for k, g in enumerate(order)}
    reduced_edges = tuple(
        Edge(src=index[a], dst=index[b], cost=c) for (a, b), c in sorted(reducer.edges.items())
    )
    mapping = ReductionMapping(
        num_nodes=len(nodes),
        members=tuple(tuple(reducer.members[g]) for g in order),
        choices=tuple(tuple(tuple(row) for row in reducer.table[g].tolist()) for g in order),
    )
    return tuple(reduced), reduced_edges, mapping


def expand(solution: ShardingSolution, mapping: ReductionMapping) -> ShardingSolution:
    """A solution of a problem reduced by :func:`merge_forced`, as choices of the original nodes."""
    if len(solution.choices) != len(mapping.members):
        raise ValueError(
            f"solution has {len(solution.choices)} choices; the reduced problem {len(mapping.members)}"
        )
    choices = [0] * mapping.num_nodes
    for r, j in enumerate(solution.choices):
        for member, choice in zip(mapping.members[r], mapping.choices[r][j], strict=True):
            choices[member] = choice
    return dataclasses.replace(solution, choices=tuple(choices))


def solve_merged(
    nodes: Sequence[Node],
    edges: Sequence[Edge],
    *,
    memory_budget: float | None = None,
    time_limit: float = 30.0,
) -> tuple[ShardingSolution, int]:
    """:func:`solve` on the problem :func:`merge_forced` reduces, expanded back to ``nodes``;
    also the number of nodes the reduced problem had (its decision groups)."""
    reduced, reduced_edges, mapping = merge_forced(nodes, edges)
    solution = solve(reduced, reduced_edges, memory_budget=memory_budget, time_limit=time_limit)
    return expand(solution, mapping), len(reduced)
