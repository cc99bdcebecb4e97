"""Gradient all-reduces deferred to the end of the step.

With several microbatches, a weight gradient whose layout finishes partial sums over a mesh
axis (data parallelism's weight-gradient matmul contracts the batch split over ``data``) would
be all-reduced once per microbatch. Instead, the task of each microbatch keeps every device's
partial sum: the equation runs under ``shard_map`` on the local blocks and returns them stacked
along a new dim split over the reduced axes (first, or after the iterations' dim of a ``scan``
it leaves), so it issues no collective. Casts, transposes and reshapes on the way to the
gradient, the calls and scans it leaves, a scatter of it into zeros (a position embedding's
gradient) and its addition to another such chain's value (a tied weight's) are applied to each
partial sum (they are linear), the accumulator adds stacked partial sums in place, and the
once-per-step mean sums the stacked dim (the one all-reduce) before it divides. Per device the
stacked accumulator holds as many bytes as the reduced one. Megatron-LM and Alpa accumulate the
same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from autopar._src import compat
from autopar._src.collectives import Axes, Spec, entry_axes
from autopar._src.layout_costs import spec_axes
from autopar._src.partial_chains import (
    PARTIAL_SUM_PRIMITIVES,
    Chain,
    gradient_chains,
    joins,
    linear_link,
    linked_operands,
)
from autopar._src.program import Task
from autopar._src.sharding_ilp import Edge, Node
from autopar._src.strategy_graph import Inner


def reduced_axes(
    input_specs: Sequence[Spec], output_spec: Spec, axis_names: Sequence[str]
) -> tuple[str, ...]:
    """The mesh axes that split an operand of a partial-sum equation but not its result: those
    over which its local results are partial sums, in mesh order."""
    ins = {a for spec in input_specs for entry in spec for a in entry_axes(entry)}
    out = {a for entry in output_spec for a in entry_axes(entry)}
    return tuple(a for a in axis_names if a in ins and a not in out)


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A value kept as one partial sum per device, stacked along a new dim."""

    axes: tuple[str, ...]
    """The mesh axes the partial sums are over; the stacked dim is split over them."""
    operand_specs: tuple[Spec, ...] | None = None
    """For the equation that makes the partial sums: its operands' layouts (``None``: the value
    is a linear function of a stacked value)."""
    at: int = 0
    """The stacked dim's position: first, but after the iterations' dim of each ``scan`` the
    value came out of (a scan stacks its iterations' results)."""

    @property
    def entry(self) -> Axes:
        """The stacked dim's spec entry."""
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def size(self, mesh: Mesh | None) -> int:
        """Length of the stacked dim: one partial sum per device along the summed axes."""
        assert mesh is not None, "a stacked sum is laid out over its stage's mesh"
        return math.prod(mesh.shape[a] for a in self.axes)

    def spec(self, base: Spec) -> PartitionSpec:
        """The spec of the stacked value whose reduced value has spec ``base``."""
        return PartitionSpec(*base[: self.at], self.entry, *base[self.at :])

    def base(self, spec: Sequence[Axes] | PartitionSpec) -> Spec:
        """The spec of the reduced value of a stacked value with spec ``spec``."""
        return (*spec[: self.at], *spec[self.at + 1 :])

    def shape(self, shape: Sequence[int], mesh: Mesh | None) -> tuple[int, ...]:
        """The shape of the stacked value whose reduced value has shape ``shape``."""
        return (*shape[: self.at], self.size(mesh), *shape[self.at :])


@dataclasses.dataclass(frozen=True)
class Deferred:
    """What one stage keeps as partial sums."""

    values: dict[Any, Stacked]
    """Per-microbatch values (jaxpr variables, and :class:`~autopar._src.strategy_graph.Inner`
    names inside calls) made as stacked partial sums."""
    accumulators: dict[Any, Stacked]
    """Gradient-region outputs whose running sums over microbatches are stacked."""


NONE = Deferred({}, {})


def deferred_sums(
    tasks: Sequence[Task], stage: int, partial_sums: Mapping[Any, Any], specs: Mapping[Any, Spec]
) -> Deferred:
    """The gradients of ``stage`` whose reduction can wait for the last microbatch.

    A region output qualifies when its per-microbatch value is made in the task that adds it
    to its accumulator, read by nothing else, by a chain of linear equations, calls and scans
    (:func:`~autopar._src.partial_chains.gradient_chains`) from an equation whose layout
    leaves partial sums (``partial_sums``: the sharding ILP's
    :attr:`~autopar._src.intra_op.StageSharding.partial_sums`), each link read only by the next,
    and neither the links nor the region output split over a summed axis (``specs``): a
    gradient laid out that way is reduce-scattered each microbatch, since its stacked sum
    would need more memory than the plan gives it.
    """
    values: dict[Any, Stacked] = {}
    accumulators: dict[Any, Stacked] = {}

    def qualifies(chain: Chain) -> bool:
        axes = partial_sums[chain.root][1]
        if any(set(axes) & spec_axes(specs.get(v, ())) for v in (*chain.links, chain.total)):
            return False  # split over a summed axis on the way: reduce-scatter each microbatch
        # A link must not fold the iterations' dims the stacked dim comes after.
        return all(len(_aval(v).shape) >= at for v, at in chain.at.items())

    # One value may be several gradients (a loss reading ``a + b`` has ``(m, m)``), and one
    # gradient the sum of several (a tied weight's): chains sharing a root or a gradient are
    # stacked all, over the same axes, or none.
    found = gradient_chains(tasks, stage, partial_sums.__contains__)
    mixed = _adding_others(tasks, stage, found)
    for chains in _sharing(found):
        axes = {partial_sums[c.root][1] for c in chains}
        if len(axes) != 1 or not all(qualifies(c) and c.total not in mixed for c in chains):
            continue
        for chain in chains:
            operand_specs, summed = partial_sums[chain.root]
            values[chain.root] = Stacked(summed, operand_specs)
            values.update((v, Stacked(summed, at=chain.at[v])) for v in chain.links)
            accumulators[chain.total] = Stacked(summed, at=chain.at[chain.total])
    return Deferred(values, accumulators)


def _adding_others(tasks: Sequence[Task], stage: int, chains: Sequence[Chain]) -> set[Any]:
    """The gradients whose accumulator also adds a value that no chain makes (``w @ w.T``'s
    gradient: a sum of partial sums and of a value made whole): stacked, every device's partial
    sum would hold that value, and the stacked dim's sum would count it once per device."""
    ends = {(c.total, c.links[-1] if c.links else c.root) for c in chains}

    def other(total: Any, k: Any) -> bool:
        if compat.is_literal(k):  # a zero adds nothing to any partial sum
            return not bool(np.all(np.asarray(compat.literal_value(k)) == 0))
        return (total, k[0] if isinstance(k, tuple) else k) not in ends

    return {
        op.out[0]
        for task in tasks
        if task.stage == stage
        for op in task.ops
        if op.kind == "acc" and op.mode == "add" and any(other(op.out[0], k) for k in op.ins[1:])
    }


def _sharing(chains: Sequence[Chain]) -> list[list[Chain]]:
    """``chains`` grouped by shared roots and gradients (connected components)."""
    graph = nx.Graph()
    graph.add_edges_from((("root", c.root), ("total", c.total)) for c in chains)
    group = {node: k for k, nodes in enumerate(nx.connected_components(graph)) for node in nodes}
    groups: dict[int, list[Chain]] = {}
    for c in chains:
        groups.setdefault(group[("root", c.root)], []).append(c)
    return list(groups.values())


def _aval(name: Any) -> Any:
    return name.var.aval if isinstance(name, Inner) else name.aval


def made_stacked(eqn: Any) -> bool:
    """Whether a stacked result of ``eqn`` is made by :func:`bind` (a partial-sum or linear
    equation), rather than by a call whose body makes it."""
    return (
        eqn.primitive.name in PARTIAL_SUM_PRIMITIVES or linear_link(eqn, eqn.invars) or joins(eqn, eqn.invars)
    )


def bind(eqn: Any, vals: list[Any], stacked: Stacked, out_spec: Spec, mesh: Mesh | None) -> Any:
    """``eqn`` applied to ``vals``, as stacked partial sums."""
    if stacked.operand_specs is None:  # a linear function of stacked values
        linked = linked_operands(eqn)
        in_axes = [stacked.at if k in linked else None for k in range(len(vals))]
        return jax.vmap(lambda *xs: compat.bind_eqn(eqn, list(xs))[0], in_axes=in_axes, out_axes=stacked.at)(
            *vals
        )

    def local(*xs: Any) -> Any:
        return compat.bind_eqn(eqn, list(xs))[0][None]

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(PartitionSpec(*s) for s in stacked.operand_specs),
        out_specs=stacked.spec(out_spec),
        check_vma=False,
    )(*[jnp.asarray(v) for v in vals])


def zeros(aval: Any, stacked: Stacked | None, mesh: Mesh | None) -> Any:
    """The start of a running sum: zeros of ``aval``, stacked over ``mesh`` when the sum is."""
    if stacked is None:
        return jnp.zeros(aval.shape, aval.dtype)
    return jnp.zeros(stacked.shape(aval.shape, mesh), aval.dtype)


def finish(total: Any, stacked: Stacked | None) -> Any:
    """The reduced value of a running sum: the stacked partial sums added up."""
    return total if stacked is None else jnp.sum(total, axis=stacked.at)


def priced_once(
    nodes: Sequence[Node],
    edges: Sequence[Edge],
    producer: Mapping[Any, tuple[int, int]],
    chains: Sequence[Chain],
    runs: Mapping[Any, int],
    axis_names: Sequence[str],
) -> tuple[tuple[Node, ...], tuple[Edge, ...]]:
    """The strategy graph with each gradient's partial-sum all-reduce priced once per step, as
    the driver runs it (``chains`` from :func:`~autopar._src.partial_chains.gradient_chains`;
    ``runs``: per chain root, the microbatches its gradient is summed over, each op's costs
    being already scaled by the times it runs, so a root inside a ``scan`` pays one all-reduce
    of all its iterations). Where the value the accumulator adds splits over a summed axis the
    driver reduces each microbatch, so that pair of choices (the root's and that value's) gets
    the difference back on an edge.

    The gradients' collectives do not wait on one another, and XLA's combiners merge them
    (a data-parallel step issues one all-reduce for all its gradients): outside a loop, or
    summed over microbatches and reduced once, each gradient pays its bytes but not its own
    ring's latency (:attr:`~autopar._src.sharding_ilp.Strategy.latency_cost`), which the
    combined collective pays once for them all, whatever the layouts."""
    nodes, edges = list(nodes), list(edges)
    at_edge = {(e.src, e.dst): k for k, e in enumerate(edges)}
    seen = set()
    for chain in chains:
        root, links = chain.root, chain.links
        runs_per_step = runs.get(root, 1)
        if root not in producer or root in seen:
            continue  # (each microbatch's task gives the same chain)
        seen.add(root)
        i = producer[root][0]
        # A scan's iterations each reduce their own slice unless the microbatches' sum waits.
        if runs_per_step > 1 or not any(chain.at.values()):
            nodes[i] = Node(
                name=nodes[i].name,
                strategies=tuple(
                    dataclasses.replace(
                        s, communication_cost=s.communication_cost - s.latency_cost, latency_cost=0.0
                    )
                    for s in nodes[i].strategies
                ),
            )
        if runs_per_step <= 1:
            continue
        summed = [
            set(reduced_axes(s.input_specs, s.output_specs[0], axis_names)) for s in nodes[i].strategies
        ]
        saved = np.array(
            [
                s.communication_cost * (1 - 1 / runs_per_step) if ax else 0.0
                for s, ax in zip(nodes[i].strategies, summed, strict=True)
            ]
        )
        nodes[i] = Node(
            name=nodes[i].name,
            strategies=tuple(
                dataclasses.replace(s, communication_cost=s.communication_cost - d)
                for s, d in zip(nodes[i].strategies, saved, strict=True)
            ),
        )
        # The value the accumulator adds: the last link with a node of its own (a call's result
        # is its body value's alias). Laid out over a summed axis, it is reduced each microbatch.
        added = next((producer[v] for v in reversed(links) if v in producer and producer[v][0] != i), None)
        if added is not None:
            j, out = added
            clash = np.array(
                [[bool(ax & spec_axes(t.output_specs[out])) for t in nodes[j].strategies] for ax in summed]
            )
            if (i, j) in at_edge:
                k = at_edge[(i, j)]
                edges[k] = Edge(src=i, dst=j, cost=edges[k].cost + clash * saved[:, None])
            else:
                at_edge[(i, j)] = len(edges)
                edges.append(Edge(src=i, dst=j, cost=clash * saved[:, None]))
    return tuple(nodes), tuple(edges)
