"""Gradient all-reduces deferred to the end of the step.

With several microbatches, a weight gradient whose layout finishes partial sums over a mesh
axis (data parallelism's weight-gradient matmul contracts the batch split over ``data``)
would be all-reduced once per microbatch. Instead, the task of each microbatch keeps every
device's partial sum: the equation runs under ``shard_map`` on the local blocks and returns
them stacked along a new leading dim split over the reduced axes, so it issues no collective.
Casts and transposes on the way to the gradient are applied to each partial sum (they are
linear), the accumulator adds stacked partial sums in place, and the once-per-step mean sums
the stacked dim (the one all-reduce) before it divides. Per device the stacked accumulator
holds as many bytes as the reduced one. Megatron-LM and Alpa accumulate the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from autopar._src import compat
from autopar._src.collectives import Axes, Spec, entry_axes
from autopar._src.layout_costs import spec_axes
from autopar._src.program import Task
from autopar._src.sharding_ilp import Edge, Node
from autopar._src.strategy_graph import GraphOp, Inner

PARTIAL_SUM_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated", "reduce_sum"})
"""Primitives whose result on local blocks is a partial sum of the result's block when a
contracted (or reduced) dim is split: applied to every device's blocks and summed, they give
the whole result."""
LINEAR_PRIMITIVES = frozenset({"convert_element_type", "transpose", "copy", "copy_p", "reshape"})
"""One-operand primitives that may be applied to each partial sum instead of to their sum."""


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

    def size(self, mesh: Mesh) -> int:
        """Length of the stacked dim: one partial sum per device along the summed axes."""
        return math.prod(mesh.shape[a] for a in self.axes)

    def spec(self, base: Spec) -> PartitionSpec:
        """The spec of the stacked value whose reduced value has spec ``base``."""
        return PartitionSpec(*base[: self.at], self.entry, *base[self.at :])

    def base(self, spec: Spec) -> Spec:
        """The spec of the reduced value of a stacked value with spec ``spec``."""
        return (*spec[: self.at], *spec[self.at + 1 :])

    def shape(self, shape: Sequence[int], mesh: Mesh) -> tuple[int, ...]:
        """The shape of the stacked value whose reduced value has shape ``shape``."""
        return (*shape[: self.at], self.size(mesh), *shape[self.at :])


class Chain(NamedTuple):
    """How a gradient is made as partial sums (see :func:`gradient_chains`)."""

    root: Any
    """The value of the equation that makes the partial sums."""
    links: list[Any]
    """The values of the linear equations (and calls) from it, in order."""
    total: Any
    """The value that sums the last one over the microbatches (or, in one microbatch's
    equations, the gradient)."""
    at: dict[Any, int]
    """The stacked dim's position (:attr:`Stacked.at`) of each link and the total."""


@dataclasses.dataclass(frozen=True)
class Deferred:
    """What one stage keeps as partial sums."""

    values: dict[Any, Stacked]
    """Per-microbatch values (jaxpr variables) made as stacked partial sums."""
    accumulators: dict[Any, Stacked]
    """Gradient-region outputs whose running sums over microbatches are stacked."""


NONE = Deferred({}, {})


def deferred_sums(
    tasks: Sequence[Task], stage: int, partial_sums: Mapping[Any, Any], specs: Mapping[Any, Spec]
) -> Deferred:
    """The gradients of ``stage`` whose reduction can wait for the last microbatch.

    A region output qualifies when its per-microbatch value is made in the task that adds it
    to its accumulator, read by nothing else, by a chain of :data:`LINEAR_PRIMITIVES` from an
    equation whose layout leaves partial sums (``partial_sums``: the sharding ILP's
    :attr:`~autopar._src.intra_op.StageSharding.partial_sums`), each link read only by the next,
    and neither the links nor the region output split over a summed axis (``specs``): a
    gradient laid out that way is reduce-scattered each microbatch, since its stacked sum
    would need more memory than the plan gives it.
    """
    values: dict[Any, Stacked] = {}
    accumulators: dict[Any, Stacked] = {}
    for chain in gradient_chains(tasks, stage, partial_sums.__contains__):
        operand_specs, axes = partial_sums[chain.root]
        if any(set(axes) & spec_axes(specs.get(v, ())) for v in (*chain.links, chain.total)):
            continue  # split over a summed axis on the way: reduce-scatter each microbatch
        values[chain.root] = Stacked(axes, operand_specs)
        values.update((v, Stacked(axes, at=chain.at[v])) for v in chain.links)
        accumulators[chain.total] = Stacked(axes, at=chain.at[chain.total])
    return Deferred(values, accumulators)


def gradient_chains(tasks: Sequence[Task], stage: int, is_partial: Callable[[Any], bool]) -> list[Chain]:
    """The :class:`Chain` of every gradient of ``stage`` that is made as partial sums: its root
    by an equation of :data:`PARTIAL_SUM_PRIMITIVES` (for which ``is_partial`` holds for its
    variable), its links by linear equations from it, the last one the value the accumulator
    (the total) adds. The chain may pass out of nested ``jit`` and rematerialised calls (a
    rematerialised block's weight gradients are made inside its backward call) and out of a
    ``scan`` as a stacked result (a scanned layer stack's): their values are named
    :class:`~autopar._src.strategy_graph.Inner` as the ILP names them, and the call's result
    is a link."""
    chains = []
    for task in tasks:
        if task.stage != stage:
            continue
        adds = [op for op in task.ops if op.kind == "acc" and op.mode == "add"]
        made = {
            k: (op.eqn, op.ins, index)
            for op in task.ops
            if op.kind == "eqn"
            for index, k in enumerate(op.outs)
            if k is not None
        }
        reads = Counter(k for op in task.ops if op not in adds for k in op.ins if isinstance(k, tuple))
        reads.update(task.out_keys)

        def descend(eqn: Any, index: int) -> list[Any] | None:
            return _call_chain(eqn, index, (), is_partial)

        for op in adds:
            chain = _partial_chain(op.ins[1], made, reads, 0, is_partial, descend, name_of=lambda k: k[0])
            if chain is not None:
                chains.append(_chain(chain, op.outs[0][0]))
    return chains


def _chain(names: list[tuple[Any, int]], total: Any) -> Chain:
    at = dict(names[1:])
    at[total] = names[-1][1]
    return Chain(names[0][0], [name for name, _ in names[1:]], total, at)


def graph_chains(
    ops: Sequence[GraphOp], grads: Iterable[Any], loops: frozenset[int] = frozenset()
) -> list[Chain]:
    """:func:`gradient_chains` of one microbatch's equations (named values, calls expanded, see
    :class:`~autopar._src.strategy_graph.GraphOp`), for the gradients ``grads`` (each chain's
    total; the positions ``at`` are not kept). Chains through values inside the loops or
    branches ``loops`` (the ids of their equations, see :func:`loop_ids`) are left out: the
    driver reduces those gradients each microbatch."""
    made = {
        out: (op.eqn, op.ins, index) for op in ops for index, out in enumerate(op.outs) if out is not None
    }
    reads = Counter(name for op in ops for name in op.ins if name is not None)
    chains = []
    for g in grads:
        chain = _partial_chain(g, made, reads, 0, lambda name: True, lambda eqn, index: None)
        if chain is not None and not any(
            isinstance(name, Inner) and loops.intersection(name.path) for name, _ in chain
        ):
            chains.append(Chain(chain[0][0], [name for name, _ in chain[1:]], g, {}))
    return chains


def loop_ids(jaxpr: Any) -> frozenset[int]:
    """The ids of the ``while`` and ``cond`` equations in ``jaxpr`` and the calls in it."""
    found: set[int] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("while", "cond"):
            found.add(id(eqn))
        for body in compat.sub_jaxprs(eqn):
            found |= loop_ids(body)
    return frozenset(found)


def _partial_chain(
    name: Any,
    made: Mapping[Any, tuple[Any, Sequence[Any], int]],
    reads: Mapping[Any, int],
    first_reads: int,
    is_partial: Callable[[Any], bool],
    descend: Callable[[Any, int], tuple[list[tuple[Any, int]], int] | None],
    name_of: Callable[[Any], Any] = lambda name: name,
) -> list[tuple[Any, int]] | None:
    """``(name, stacked dim position)`` from a partial-sum equation's result to ``name`` (read
    ``first_reads`` times), each link read only by the next; None if there is no such chain.
    ``made`` maps a value to its equation, operands and result index; ``descend(eqn, index)``
    is the chain inside a call whose ``index``-th result is a link, and how many dims the call
    puts before the stacked one, if any."""
    chain: list[Any] = []
    while name is not None and not compat.is_literal(name) and name in made:
        if reads.get(name, 0) != (1 if chain else first_reads):
            return None
        eqn, ins, index = made[name]
        chain.append(name_of(name))
        if eqn.primitive.name in PARTIAL_SUM_PRIMITIVES and is_partial(chain[-1]):
            return [(n, 0) for n in reversed(chain)]
        inside = descend(eqn, index)
        if inside is not None:
            inner, lift = inside
            return inner + [(n, inner[-1][1] + lift) for n in reversed(chain)]
        if not _linear(eqn, ins):
            return None
        name = ins[0]
    return None


def _linear(eqn: Any, ins: Sequence[Any]) -> bool:
    """Whether ``eqn`` is a one-operand equation that may be applied to each partial sum: one
    of :data:`LINEAR_PRIMITIVES`, or a broadcast that only adds unit dims."""
    if len(ins) != 1:
        return False
    if eqn.primitive.name == "broadcast_in_dim":
        return math.prod(eqn.invars[0].aval.shape) == math.prod(eqn.outvars[0].aval.shape)
    return eqn.primitive.name in LINEAR_PRIMITIVES


def _call_chain(
    eqn: Any, index: int, path: tuple[int, ...], is_partial: Callable[[Any], bool]
) -> tuple[list[tuple[Any, int]], int] | None:
    """The chain that ends at result ``index`` of ``eqn`` inside its body, and the dims the
    equation puts before the stacked dim (a ``scan``'s stacked result: 1), for a nested
    ``jit`` or rematerialised call or a ``scan``'s stacked result; None for other equations
    and results, or if there is none."""
    loop = compat.scan_loop(eqn)
    if loop is not None:
        body = loop.body if index >= loop.num_carry else None
    elif compat.is_call(eqn) or compat.remat_body(eqn) is not None:
        body = compat.inlinable_body(eqn)
    else:
        body = None
    if body is None:
        return None
    here = (*path, id(eqn))
    made = {
        Inner(here, v): (e, [None if compat.is_literal(a) else Inner(here, a) for a in e.invars], k)
        for e in body.eqns
        for k, v in enumerate(e.outvars)
        if not compat.is_dropvar(v)
    }
    reads = Counter(Inner(here, a) for e in body.eqns for a in e.invars if not compat.is_literal(a))
    reads.update(Inner(here, v) for v in body.outvars if not compat.is_literal(v))
    out = body.outvars[index]
    if compat.is_literal(out):
        return None

    def descend(inner_eqn: Any, k: int) -> tuple[list[tuple[Any, int]], int] | None:
        return _call_chain(inner_eqn, k, here, is_partial)

    chain = _partial_chain(Inner(here, out), made, reads, 1, is_partial, descend)
    return None if chain is None else (chain, int(loop is not None))


def made_stacked(eqn: Any) -> bool:
    """Whether a stacked result of ``eqn`` is made by :func:`bind` (a partial-sum or linear
    equation), rather than by a call whose body makes it."""
    return eqn.primitive.name in PARTIAL_SUM_PRIMITIVES or _linear(eqn, eqn.invars)


def bind(eqn: Any, vals: list[Any], stacked: Stacked, out_spec: Spec, mesh: Mesh) -> Any:
    """``eqn`` applied to ``vals``, as stacked partial sums."""
    if stacked.operand_specs is None:  # a linear function of one stacked value
        return jax.vmap(lambda x: compat.bind_eqn(eqn, [x])[0], in_axes=stacked.at, out_axes=stacked.at)(
            vals[0]
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
    the driver runs it (``chains`` from :func:`gradient_chains`; ``runs``: per chain root, the
    microbatches its gradient is summed over, each op's costs being already scaled by the times
    it runs, so a root inside a ``scan`` pays one all-reduce of all its iterations). Where the
    value the accumulator adds splits over a summed axis the driver reduces each microbatch, so
    that pair of choices (the root's and that value's) gets the difference back on an edge."""
    nodes, edges = list(nodes), list(edges)
    at_edge = {(e.src, e.dst): k for k, e in enumerate(edges)}
    for chain in chains:
        root, links = chain.root, chain.links
        runs_per_step = runs.get(root, 1)
        if root not in producer or runs_per_step <= 1:
            continue
        i = producer[root][0]
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
