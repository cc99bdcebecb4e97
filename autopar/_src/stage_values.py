"""What one stage's program moves and holds, priced into its sharding ILP.

The strategy graph (:mod:`~autopar._src.strategy_graph`) prices each equation's layouts; the
program adds what the graph cannot see: how often a value crosses to or from other stages
(communication), and how many copies of it the stage holds at once (memory): the running sums
of its gradients, and per microbatch the most copies alive when one of its tasks starts.
Values are named by their alias roots (:func:`alias_root`): an accumulator or a layer
boundary's output has the layout of the value it passes on.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

from autopar._src import cost
from autopar._src.layout_costs import MeshSpec, share_bytes
from autopar._src.plan import DATA_AXIS
from autopar._src.program import Program, Transfer, live_at_runs, of_microbatch
from autopar._src.sharding_ilp import Node
from autopar._src.strategy_graph import GraphOp


def alias_root(alias: dict[Any, Any], v: Any) -> Any:
    """The value ``v`` is an alias of (``v`` itself if none)."""
    while v in alias:
        v = alias[v]
    return v


def transfer_counts(program: Program, stage: int, alias: dict[Any, Any]) -> dict[Any, int]:
    """How many copies of each value leave or reach ``stage`` per step (the batch included)."""
    counts: dict[Any, int] = {}
    for ins in program.instrs:
        if isinstance(ins, Transfer) and stage in (ins.src, ins.dst):
            v = alias_root(alias, ins.key[0])
            counts[v] = counts.get(v, 0) + 1
    for key, stages in program.input_stages.items():  # the batch: copied in every step
        if stage in stages and of_microbatch(key):
            counts[key[0]] = counts.get(key[0], 0) + 1
    return counts


def summed(program: Program, stage: int, alias: dict[Any, Any]) -> set[Any]:
    """The values ``stage`` sums over microbatches (its gradients; each running sum has the
    layout of the value it sums)."""
    return {
        alias_root(alias, op.out[0])
        for t in program.tasks
        if t.stage == stage
        for op in t.ops
        if op.kind == "acc" and op.mode == "add"
    }


def held_copies(program: Program, stage: int, alias: dict[Any, Any]) -> Counter:
    """Value -> the most microbatches' copies of it alive on ``stage`` when one of its tasks
    starts, for the values keyed by microbatch: the batch's slices from the start of the
    step, what its tasks make from then, and what it receives from its arrival, each until
    its last use on the stage (:func:`~autopar._src.program.live_at_runs`, the walk
    :func:`~autopar._src.memory.compiled_peak` follows too). A task's results sent on at once
    are not held. Running sums, whose keys are not a microbatch's, are :func:`summed`. A task
    that joins a microbatch's forward and backward holds its :attr:`~autopar._src.program.Task.kept`
    values too, as its backward starts."""
    most: Counter = Counter()
    for run, live in live_at_runs(program, stage):
        held = (*live, *program.tasks[run.task].kept)
        copies = Counter(alias_root(alias, key[0]) for key in held if of_microbatch(key))
        for v, n in copies.items():
            most[v] = max(most[v], n)
    return most


def charged(
    nodes: tuple[Node, ...],
    producer: dict[Any, tuple[int, int]],
    weights: dict[Any, float],
    mesh: MeshSpec,
    field: str,
) -> tuple[Node, ...]:
    """Adds to ``field`` (a strategy's cost or memory) of each value's producer its bytes per
    device under that strategy times the value's weight."""
    extra: dict[int, list[float]] = {}
    for v, w in weights.items():
        if v not in producer:
            continue
        i, k = producer[v]
        per = [w * share_bytes(v, s.output_specs[k], mesh) for s in nodes[i].strategies]
        extra[i] = [a + b for a, b in zip(extra.get(i, [0.0] * len(per)), per, strict=True)]
    return tuple(
        Node(
            name=node.name,
            strategies=tuple(
                dataclasses.replace(s, **{field: getattr(s, field) + c})
                for s, c in zip(node.strategies, extra[i], strict=True)
            ),
        )
        if i in extra
        else node
        for i, node in enumerate(nodes)
    )


def inputs_memory_only(
    nodes: tuple[Node, ...], producer: dict[Any, tuple[int, int]], made: set[Any]
) -> tuple[Node, ...]:
    """``nodes`` with memory left only in the input nodes (the values no op in ``made`` makes):
    the memory row counts what a stage or layer receives, not its temporaries."""
    inputs = {producer[name][0] for name in producer if name not in made}
    return tuple(
        n
        if i in inputs
        else Node(
            name=n.name, strategies=tuple(dataclasses.replace(s, memory_bytes=0.0) for s in n.strategies)
        )
        for i, n in enumerate(nodes)
    )


def data_parallel_inputs(
    program: Program, stage: int, ops: Sequence[GraphOp], alias: dict[Any, Any], data_size: int
) -> dict[Any, tuple[str | None, ...]]:
    """Data parallelism's layouts of the inputs of ``ops`` (``stage``'s equations) on
    ``data_size`` devices: a microbatch's value whose leading dim is the microbatch's rows
    split over ``"data"`` (the runtime's rule, :func:`~autopar._src.cost.splits_over_batch`),
    everything else replicated."""
    made = {v for op in ops for v in op.outs if v is not None}
    rows = program.microbatch_size
    split = {
        alias_root(alias, k[0])
        for t in program.tasks
        if t.stage == stage
        for k in t.in_keys
        if of_microbatch(k) and cost.splits_over_batch(k[0].aval, rows) and rows % data_size == 0
    }
    return {
        v: (DATA_AXIS,) if v in split else () for op in ops for v in op.ins if v is not None and v not in made
    }
