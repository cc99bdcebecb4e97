"""Per-stage intra-operator sharding: the ILP over one stage's equations, read back as specs.

A stage runs its equations on a logical mesh (``("data",)`` or ``("data", "model")``).
:func:`solve_stage` builds the strategy graph of every equation the stage runs (forward and
backward of its layers, per microbatch, and its share of the once-per-step update), solves
the ILP and returns one spec per value. The driver turns those specs into the ``NamedSharding``
of every task input and output on the stage and pins every equation's output with
``with_sharding_constraint``; XLA's partitioner inserts the collectives the plan implies.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from autopar._src import cluster as cluster_mod
from autopar._src import compat, deferred, layers, multihost, partial_chains
from autopar._src.collectives import Spec
from autopar._src.expansion import expand_calls
from autopar._src.ilp_merge import solve_merged
from autopar._src.layout_costs import MeshSpec
from autopar._src.plan import DATA_AXIS, Plan, StagePlan
from autopar._src.program import Program
from autopar._src.sharding_ilp import NoLayoutFitsError, total_cost, total_memory
from autopar._src.stage_problem import format_bytes
from autopar._src.stage_values import (
    alias_root,
    charged,
    data_parallel_inputs,
    held_copies,
    inputs_memory_only,
    summed,
    transfer_counts,
)
from autopar._src.strategy_graph import Follow, GraphOp, Tie, graph_of
from autopar._src.trace import TracedStep

STAGE_TIME_LIMIT = 120.0
"""Seconds HiGHS may spend on one stage. A 12-layer GPT-350M stage (7,525 nodes) solves to
optimality in about a minute on two cores and finds nothing in 30 s (the greedy fallback
then costs 1.2× the optimum)."""


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class StageSharding:
    """The ILP's answer for one stage."""

    mesh: MeshSpec
    """The logical mesh it was solved for."""
    specs: dict[Any, Spec]
    """Spec of every value the stage reads or makes (jaxpr variables)."""
    pinned: frozenset[Any]
    """Values whose spec is pinned inside the stage's executables."""
    strategies: dict[Any, str]
    """Name of the strategy chosen for the equation that makes each value, e.g. ``column[model]``."""
    objective: float
    """Predicted seconds per step of the stage's computation and communication."""
    memory_bytes: float
    """Per-device bytes of the ILP's memory row under these layouts: the stage's inputs,
    gradient sums and in-flight stashes (see :func:`solve_stage`)."""
    status: str
    """The solver's status (``optimal``, ``time_limit`` or ``fallback``)."""
    solve_seconds: float
    """Seconds spent building and solving the problem."""
    num_nodes: int
    """Nodes of the strategy graph (inputs and equations) before merging."""
    num_variables: int
    """Nodes left after forced choices were merged: the ILP's decision groups."""
    partial_sums: dict[Any, tuple[tuple[Spec, ...], tuple[str, ...]]] = dataclasses.field(
        default_factory=dict
    )
    """Values whose equation leaves partial sums that a collective finishes (see
    :mod:`autopar._src.deferred`): its operands' layouts and the mesh axes summed over."""


def mesh_spec(
    cluster: cluster_mod.ClusterSpec, stage: StagePlan, dtype: str = "float32", *, platform: str = ""
) -> MeshSpec:
    """The logical mesh of ``stage``, each axis priced by the links it spans (:func:`logical_mesh`)."""
    return logical_mesh(cluster, stage.mesh_shape, stage.axis_names, dtype, platform=platform)


def logical_mesh(
    cluster: cluster_mod.ClusterSpec,
    shape: tuple[int, ...],
    axis_names: tuple[str, ...],
    dtype: str = "float32",
    *,
    platform: str = "",
) -> MeshSpec:
    """A logical mesh of ``shape`` with each axis priced by the links it spans.

    Axes are priced by :func:`autopar._src.cluster.axis_links`. On the ``"cpu"`` platform a
    reduce-scatter is priced as the all-reduce XLA lowers it to.
    """
    links = cluster_mod.axis_links(cluster, shape)
    return MeshSpec(
        axis_names=axis_names,
        axis_sizes=shape,
        bandwidth=tuple(link.bandwidth for link in links),
        latency=tuple(link.latency for link in links),
        peak_flops=cluster.device.flops(dtype),
        memory_bandwidth=cluster.device.memory_bandwidth,
        emulated_reduce_scatter=platform == "cpu",
    )


def stage_ops(program: Program, stage: int) -> tuple[list[GraphOp], dict[Any, Any], list[Tie]]:
    """The equations ``stage`` runs, each once with how many times per step, value aliases and
    the loop carries to keep in one layout (calls and loops expanded, see :func:`expand_calls`).

    Values are jaxpr variables. An accumulator (the running sum of a gradient over
    microbatches, and its mean) has the layout of the value it sums, and a layer boundary
    marker's outputs those of its operands, so they are aliases of them. A value joined from
    its microbatches (a batch leaf, a per-example output) has a shape of its own, so a layout
    of its own: as a stage input, laid out for its readers.
    """
    count: dict[int, int] = {}
    for t in program.tasks:
        if t.stage == stage:
            for op in t.ops:
                if op.kind == "eqn":
                    count[id(op.eqn)] = count.get(id(op.eqn), 0) + 1
    alias: dict[Any, Any] = {}

    def resolve(k: Any) -> Any:
        return alias_root(alias, k[0]) if isinstance(k, tuple) else None

    ops: list[GraphOp] = []
    ties: list[Tie] = []
    seen: set[int] = set()
    for task, t in enumerate(program.tasks):
        if t.stage != stage:
            continue
        for op in t.ops:
            if op.kind == "acc":
                sources = [k for k in op.ins if isinstance(k, tuple) and k[0] is not op.out[0]]
                if op.mode == "concat":
                    continue
                if sources and resolve(sources[0]) is not op.out[0]:
                    alias[op.out[0]] = resolve(sources[0])
            elif layers.is_boundary(op.eqn):  # an identity: its outputs are its operands
                for k_in, k_out in zip(op.ins, op.outs, strict=True):
                    if isinstance(k_in, tuple) and k_out is not None and resolve(k_in) is not k_out[0]:
                        alias[k_out[0]] = resolve(k_in)
            elif id(op.eqn) not in seen:
                seen.add(id(op.eqn))
                ins = tuple(resolve(k) for k in op.ins)
                outs = tuple(None if k is None else resolve(k) for k in op.outs)
                expanded = expand_calls(GraphOp(op.eqn, ins, outs, count[id(op.eqn)]), alias, ties)
                ops += [o._replace(task=task) for o in expanded]  # the first task that runs it
    return ops, alias, ties


def solve_stage(
    program: Program,
    stage: int,
    mesh: MeshSpec,
    *,
    memory_budget: float | None = None,
    time_limit: float = STAGE_TIME_LIMIT,
    carried: dict[Any, Any] | None = None,
    fixed: dict[Any, Spec] | None = None,
    data_parallel: bool = False,
    count_held: bool = False,
    names: Mapping[Any, str] | None = None,
) -> StageSharding:
    """Solves the sharding ILP of ``stage`` on ``mesh``.

    The memory row counts the stage's inputs per device: parameters, optimizer state,
    the batch and the activations that arrive from other stages; and, with ``count_held``,
    the running sums of its gradients and, of each value a microbatch's task makes or
    receives, the most copies alive when one of its tasks starts
    (:func:`~autopar._src.stage_values.held_copies`: the batch's slices, the values its
    forwards keep for its backwards for every microbatch in flight).
    Temporaries are left to the memory model, so ``memory_budget`` should be what it leaves
    of a device (:func:`~autopar._src.planner.planned_peak`).

    ``carried`` (see :func:`carried_state`) ties the step's new state to the state it
    replaces, so that they are laid out alike. ``fixed`` gives some inputs a layout
    (e.g. a hand-written plan's parameter shardings); the ILP lays out the rest around them.
    ``data_parallel`` fixes every other input to data parallelism's layout
    (:func:`~autopar._src.stage_values.data_parallel_inputs`).
    ``names`` names inputs (parameter paths) in errors.

    Raises:
      NoLayoutFitsError: if no layout fits ``memory_budget`` (a ``ValueError``), naming the
        values that take the most memory.
      ValueError: if a ``fixed`` layout is not one the input can take on ``mesh``.
    """
    start = time.perf_counter()
    ops, alias, ties = stage_ops(program, stage)
    follow = None
    if data_parallel:
        fixed = data_parallel_inputs(program, stage, ops, alias, mesh.size(DATA_AXIS)) | (fixed or {})
        follow = Follow(DATA_AXIS, {v: 0 for v, spec in fixed.items() if spec == (DATA_AXIS,)})
    nodes, edges, producer = graph_of(ops, mesh, carried=carried, fixed=fixed, ties=ties, follow=follow)
    made = {name for op in ops for name in op.outs if name is not None}
    nodes = inputs_memory_only(nodes, producer, made)
    # Copying a value to or from another stage moves each device's block over the mesh's
    # slowest link, so values that cross stages prefer split layouts.
    per_byte = 1 / min(mesh.bandwidth)
    moved = {v: n * per_byte for v, n in transfer_counts(program, stage, alias).items()}
    nodes = charged(nodes, producer, moved, mesh, "communication_cost")
    if count_held:
        held = Counter(summed(program, stage, alias))
        held.update(held_copies(program, stage, alias))  # adds: a sum and its summands apart
        # The input nodes already count one copy of what the stage receives.
        extra = {v: w - (v not in made) for v, w in held.items()}
        nodes = charged(nodes, producer, {v: w for v, w in extra.items() if w > 0}, mesh, "memory_bytes")
    # Links as the graph names them (a call's or scan's result is an alias of a body value).
    chains = [
        c._replace(links=[alias_root(alias, v) for v in c.links])
        for c in partial_chains.every_chain(
            lambda through: partial_chains.gradient_chains(
                program.tasks, stage, lambda v: True, through_scatters=through, whole_batch=True
            )
        )
    ]
    runs = Counter(c.root for c in chains)  # one chain per microbatch's task
    nodes, edges = deferred.priced_once(nodes, edges, producer, chains, runs, mesh.axis_names)
    try:
        solution, groups = solve_merged(nodes, edges, memory_budget=memory_budget, time_limit=time_limit)
    except NoLayoutFitsError as e:
        raise NoLayoutFitsError(
            f"no layout fits memory_budget={format_bytes(e.budget)} per device: with every value on its "
            f"smallest layout it needs at least {format_bytes(e.least)}. "
            f"{_largest_values(nodes, producer, ops, made, names or {})}",
            budget=e.budget,
            least=e.least,
        ) from None
    if jax.process_count() > 1:
        # Process 0's layouts on every process: a solve stopped by its time limit may differ.
        choices = tuple(multihost.agree_ints(list(solution.choices)))
        if choices != solution.choices:
            solution = dataclasses.replace(
                solution, choices=choices, objective=total_cost(nodes, edges, choices)
            )
    specs = {
        name: nodes[i].strategies[solution.choices[i]].output_specs[k] for name, (i, k) in producer.items()
    }
    for v in alias:
        if alias_root(alias, v) in specs:
            specs[v] = specs[alias_root(alias, v)]
    strategies = {
        name: nodes[i].strategies[solution.choices[i]].name
        for name, (i, _) in producer.items()
        if name in made
    }
    partial_sums = {}
    for op in ops:
        name = op.outs[0] if len(op.outs) == 1 else None
        if name in strategies and op.eqn.primitive.name in partial_chains.PARTIAL_SUM_PRIMITIVES:
            i, _ = producer[name]
            chosen = nodes[i].strategies[solution.choices[i]]
            axes = deferred.reduced_axes(chosen.input_specs, chosen.output_specs[0], mesh.axis_names)
            if axes:
                partial_sums[name] = (chosen.input_specs, axes)
    # Every value is pinned: left to propagate between pinned matmuls, XLA picked other
    # layouts for the elementwise work in between and added collectives the plan does not
    # have (3x the planned step time on a GPT stage).
    pinned = frozenset(
        name
        for op in ops
        for name in op.outs
        if name is not None and not jax.dtypes.issubdtype(name.aval.dtype, jax.dtypes.extended)
    )
    return StageSharding(
        mesh=mesh,
        specs=specs,
        pinned=pinned,
        strategies=strategies,
        objective=solution.objective,
        memory_bytes=total_memory(nodes, solution.choices),
        status=solution.status,
        solve_seconds=time.perf_counter() - start,
        num_nodes=len(nodes),
        num_variables=groups,
        partial_sums=partial_sums,
    )


def _largest_values(
    nodes: Sequence[Any],
    producer: Mapping[Any, tuple[int, int]],
    ops: Sequence[GraphOp],
    made: set[Any],
    names: Mapping[Any, str],
) -> str:
    """Where a stage's least memory goes: its inputs and the values it makes (with the copies
    it holds for microbatches in flight), each total with its three largest."""
    least = [min(s.memory_bytes for s in n.strategies) for n in nodes]
    op_of = {producer[v][0]: op for op in ops for v in op.outs if v is not None and v in producer}
    parts: dict[str, list[tuple[float, str]]] = {"inputs": [], "values it makes": []}
    for v, (i, _) in producer.items():
        if v in made:
            continue
        name = names.get(v) or f"a value from another stage or a constant, {v.aval.str_short()}"
        parts["inputs"].append((least[i], name if v not in names else f"{name} {v.aval.str_short()}"))
    for i, op in op_of.items():
        out = next(v for v in op.outs if v is not None)
        where = compat.source_line(op.eqn)
        parts["values it makes"].append(
            (least[i], f"{op.eqn.primitive.name} {out.aval.str_short()} at {where}")
        )
    texts = []
    for kind, items in parts.items():
        items.sort(key=lambda x: -x[0])
        top = "; ".join(f"{name}: {format_bytes(b)}" for b, name in items[:3] if b > 0)
        texts.append(
            f"{kind} {format_bytes(sum(b for b, _ in items))}" + (f" (largest: {top})" if top else "")
        )
    return "Per device: " + ", ".join(texts) + "."


def carried_state(step: TracedStep) -> dict[Any, Any]:
    """Output var -> the input var it replaces at the next step.

    An output at the same pytree path as an input (e.g. ``[0].params['w']`` of
    ``step(state, batch) -> (state, loss)``), with the same shape and dtype, is the next
    value of that input. So is one at the same path below another position (``[1].params['w']``
    of ``step(state, batch) -> (loss, state)``) where exactly one input has that path below
    its own.
    """
    in_paths = step.input_paths()
    by_path = dict(zip(in_paths, step.arg_vars, strict=True))
    by_inner: dict[str, list[Any]] = {}
    for path, var in zip(in_paths, step.arg_vars, strict=True):
        if _inner(path):
            by_inner.setdefault(_inner(path), []).append(var)
    pairs = {}
    for path, out_var in zip(step.output_paths(), step.jaxpr.outvars, strict=True):
        in_var = by_path.get(path)
        if in_var is None and len(by_inner.get(_inner(path), ())) == 1:
            (in_var,) = by_inner[_inner(path)]
        if (
            in_var is not None
            and not compat.is_literal(out_var)
            and out_var is not in_var
            and out_var.aval.shape == in_var.aval.shape
            and out_var.aval.dtype == in_var.aval.dtype
        ):
            pairs[out_var] = in_var
    return pairs


def _inner(path: str) -> str:
    """A leaf's pytree path below the step's argument or output it is in (``.params['w']`` of
    ``[1].params['w']``); empty for a whole argument."""
    return path[path.index("]") + 1 :] if path.startswith("[") else path


def solve_stages(
    step: TracedStep,
    program: Program,
    plan: Plan,
    cluster: cluster_mod.ClusterSpec,
    *,
    memory_budget: float | Sequence[float] | None = None,
    time_limit: float = STAGE_TIME_LIMIT,
    platform: str = "",
    data_parallel: bool = False,
) -> list[StageSharding | None]:
    """:func:`solve_stage` for every stage of ``plan`` with more than one device (None for others);
    ``memory_budget`` is one for every stage or a sequence of one per stage.

    With ``data_parallel`` (``sharding="data"``), every stage input takes data parallelism's
    layout (:func:`~autopar._src.stage_values.data_parallel_inputs`) and the ILP lays out only
    the values the stage makes, so their gradients' partial sums are kept until the last
    microbatch (:mod:`~autopar._src.deferred`) as under any other layout.
    """
    result: list[StageSharding | None] = []
    carried = carried_state(step)
    names = dict(zip(step.arg_vars, step.input_paths(), strict=True))
    if isinstance(memory_budget, Sequence) and len(memory_budget) != plan.num_stages:
        raise ValueError(f"{len(memory_budget)} memory budgets for {plan.num_stages} stages")
    for i, st in enumerate(plan.stages):
        if len(st.device_ids) == 1:
            result.append(None)
            continue
        try:
            chosen = solve_stage(
                program,
                i,
                mesh_spec(cluster, st, platform=platform),
                memory_budget=memory_budget if not isinstance(memory_budget, Sequence) else memory_budget[i],
                time_limit=time_limit,
                carried=carried,
                data_parallel=data_parallel,
                count_held=True,
                names=names,
            )
        except NoLayoutFitsError as e:
            raise NoLayoutFitsError(
                f"{st.label(i)} has no layout: {e} More microbatches make its in-flight activations smaller.",
                budget=e.budget,
                least=e.least,
            ) from e
        result.append(chosen)
    return result
