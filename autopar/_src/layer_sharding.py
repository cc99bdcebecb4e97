"""The sharding ILP's seconds for each layer on each logical mesh: the stage DP's costs.

For every layer of the grad region (its forward and backward equations, one microbatch) and
every logical mesh ``(dp, tp)`` of every submesh the stage DP considers, the per-stage ILP
of :mod:`autopar._src.intra_op` is solved and its objective (compute, collectives and
resharding, in seconds) becomes the layer's latency there. A stage's latency is the sum over
its layers. Layers with the same equations on the same shapes (the blocks of a transformer)
share one solve, and solves are cached for the process, keyed by that structure and the mesh.

Each parameter's gradient is tied to the parameter by a resharding edge (the optimizer
updates the parameter in its own layout), so a gradient left split over the batch axis pays
the all-gather that puts the update back.

Given ``fixed`` layouts of some step arguments (a hand-written plan's parameters), the
layers are priced with those inputs pinned. Given ``memory_like`` layouts, the ILP lays out
everything freely but may keep no more bytes of each layer's inputs per device than they
would take under ``memory_like``: a plan at least as lean as the hand-written one, so that a
memory model that assumes the hand-written split stays true.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from autopar._src import cluster as cluster_mod
from autopar._src import compat, deferred, partial_chains, partition, region_outputs
from autopar._src.collectives import Spec
from autopar._src.expansion import region_ops
from autopar._src.ilp_merge import solve_merged
from autopar._src.intra_op import logical_mesh
from autopar._src.layout_costs import MeshSpec, divides, shape_of
from autopar._src.sharding_ilp import Edge, Node, total_memory
from autopar._src.stage_values import alias_root, inputs_memory_only
from autopar._src.strategy_graph import GraphOp, Inner, Tie, graph_of
from autopar._src.trace import TracedStep

AXES = ("data", "model")
LAYER_TIME_LIMIT = 10.0
"""Seconds HiGHS may spend on one layer's problem."""

_CACHE: dict[tuple[Any, ...], tuple[float, float]] = {}


class LayerProblems:
    """The grad region's layers as strategy-graph problems: ops, gradient ties, arguments."""

    def __init__(self, step: TracedStep):
        at, info, where = partition.layer_placement(step)
        rj = info.jaxpr
        all_ops, alias, ties = region_ops(rj, where, len(info.cuts) + 1)
        ops: list[list[GraphOp]] = [[] for _ in ties]
        for op in all_ops:
            ops[op.task[0]].append(op)

        def name(v: Any) -> Any:
            return None if compat.is_literal(v) or compat.is_dropvar(v) else alias_root(alias, v)

        self.ops = ops
        """Per layer, its forward and backward equations (boundary markers are identities)."""
        self.ties = ties
        """Per layer, its loops' carries (see :func:`~autopar._src.expansion.expand_calls`)."""
        region_inputs = [*rj.constvars, *rj.invars]
        diff = region_inputs[len(region_inputs) - info.num_grads :]
        grads = [name(v) for v in rj.outvars[len(rj.outvars) - info.num_grads :]]
        self.carried = {g: p for g, p in zip(grads, diff, strict=True) if g is not None and g != p}
        """Each gradient (or value of a gradient summed across layers) -> the parameter it updates."""
        # The values of a gradient that several layers add up (a tied weight's) are summed apart
        # over the microbatches at run time (region_outputs.split_sums): each is a gradient here.
        made_in = {v: w for e, w in zip(rj.eqns, where, strict=True) for v in e.outvars}
        outs = list(zip(rj.outvars[len(rj.outvars) - info.num_grads :], diff, strict=True))
        for split in region_outputs.split_sums(rj, outs, made_in).values():
            for values, _ in split.parts:
                self.carried.update((name(v), split.output) for v in values if name(v) is not None)
        self.loops = partial_chains.loop_ids(rj)
        """The ids of the loops and branches in the grad region (see
        :func:`~autopar._src.partial_chains.graph_chains`)."""
        arg_index = {v: i for i, v in enumerate(step.arg_vars)}
        self.region_arg = {
            r: arg_index[v]
            for r, v in zip(region_inputs, step.jaxpr.eqns[at].invars, strict=True)
            if not compat.is_literal(v) and v in arg_index
        }
        """Region input -> the index of the step argument it is."""
        self.in_loops = [
            tuple(
                k
                for k, op in enumerate(layer_ops)
                if any(isinstance(n, Inner) and self.loops.intersection(n.path) for n in op.outs)
            )
            for layer_ops in ops
        ]
        """Per layer, the indices of its ops inside :attr:`loops`' bodies (their gradients are
        priced as reduced each microbatch, so two layers alike but for these are priced apart)."""

    def fixed(self, layouts: Mapping[int, Spec] | None, mesh: MeshSpec) -> dict[Any, Spec]:
        """Region input -> layout on ``mesh`` of the arguments ``layouts`` gives, each axis kept
        only on a dim it divides."""
        if not layouts:
            return {}
        result: dict[Any, Spec] = {}
        for r, i in self.region_arg.items():
            if i in layouts:
                shape = shape_of(r)
                result[r] = tuple(
                    a if a is not None and d < len(shape) and divides(shape, d, a, mesh) else None
                    for d, a in enumerate(layouts[i])
                )
        return result


def _signature(
    ops: Sequence[GraphOp],
    fixed: Mapping[Any, Spec] | None = None,
    carried: Mapping[Any, Any] | None = None,
    ties: Sequence[Tie] = (),
) -> tuple[Any, ...]:
    """The structure of a layer: its equations' primitives, params and avals, how they connect,
    the layouts ``fixed`` gives its inputs and which of its values are gradients of which."""
    index: dict[Any, int] = {}

    def ref(n: Any) -> Any:
        return None if n is None else index.setdefault(n, len(index))

    structure = tuple(
        (
            op.eqn.primitive.name,
            str(sorted((k, str(v)) for k, v in op.eqn.params.items() if not compat.sub_jaxprs(op.eqn))),
            tuple(str(v.aval) for v in op.eqn.invars),
            tuple(str(v.aval) for v in op.eqn.outvars),
            tuple(ref(n) for n in op.ins),
            tuple(ref(n) for n in op.outs),
        )
        for op in ops
    )
    pins = tuple(sorted((index[n], spec) for n, spec in (fixed or {}).items() if n in index))
    grads = tuple(
        sorted((index[g], index[p]) for g, p in (carried or {}).items() if g in index and p in index)
    )
    loops = tuple((ref(t.out), ref(t.into), t.weight) for t in ties)
    return structure, pins, grads, loops


Gradients = Literal["autopar", "megatron"]
"""Which gradient collectives a layer's price pays once per step rather than per microbatch."""


def gradient_tail(ops: Sequence[GraphOp], grads: Sequence[Any]) -> set[int]:
    """Indices of the ops that finish the gradients ``grads``: walking back from each gradient
    through inputs as large as the op's output (casts, transposes, sums of contributions) to
    the op that reduces a larger value into it (the weight-gradient matmul, the bias sum).

    With gradients accumulated over microbatches, these ops' collectives (the all-reduce over
    the batch axis) run once per step, not once per microbatch.
    """
    made_by = {name: j for j, op in enumerate(ops) for name in op.outs if name is not None}
    tail: set[int] = set()
    stack = [made_by[g] for g in grads if g in made_by]
    while stack:
        j = stack.pop()
        if j in tail:
            continue
        tail.add(j)
        op = ops[j]
        size = max(math.prod(shape_of(v)) for v in op.eqn.outvars)
        stack += [
            made_by[name]
            for name, v in zip(op.ins, op.eqn.invars, strict=True)
            if name in made_by and math.prod(shape_of(v)) == size
        ]
    return tail


def cache_key(
    problems: LayerProblems,
    layer: int,
    pinned: Mapping[Any, Spec],
    mesh: MeshSpec,
    microbatches: int,
    gradients: Gradients,
) -> tuple[Any, ...]:
    """The key of ``layer``'s solve in the process cache: layers alike share it."""
    ops, ties = problems.ops[layer], problems.ties[layer]
    signature = _signature(ops, pinned, problems.carried, ties)
    return (signature, problems.in_loops[layer], mesh, microbatches, gradients)


def _solve(
    problems: LayerProblems,
    layer: int,
    mesh: MeshSpec,
    fixed: Mapping[Any, Spec],
    memory_budget: float | None,
    time_limit: float,
    microbatches: int,
    gradients: Gradients,
) -> tuple[float, float]:
    """``(seconds, bytes of the layer's inputs per device)`` of the layer's best sharding."""
    ops, carried = problems.ops[layer], problems.carried
    nodes, edges, producer = graph_of(ops, mesh, carried=carried, fixed=fixed, ties=problems.ties[layer])
    nodes = inputs_memory_only(nodes, producer, {name for op in ops for name in op.outs if name is not None})

    def find(through: bool) -> list[partial_chains.Chain]:
        return partial_chains.graph_chains(ops, carried, problems.loops, through_scatters=through)

    chains = partial_chains.every_chain(find)
    # The gradients' collectives share one latency; Megatron's accounting then spreads its
    # gradients' tails over the step (below), autopar's sums wait for the last microbatch.
    per_step = 1 if gradients == "megatron" else microbatches
    runs = {chain.root: per_step for chain in chains}
    nodes, edges = deferred.priced_once(nodes, edges, producer, chains, runs, mesh.axis_names)
    if microbatches > 1 and gradients == "megatron":
        nodes, edges = _once_per_step(ops, nodes, edges, producer, carried, microbatches)
    solution = solve_merged(nodes, edges, memory_budget=memory_budget, time_limit=time_limit)[0]
    return solution.objective, total_memory(nodes, solution.choices)


def _once_per_step(
    ops: Sequence[GraphOp],
    nodes: tuple[Node, ...],
    edges: tuple[Edge, ...],
    producer: Mapping[Any, tuple[int, int]],
    carried: Mapping[Any, Any],
    microbatches: int,
) -> tuple[tuple[Node, ...], tuple[Edge, ...]]:
    """Per-microbatch costs with the gradients' collectives and their resharding into the
    parameters' layouts spread over the step's ``microbatches``."""
    tail = {
        producer[name][0]
        for j in gradient_tail(ops, list(carried))
        for name in ops[j].outs
        if name is not None
    }
    params = {producer[p][0] for g, p in carried.items() if g in producer and p in producer}
    nodes = tuple(
        Node(
            name=n.name,
            strategies=tuple(
                dataclasses.replace(s, communication_cost=s.communication_cost / microbatches)
                for s in n.strategies
            ),
        )
        if i in tail
        else n
        for i, n in enumerate(nodes)
    )
    once = tail | params
    edges = tuple(
        Edge(src=e.src, dst=e.dst, cost=e.cost / microbatches)
        if e.src in once and e.dst in once and (e.src in tail or e.dst in tail)
        else e
        for e in edges
    )
    return nodes, edges


def layer_latency(
    step: TracedStep,
    spec: cluster_mod.ClusterSpec,
    submeshes: Sequence[tuple[int, int]],
    logical: Sequence[Sequence[tuple[int, int]]],
    *,
    dtype: str = "float32",
    time_limit: float = LAYER_TIME_LIMIT,
    platform: str = "",
    fixed: Mapping[int, Spec] | None = None,
    memory_like: Mapping[int, Spec] | None = None,
    microbatches: int = 1,
    gradients: Gradients = "autopar",
) -> np.ndarray:
    """Seconds of one microbatch's forward and backward of each layer, ``[layer, submesh, logical]``.

    ``fixed`` and ``memory_like`` map step argument indices (``step.arg_vars``) to layouts
    over the axes ``("data", "model")``; an axis that does not divide a dim is dropped from
    it. ``fixed`` pins those arguments' layouts. ``memory_like`` bounds each layer's input
    bytes per device by what they take when those arguments are pinned (the layouts
    themselves stay free). With ``microbatches`` > 1 the step traced one microbatch of that
    many, and some gradient collectives are paid once per step: with ``gradients="autopar"``
    the all-reduces of partial sums that autopar's driver defers to the last microbatch
    (:func:`~autopar._src.deferred.priced_once`); with ``"megatron"`` every collective that
    finishes a gradient and its resharding into the parameter's layout (:func:`gradient_tail`),
    as Megatron-LM, which accumulates before it reduces, pays them.
    Entries for logical meshes a submesh does not have are ``inf``.

    Raises:
      ValueError: if both ``fixed`` and ``memory_like`` are given.
    """
    if fixed and memory_like:
        raise ValueError("give fixed (pinned layouts) or memory_like (a memory bound), not both")
    problems = LayerProblems(step)
    q_max = max(len(q) for q in logical)
    result = np.full((len(problems.ops), len(submeshes), q_max), np.inf)
    for k, shapes in enumerate(logical):
        for q, shape in enumerate(shapes):
            mesh = logical_mesh(spec, tuple(shape), AXES, dtype, platform=platform)
            pinned = problems.fixed(fixed or memory_like, mesh)
            for i in range(len(problems.ops)):
                key = cache_key(problems, i, pinned, mesh, microbatches, gradients)
                if key not in _CACHE:
                    _CACHE[key] = _solve(problems, i, mesh, pinned, None, time_limit, microbatches, gradients)
                seconds, memory = _CACHE[key]
                if memory_like:
                    free_key = (key, "memory_like")
                    if free_key not in _CACHE:
                        budget = memory * (1 + 1e-9)
                        free = _solve(problems, i, mesh, {}, budget, time_limit, microbatches, gradients)
                        # The pinned layouts are one of the free problem's answers: a time-limited
                        # solve that found worse keeps them.
                        _CACHE[free_key] = min(free, (seconds, memory))
                    seconds = _CACHE[free_key][0]
                result[i, k, q] = seconds
    return result
