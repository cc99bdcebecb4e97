"""Compiles a program's tasks on their submeshes and runs a step.

Each task becomes one ``jax.jit`` with explicit in/out ``NamedSharding`` on its
stage's mesh; tasks with the same structure (the same equations on the same
stage, e.g. the forward of microbatches 1..B-2) share one executable. The layouts
come from each stage's sharding ILP (:mod:`autopar._src.intra_op`), which also pins
every equation's output inside the tasks (under ``sharding="data"``, around the stage
inputs' data-parallel layouts); a one-device stage has none. Values move between
submeshes along a
:class:`~autopar._src.transfers.Route`: every ``device_put`` copies identical
per-device blocks, so no copy goes through the host and all are asynchronous.
Dispatch never waits on a device.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar._src import compat, cost, deferred, interpret, transfers
from autopar._src.intra_op import StageSharding
from autopar._src.plan import DATA_AXIS, Plan
from autopar._src.program import Key, Program, Run, Task, of_microbatch
from autopar._src.strategy_graph import Inner
from autopar._src.trace import TracedStep


def stage_meshes(plan: Plan, devices: Sequence[Any]) -> list[Mesh]:
    """The mesh of every stage of ``plan`` over ``devices``.

    Raises:
      ValueError: if the plan names a device id that is not among ``devices``.
    """
    by_id = {d.id: d for d in devices}
    meshes = []
    for i, st in enumerate(plan.stages):
        missing = [d for d in st.device_ids if d not in by_id]
        if missing:
            raise ValueError(
                f"Plan stage {i} uses device ids {missing} that are not among the available "
                f"devices {sorted(by_id)}; plan again for these devices."
            )
        grid = np.array([by_id[d] for d in st.device_ids], dtype=object).reshape(st.mesh_shape)
        meshes.append(Mesh(grid, st.axis_names))
    return meshes


def _signature(task: Task, specs_in: tuple[Any, ...], specs_out: tuple[Any, ...]) -> tuple[Any, ...]:
    canon: dict[Key, int] = {}

    def c(k: Any) -> Any:
        return canon.setdefault(k, len(canon)) if isinstance(k, tuple) else ("literal", id(k))

    ins = tuple(c(k) for k in task.in_keys)
    ops = tuple(
        (
            op.kind,
            id(op.eqn),
            op.mode,
            op.divisor,
            None if op.aval is None else str(op.aval),
            tuple(c(k) for k in op.ins),
            tuple(None if k is None else c(k) for k in op.outs),
        )
        for op in task.ops
    )
    outs = tuple(c(k) for k in task.out_keys)
    return (task.stage, ins, ops, outs, specs_in, specs_out)


@dataclasses.dataclass(eq=False)
class Executable:
    """A program compiled for concrete devices."""

    program: Program
    plan: Plan
    step: TracedStep
    meshes: list[Mesh]
    batch_leaf_ids: tuple[int, ...]
    donated_leaf_ids: tuple[int, ...] = ()
    shardings: Sequence[StageSharding | None] = ()
    """Per stage, the sharding ILP's answer (none: a one-device stage, whose values are whole)."""
    defer_reductions: bool = True
    """Keep gradients' partial sums until the last microbatch (:mod:`~autopar._src.deferred`);
    ``False`` reduces them in every microbatch's backward (for comparison)."""
    fns: list[jax.stages.Wrapped] = dataclasses.field(default_factory=list, init=False)
    donated: list[tuple[int, ...]] = dataclasses.field(default_factory=list, init=False)
    """Per task: the input positions its executable donates."""
    out_orders: list[tuple[int, ...]] = dataclasses.field(default_factory=list, init=False)
    """Per task: the positions in ``task.out_keys`` of its executable's outputs, in order."""
    num_compiled: int = dataclasses.field(default=0, init=False)

    def __post_init__(self) -> None:
        self._arg_index = {v: i for i, v in enumerate(self.step.arg_vars)}
        self._consts = dict(self.step.const_bindings)
        self._placed_consts: dict[tuple[Key, int], Any] = {}
        cache: dict[tuple[Any, ...], jax.stages.Wrapped] = {}
        # An argument the step returns unchanged is returned as the caller's array, which its
        # placed copy may share: never donated to a task.
        returned = {k[0] for k in self.program.output_keys if isinstance(k, tuple)}
        donated_vars = {self.step.arg_vars[i] for i in self.donated_leaf_ids} - returned
        made = [k for k in self.program.output_keys if isinstance(k, tuple) and k in self.program.home]
        partner = _step_aliases(self.step.arg_vars, self.donated_leaf_ids, made)
        last_read: dict[int, set[Any]] = {}
        for ins in self.program.instrs:
            if isinstance(ins, Run):
                last_read[ins.task] = {loc[0] for loc in ins.frees}
        self.deferred: list[deferred.Deferred] = [
            deferred.deferred_sums(self.program.tasks, stage, chosen.partial_sums, chosen.specs)
            if (chosen := self._stage_sharding(stage)) is not None
            and self.defer_reductions
            and self.plan.num_microbatches > 1
            else deferred.NONE
            for stage in range(len(self.meshes))
        ]
        """Per stage, the values kept as stacked partial sums."""
        inside = [
            interpret.Inside(self._inner_pins(stage), self.deferred[stage], self.meshes[stage])
            for stage in range(len(self.meshes))
        ]
        for ti, t in enumerate(self.program.tasks):
            s_in = tuple(self.spec(k, t.stage) for k in t.in_keys)
            s_out = tuple(self.spec(k, t.stage) for k in t.out_keys)
            reusable = {k for k in t.in_keys if k[0] in donated_vars and k in last_read.get(ti, ())}
            donate, order = _donation(t, reusable, s_in, s_out, partner)
            sig = (_signature(t, s_in, s_out), donate, order)
            if sig not in cache:
                mesh = self.meshes[t.stage]
                cache[sig] = jax.jit(
                    _reordered(interpret.task_fn(t, self._pins(t), inside[t.stage]), order),
                    in_shardings=tuple(NamedSharding(mesh, s) for s in s_in),
                    out_shardings=tuple(NamedSharding(mesh, s_out[j]) for j in order),
                    donate_argnums=donate,
                )
            self.fns.append(cache[sig])
            self.donated.append(donate)
            self.out_orders.append(order)
        self.num_compiled = len(cache)
        self._unstack: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self._resharder = transfers.Resharder()
        self.routes: dict[tuple[Key, int, int], transfers.Route] = {}
        """The route of every stage-to-stage transfer, by ``(key, src, dst)``."""
        self._runs = [self._compile_instr(ins) for ins in self.program.instrs]
        self._whole_inputs = [
            ((key, s), self._arg_index[key[0]], self.sharding(key, s))
            for key, stages in self.program.input_stages.items()
            if self._whole(key)
            for s in stages
        ]
        """``(location, argument leaf, sharding)`` of each argument leaf placed whole."""
        self._other_inputs = [
            (key, s)
            for key, stages in self.program.input_stages.items()
            if not self._whole(key)
            for s in stages
        ]
        """The locations of the other inputs: constants and microbatches of batch leaves."""
        home = self.program.home
        self._outputs = [
            (True, (k, home[k])) if isinstance(k, tuple) and k in home else (False, k)
            for k in self.program.output_keys
        ]
        """Per output: ``(True, location)`` of a computed value, else ``(False, key)``."""

    # -- shardings ---------------------------------------------------------------------------
    def _stage_sharding(self, stage: int) -> StageSharding | None:
        return self.shardings[stage] if stage < len(self.shardings) else None

    def _pins(self, task: Task) -> dict[Key, NamedSharding]:
        chosen = self._stage_sharding(task.stage)
        if chosen is None:
            return {}
        return {
            k: self.sharding(k, task.stage)
            for op in task.ops
            for k in op.outs
            if k is not None and op.kind == "eqn" and k[0] in chosen.pinned
        }

    def _inner_pins(self, stage: int) -> dict[Inner, NamedSharding]:
        chosen = self._stage_sharding(stage)
        if chosen is None:
            return {}
        mesh, stacked = self.meshes[stage], self.deferred[stage].values
        return {
            k: NamedSharding(
                mesh, stacked[k].spec(chosen.specs[k]) if k in stacked else PartitionSpec(*chosen.specs[k])
            )
            for k in chosen.pinned
            if isinstance(k, Inner)
        }

    def spec(self, key: Key, stage: int) -> PartitionSpec:
        """Partition spec of ``key`` on ``stage``: the ILP's, else the batch dim split over data."""
        var = key[0]
        chosen = self._stage_sharding(stage)
        if chosen is not None and var in chosen.specs:
            sums = self.deferred[stage]
            stacked = sums.accumulators.get(var) if _is_accumulator(key) else sums.values.get(var)
            return PartitionSpec(*chosen.specs[var]) if stacked is None else stacked.spec(chosen.specs[var])
        if not of_microbatch(key):
            return PartitionSpec()
        m = self.program.microbatch_size
        if cost.splits_over_batch(var.aval, m) and m % self.meshes[stage].shape[DATA_AXIS] == 0:
            return PartitionSpec(DATA_AXIS)
        return PartitionSpec()

    def sharding(self, key: Key, stage: int) -> NamedSharding:
        """``NamedSharding`` of ``key`` on ``stage``'s mesh."""
        return NamedSharding(self.meshes[stage], self.spec(key, stage))

    def abstract(self, key: Key, stage: int) -> jax.ShapeDtypeStruct:
        """Shape, dtype and sharding of ``key`` as ``stage``'s tasks hold it (a stacked running
        sum has its partial sums' dim, see :class:`~autopar._src.deferred.Stacked`)."""
        aval = key[0].aval
        stacked = self.deferred[stage].accumulators.get(key[0]) if _is_accumulator(key) else None
        shape = tuple(aval.shape) if stacked is None else stacked.shape(aval.shape, self.meshes[stage])
        return jax.ShapeDtypeStruct(
            shape, aval.dtype, sharding=self.sharding(key, stage), weak_type=aval.weak_type
        )

    def abstract_inputs(self, task_index: int) -> list[jax.ShapeDtypeStruct]:
        """:meth:`abstract` of every input of a task: what its executable is lowered for."""
        task = self.program.tasks[task_index]
        return [self.abstract(k, task.stage) for k in task.in_keys]

    # -- running -----------------------------------------------------------------------------
    def _compile_instr(self, ins: Any) -> tuple[Any, ...]:
        if isinstance(ins, Run):
            t = self.program.tasks[ins.task]
            return (
                "run",
                self.fns[ins.task],
                tuple((k, t.stage) for k in t.in_keys),
                tuple((t.out_keys[j], t.stage) for j in self.out_orders[ins.task]),
                ins.frees,
            )
        aval = ins.key[0].aval
        src, dst = self.sharding(ins.key, ins.src), self.sharding(ins.key, ins.dst)
        route = transfers.plan_route(src, dst, tuple(aval.shape), aval.dtype.itemsize)
        self.routes[(ins.key, ins.src, ins.dst)] = route
        return ("put", (ins.key, ins.src), (ins.key, ins.dst), route, ins.frees)

    def _place_inputs(self, leaves: Sequence[Any]) -> dict[tuple[Key, int], Any]:
        env: dict[tuple[Key, int], Any] = {}
        direct: list[tuple[tuple[Key, int], Any, NamedSharding]] = []
        for loc, i, target in self._whole_inputs:
            leaf = leaves[i]
            held = getattr(leaf, "sharding", None)
            if held is target or (held is not None and held == target):
                env[loc] = leaf  # already in place: the state a step returned
            elif isinstance(leaf, jax.Array) and isinstance(held, NamedSharding):
                env[loc] = transfers.place(leaf, target, self._resharder)
            else:
                direct.append((loc, leaf, target))
        for loc in self._other_inputs:
            if loc in env:  # a microbatch an earlier split placed
                continue
            (var, _), s = loc
            if var in self._consts:
                if loc not in self._placed_consts:
                    placed = transfers.put([self._consts[var]], [self.sharding(loc[0], s)])
                    self._placed_consts[loc] = placed[0]
                env[loc] = self._placed_consts[loc]
            else:
                parts = self._split(leaves[self._arg_index[var]], var, s)
                for j, part in enumerate(parts):
                    if (var, j) in self.program.input_stages and s in self.program.input_stages[(var, j)]:
                        env[((var, j), s)] = part
        if direct:
            # One batched call for everything that has to move.
            placed = transfers.put([x for _, x, _ in direct], [sh for _, _, sh in direct])
            env.update(zip([loc for loc, _, _ in direct], placed, strict=True))
        return env

    def input_shardings(self) -> list[NamedSharding | None]:
        """Per argument leaf, its sharding on the first stage that reads it whole; None for a
        leaf split into microbatches or read by no stage."""
        found: list[NamedSharding | None] = [None] * len(self.step.arg_vars)
        for _, i, target in sorted(self._whole_inputs, key=lambda t: t[0][1]):
            if found[i] is None:
                found[i] = target
        return found

    def _whole(self, key: Key) -> bool:
        """Whether input ``key`` is an argument leaf passed whole (not split into microbatches)."""
        return key[0] not in self._consts and (key[1] is None or self.plan.num_microbatches == 1)

    def _split(self, x: Any, var: Any, stage: int) -> tuple[Any, ...]:
        """Splits a batch leaf into microbatches on ``stage``'s mesh (rows stay local)."""
        nmb = self.plan.num_microbatches
        spec = self.spec((var, 0), stage)
        stacked = (np if isinstance(x, np.ndarray) else jnp).reshape(x, (nmb, -1, *x.shape[1:]))
        mesh = self.meshes[stage]
        stacked = transfers.put([stacked], [NamedSharding(mesh, PartitionSpec(None, *spec))])[0]
        sig = (stage, stacked.shape, stacked.dtype, spec)
        if sig not in self._unstack:
            self._unstack[sig] = jax.jit(
                lambda a: tuple(a[j] for j in range(nmb)),
                out_shardings=tuple(NamedSharding(mesh, spec) for _ in range(nmb)),
            )
        return self._unstack[sig](stacked)

    def __call__(self, leaves: Sequence[Any], task_times: list[float] | None = None) -> list[Any]:
        """Runs one step on the flattened arguments; returns the flattened outputs.

        With ``task_times`` (a list), every task is waited for and its seconds are
        appended, in task order (this serialises the pipeline: for profiling only).
        """
        env = self._place_inputs(leaves)
        for kind, a, b, c, frees in self._runs:
            if kind == "run":
                t0 = time.perf_counter()
                outs = a(*[env[loc] for loc in b])
                if task_times is not None:
                    jax.block_until_ready(outs)
                    task_times.append(time.perf_counter() - t0)
                for loc, x in zip(c, outs, strict=True):
                    env[loc] = x
            else:
                env[b] = self._resharder.move(env[a], c)
            for loc in frees:
                del env[loc]
        return [env[where] if made else self._output(where, leaves) for made, where in self._outputs]

    def _output(self, key: Any, leaves: Sequence[Any]) -> Any:
        """An output the step does not compute: a literal, an argument or a constant."""
        if not isinstance(key, tuple):
            return jnp.asarray(compat.literal_value(key))
        var = key[0]
        value = self._consts[var] if var in self._consts else leaves[self._arg_index[var]]
        # As jit returns them: an argument or constant passed through comes back as an array.
        return value if isinstance(value, jax.Array) else jnp.asarray(value)


def _is_accumulator(key: Key) -> bool:
    tag = key[1]
    return isinstance(tag, tuple) and tag[0] == "acc"


def _step_aliases(
    arg_vars: Sequence[Any], donated_leaf_ids: Sequence[int], output_keys: Sequence[Key]
) -> dict[Key, Any]:
    """For each output the step computes (``output_keys``, in order), the donated argument
    whose buffer ``jax.jit`` of the whole step would give it: outputs in order take the first
    unused donated argument of the same shape and dtype (so a train state's new leaves take
    their old leaves' buffers)."""
    free: dict[tuple[Any, ...], list[Any]] = {}
    for i in sorted(donated_leaf_ids):
        aval = arg_vars[i].aval
        free.setdefault((tuple(aval.shape), aval.dtype), []).append(arg_vars[i])
    partner: dict[Key, Any] = {}
    for key in output_keys:
        if key not in partner:
            waiting = free.get((tuple(key[0].aval.shape), key[0].aval.dtype))
            if waiting:
                partner[key] = waiting.pop(0)
    return partner


def _donation(
    task: Task,
    reusable: set[Key],
    specs_in: Sequence[PartitionSpec],
    specs_out: Sequence[PartitionSpec],
    partner: dict[Key, Any],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(donated input positions, output order)`` of a task's executable.

    An input may give its buffer to an output of the same shape, dtype and layout. Donated
    arguments read here for the last time (``reusable``) go first, each to its own new value
    where the task makes it (``partner``, as ``jax.jit`` of the step pairs them), then
    accumulators to their own next sums, then any output left that fits. ``jax.jit`` pairs
    each output, in order, with the first unused donated input of its shape and dtype, so the
    outputs are reordered to make it pick these pairs: paired outputs first, by their input's
    position, then the rest. A wrong pair is correct but slow: XLA copies the input first,
    since the program still reads it after the output is written.
    """

    def sig(k: Key, spec: PartitionSpec) -> tuple[Any, ...]:
        return (tuple(k[0].aval.shape), str(k[0].aval.dtype), spec)

    outs = [sig(k, spec) for k, spec in zip(task.out_keys, specs_out, strict=True)]
    free = list(range(len(outs)))
    pairs: dict[int, int] = {}
    own = [
        lambda k, o: partner.get(o) == k[0] or (_is_accumulator(k) and o[0] == k[0]),
        lambda k, o: True,
    ]
    for wanted in (lambda k: k in reusable, _is_accumulator):
        for mine in own:
            for i, (k, spec) in enumerate(zip(task.in_keys, specs_in, strict=True)):
                if i in pairs or not wanted(k):
                    continue
                j = next((j for j in free if outs[j] == sig(k, spec) and mine(k, task.out_keys[j])), None)
                if j is not None:
                    pairs[i] = j
                    free.remove(j)
    order = tuple(pairs[i] for i in sorted(pairs)) + tuple(free)
    return tuple(sorted(pairs)), order


def _reordered(fn: Callable[..., tuple[Any, ...]], order: tuple[int, ...]) -> Callable[..., tuple[Any, ...]]:
    """``fn`` returning its outputs in ``order``."""
    if order == tuple(range(len(order))):
        return fn

    def reordered(*args: Any) -> tuple[Any, ...]:
        outs = fn(*args)
        return tuple(outs[j] for j in order)

    return reordered
