"""The strategy graph of a sequence of equations, for the intra-op ILP.

:func:`graph_of` turns equations over named values into the
:class:`~autopar._src.sharding_ilp.Node` / :class:`~autopar._src.sharding_ilp.Edge` problem
that :func:`~autopar._src.sharding_ilp.solve` answers: one node per input and per equation
(its candidate strategies from :func:`~autopar._src.strategies.eqn_strategies`), one edge per
producer-consumer pair priced by resharding. :func:`build_graph` does this for a jaxpr and
:func:`specs_of` reads an answer back as one spec per variable.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from autopar._src import compat, cost, fusion
from autopar._src.collectives import Spec, entry_axes, resharding_cost
from autopar._src.layout_costs import MeshSpec, all_specs, shape_of, share_bytes, spec_name
from autopar._src.sharding_ilp import Edge, Node, Strategy
from autopar._src.strategies import eqn_strategies


def _input_strategies(v: Any, mesh: MeshSpec) -> tuple[Strategy, ...]:
    return tuple(
        Strategy(
            name=spec_name(spec),
            compute_cost=0.0,
            communication_cost=0.0,
            memory_bytes=share_bytes(v, spec, mesh),
            output_specs=(spec,),
            input_specs=(),
        )
        for spec in all_specs(shape_of(v), mesh)
    )


def _inputs(jaxpr: Any) -> tuple[Any, list[Any]]:
    body, _ = compat.jaxpr_and_consts(jaxpr)
    return body, [*body.constvars, *body.invars]


class GraphOp(NamedTuple):
    """One equation as the strategy graph sees it: which values it reads and makes."""

    eqn: Any
    """The jaxpr equation (its primitive, params and avals give the strategies)."""
    ins: tuple[Any, ...]
    """Per invar, the value read (a hashable name), or None for a literal."""
    outs: tuple[Any, ...]
    """Per outvar, the value made, or None for a dropped output."""
    weight: int = 1
    """How many times the equation runs per step (its costs are multiplied by this)."""
    task: Any = None
    """The task (executable) the equation runs in; a value another task reads is written to
    memory (see :mod:`autopar._src.fusion`)."""


class Inner(NamedTuple):
    """A value made inside the body of a nested call (see :func:`autopar._src.expansion.expand_calls`)."""

    path: tuple[int, ...]
    """The ids of the call equations around it, outermost first."""
    var: Any
    """The body's variable."""

    @property
    def aval(self) -> Any:
        return self.var.aval


class Follow(NamedTuple):
    """Data parallelism inside a strategy graph: values split over ``axis`` along a dim (the
    batch's), kept so by every equation that can read them so (see :func:`graph_of`)."""

    axis: str
    """The mesh axis the batch is split over."""
    dims: Mapping[Any, int]
    """The inputs split over ``axis``, and the dim of each."""


class Tie(NamedTuple):
    """Two values that should share a layout: a loop's carry out and the carry it starts from."""

    out: Any
    into: Any
    weight: int
    """How many times a resharding between them would run per step."""


def graph_of(
    ops: Sequence[GraphOp],
    mesh: MeshSpec,
    inputs: Sequence[Any] = (),
    carried: Mapping[Any, Any] | None = None,
    fixed: Mapping[Any, Spec] | None = None,
    ties: Sequence[Tie] = (),
    follow: Follow | None = None,
) -> tuple[tuple[Node, ...], tuple[Edge, ...], dict[Any, tuple[int, int]]]:
    """The strategy graph of a sequence of equations over named values.

    ``inputs`` get nodes first (strategies replicated or split over each axis on each dim it
    divides, memory their bytes per device); a value read before any op made it gets an input
    node at its first read. Then one node per op (``eqn{j}:{primitive}``). An edge joins a
    producer and a consumer of a value; its cost is the resharding seconds from the producer
    strategy's output spec to the spec the consumer strategy needs (summed when a consumer
    reads several values of one producer), times the consumer's weight. ``carried`` maps a
    value to the input it becomes at the next step (the new parameters to the parameters):
    an edge between their nodes prices resharding one into the other once per step.
    ``fixed`` gives some inputs their only layout (trailing dims may be left out). Each of
    ``ties`` (loop carries, from :func:`autopar._src.expansion.expand_calls`) adds such an
    edge with its weight. With ``follow``, an op that reads a value split over its axis keeps
    only the strategies that read it so (where it has any), and a value every one of them
    makes split over that axis is followed in turn: the batch stays split through the work
    that can keep it, and the gradients it contracts are partial sums.

    Raises:
      ValueError: if a ``fixed`` layout is not one the input can take on ``mesh``.

    Returns:
      ``(nodes, edges, producer)``; ``producer`` maps each value to ``(node, output index)``.
    """
    nodes: list[Node] = []
    producer: dict[Any, tuple[int, int]] = {}

    def add_input(name: Any, var: Any) -> None:
        strategies = _input_strategies(var, mesh)
        if fixed is not None and name in fixed:
            given = tuple(a if a is not None and mesh.size(a) > 1 else None for a in fixed[name])
            want = given + (None,) * (len(shape_of(var)) - len(given))
            strategies = tuple(s for s in strategies if s.output_specs[0] == want)
            if not strategies:
                raise ValueError(
                    f"fixed layout {want} of an input of shape {shape_of(var)} is not one it can take on "
                    f"mesh {dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))}"
                )
        producer[name] = (len(nodes), 0)
        nodes.append(Node(name=f"input{len(nodes)}", strategies=strategies))

    for name in inputs:
        add_input(name, name)
    split = dict(follow.dims) if follow is not None else {}
    costs: dict[tuple[int, int], np.ndarray] = {}
    cache: dict[tuple[Any, ...], float] = {}
    link = [
        dict(zip(mesh.axis_names, x, strict=True)) for x in (mesh.axis_sizes, mesh.bandwidth, mesh.latency)
    ]

    def reshard(*key: Any) -> float:  # (src spec, dst spec, shape, itemsize); many edges repeat them
        if key not in cache:
            cache[key] = resharding_cost(*key, *link)
        return cache[key]

    for j, (op, written) in enumerate(zip(ops, fusion.written_outputs(ops), strict=True)):
        for name, v in zip(op.ins, op.eqn.invars, strict=True):
            if name is not None and name not in producer:
                add_input(name, v)
        dst = len(nodes)
        strategies = eqn_strategies(op.eqn, mesh)
        if follow is not None:
            strategies = _following(strategies, op, split, follow.axis)
        if any(written):
            strategies = tuple(_with_traffic(s, op.eqn.outvars, written, mesh) for s in strategies)
        if op.weight != 1:
            strategies = tuple(_scaled(s, op.weight) for s in strategies)
        node = Node(name=f"eqn{j}:{op.eqn.primitive.name}", strategies=strategies)
        for k, (name, v) in enumerate(zip(op.ins, op.eqn.invars, strict=True)):
            if name is None:
                continue
            src, out_index = producer[name]
            shape, itemsize = shape_of(v), cost.aval_bytes(v.aval) // max(math.prod(shape_of(v)), 1)
            matrix = op.weight * np.array(
                [
                    [
                        reshard(s.output_specs[out_index], t.input_specs[k], shape, itemsize)
                        for t in node.strategies
                    ]
                    for s in nodes[src].strategies
                ]
            )
            costs[(src, dst)] = costs[(src, dst)] + matrix if (src, dst) in costs else matrix
        for k, name in enumerate(op.outs):
            if name is not None:
                producer[name] = (dst, k)
        nodes.append(node)
    pairs = [Tie(out, into, 1) for out, into in (carried or {}).items()] + list(ties)
    for out_name, in_name, weight in pairs:
        if out_name not in producer or in_name not in producer:
            continue
        (src, k), (dst, k_in) = producer[out_name], producer[in_name]
        if src == dst:
            continue
        shape = shape_of(in_name)
        itemsize = cost.aval_bytes(in_name.aval) // max(math.prod(shape), 1)
        matrix = weight * np.array(
            [
                [
                    reshard(s.output_specs[k], t.output_specs[k_in], shape, itemsize)
                    for t in nodes[dst].strategies
                ]
                for s in nodes[src].strategies
            ]
        )
        a, b = min(src, dst), max(src, dst)
        matrix = matrix if src < dst else matrix.T
        costs[(a, b)] = costs[(a, b)] + matrix if (a, b) in costs else matrix
    edges = tuple(Edge(src=src, dst=dst, cost=m) for (src, dst), m in costs.items())
    return tuple(nodes), edges, producer


def _following(
    strategies: tuple[Strategy, ...], op: GraphOp, split: dict[Any, int], axis: str
) -> tuple[Strategy, ...]:
    """The strategies of ``op`` that read every value of ``split`` (value -> dim) split over
    ``axis`` at that dim (all of them if none does); adds to ``split`` the outputs they all
    make split over ``axis`` at one dim."""
    read = [(k, split[name]) for k, name in enumerate(op.ins) if name is not None and name in split]
    if not read:
        return strategies
    keep = tuple(s for s in strategies if all(_dim_of(s.input_specs[k], axis) == d for k, d in read))
    if not keep:
        return strategies
    for j, name in enumerate(op.outs):
        dims = {_dim_of(s.output_specs[j], axis) for s in keep}
        (dim,) = dims if len(dims) == 1 else (None,)
        if name is not None and dim is not None:
            split[name] = dim
    return keep


def _dim_of(spec: Spec, axis: str) -> int | None:
    """The dim that ``spec`` splits over ``axis``, if any."""
    return next((d for d, entry in enumerate(spec) if axis in entry_axes(entry)), None)


def _with_traffic(s: Strategy, outvars: Sequence[Any], written: Sequence[bool], mesh: MeshSpec) -> Strategy:
    """``s`` charged the memory traffic of the outputs it writes, as they are laid out."""
    moved = sum(
        share_bytes(v, spec, mesh) for v, spec, w in zip(outvars, s.output_specs, written, strict=True) if w
    )
    return dataclasses.replace(
        s, compute_cost=s.compute_cost + fusion.TRAFFIC_PER_WRITE * moved / mesh.memory_bandwidth
    )


def _scaled(s: Strategy, weight: int) -> Strategy:
    return Strategy(
        name=s.name,
        compute_cost=s.compute_cost * weight,
        communication_cost=s.communication_cost * weight,
        latency_cost=s.latency_cost * weight,
        memory_bytes=s.memory_bytes,
        output_specs=s.output_specs,
        input_specs=s.input_specs,
    )


def build_graph(
    jaxpr: Any, mesh: MeshSpec
) -> tuple[tuple[Node, ...], tuple[Edge, ...], dict[Any, tuple[Spec, ...]]]:
    """The strategy graph of a jaxpr for :func:`~autopar._src.sharding_ilp.solve`.

    Nodes come in order: one per jaxpr input (constvars, then invars; named ``input{k}``),
    then one per equation (``eqn{j}:{primitive}``); see :func:`graph_of`. Literals get no
    node and no edge.

    Args:
      jaxpr: a ``ClosedJaxpr`` (as from ``jax.make_jaxpr``) or an open ``Jaxpr``.
      mesh: the logical mesh.

    Returns:
      ``(nodes, edges, var_specs)``; ``var_specs`` maps each variable to its spec under each
      strategy of its producing node, in that node's strategy order.
    """
    body, inputs = _inputs(jaxpr)

    def name(v: Any) -> Any:
        return None if compat.is_literal(v) or compat.is_dropvar(v) else v

    ops = [GraphOp(e, tuple(map(name, e.invars)), tuple(map(name, e.outvars))) for e in body.eqns]
    nodes, edges, producer = graph_of(ops, mesh, inputs)
    var_specs = {v: tuple(s.output_specs[k] for s in nodes[i].strategies) for v, (i, k) in producer.items()}
    return nodes, edges, var_specs


def specs_of(solution_choices: Sequence[int], nodes: Sequence[Node], jaxpr: Any) -> dict[Any, Spec]:
    """The chosen spec of every variable of ``jaxpr`` (inputs and equation outputs).

    Args:
      solution_choices: the chosen strategy index per node, e.g. ``solve(...).choices``.
      nodes: the nodes :func:`build_graph` made for this ``jaxpr``.
      jaxpr: the same jaxpr.

    Raises:
      ValueError: if the nodes or choices do not match the jaxpr.
    """
    body, inputs = _inputs(jaxpr)
    if not len(nodes) == len(solution_choices) == len(inputs) + len(body.eqns):
        raise ValueError(
            f"got {len(solution_choices)} choices and {len(nodes)} nodes for a jaxpr with "
            f"{len(inputs)} inputs and {len(body.eqns)} equations; pass build_graph's nodes for this jaxpr"
        )
    specs: dict[Any, Spec] = {}
    producers = [[v] for v in inputs] + [list(e.outvars) for e in body.eqns]
    for node, choice, outvars in zip(nodes, solution_choices, producers, strict=True):
        if not 0 <= choice < len(node.strategies):
            raise ValueError(
                f"choice {choice} for node {node.name!r} is outside its {len(node.strategies)} strategies"
            )
        for v, spec in zip(outvars, node.strategies[choice].output_specs, strict=True):
            if not compat.is_dropvar(v):
                specs[v] = spec
    return specs
