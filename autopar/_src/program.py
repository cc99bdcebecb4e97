"""The program a plan compiles to: tasks of ops on stages, and the instructions that run them.

:func:`autopar._src.partition.build_program` makes a :class:`Program` (its tasks fused by
:func:`fuse_adjacent`, wired with transfers and frees by :func:`wire`); the driver runs it, the
memory model and the measured costs read it. Nothing here knows about devices.

Values are named by *keys* ``(var, tag)``: tag ``None`` for once-per-step
values, ``j`` for microbatch ``j``, ``("acc", j)`` for the running sum of a
region output after microbatch ``j``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

Key = tuple[Any, Any]
Location = tuple[Key, int]


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
    """One equation (or one accumulation step) with concrete keys."""

    kind: Literal["eqn", "acc"]
    ins: tuple[Any, ...]
    """Input keys, or jaxpr literals."""
    outs: tuple[Key | None, ...]
    """Output keys (None for a dropped output)."""
    eqn: Any = None
    mode: Literal["", "zeros", "add", "sum", "copy", "mean", "concat", "fold", "index"] = ""
    """For ``acc``: make a zero sum, add to it (one or more values), add up once-per-step
    values, pass a value on, divide the sum, join the microbatches' values of a per-example
    output, make each microbatch's PRNG key, or make each microbatch's index."""
    divisor: float = 1
    """For ``acc`` in mode ``mean``: what the value is divided by: the number of microbatches to
    average over (1 for a gradient, whose microbatches' values add up to it), or the factor
    that makes a statistic of the whole batch one microbatch's share
    (:mod:`~autopar._src.batch_statistics`)."""
    axis: int = 0
    """For ``acc`` in mode ``concat``: the batch dim to join along."""
    key_impl: str = ""
    """For ``acc`` in mode ``fold`` of raw key data: its PRNG implementation's name."""
    aval: Any = None
    """For ``acc`` in mode ``zeros``: shape and dtype of the sum."""

    @property
    def out(self) -> Key:
        """The first output's key, which an ``acc`` op never drops."""
        key = self.outs[0]
        assert key is not None, f"op {self.kind}/{self.mode} dropped its first output"
        return key


@dataclasses.dataclass(eq=False)
class Task:
    """A group of ops that runs as one executable on one stage."""

    stage: int
    label: str
    ops: list[Op]
    repeated: bool
    """Whether the task runs once per microbatch (sharing one executable)."""
    in_keys: tuple[Key, ...] = ()
    out_keys: tuple[Key, ...] = ()
    kept: tuple[Key, ...] = ()
    """For a task that joins a microbatch's forward and backward: what the forward keeps for
    the backward inside the executable (:func:`~autopar._src.fusion.split_residuals`), alive
    as a stash would be between two tasks."""


@dataclasses.dataclass(frozen=True)
class Run:
    """Run task ``task`` reading ``in_locs`` and writing ``out_locs``."""

    task: int
    frees: tuple[Location, ...] = ()


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Copy ``key`` from stage ``src`` to stage ``dst``."""

    key: Key
    src: int
    dst: int
    frees: tuple[Location, ...] = ()


@dataclasses.dataclass(eq=False)
class Program:
    """Everything the driver needs, independent of devices."""

    tasks: list[Task]
    instrs: list[Run | Transfer]
    input_stages: dict[Key, tuple[int, ...]]
    """For each input key (an argument leaf or constant, per microbatch for the
    batch), the stages it is placed on at the start of a step."""
    output_keys: tuple[Any, ...]
    """For each output leaf: a key, or a literal."""
    home: dict[Key, int]
    """Stage where each produced key is made."""
    per_microbatch: frozenset[Any]
    """Vars that hold one value per microbatch."""
    microbatch_size: int
    """Rows of the batch per microbatch."""


def of_microbatch(key: Key) -> bool:
    """Whether ``key`` names one microbatch's value (its tag is the microbatch index)."""
    return isinstance(key[1], int) and not isinstance(key[1], bool)


def live_at_runs(program: Program, stage: int) -> Iterator[tuple[Run, tuple[Key, ...]]]:
    """Each run of a task on ``stage``, in the order the driver runs them, with the keys alive
    on the stage's devices as it starts: the inputs placed at the start of the step, what the
    stage's tasks make and what it receives, each until the instruction that frees it there."""
    live = dict.fromkeys(k for k, stages in program.input_stages.items() if stage in stages)
    for ins in program.instrs:
        if isinstance(ins, Run) and program.tasks[ins.task].stage == stage:
            yield ins, tuple(live)
            live.update(dict.fromkeys(program.tasks[ins.task].out_keys))
        elif isinstance(ins, Transfer) and ins.dst == stage:
            live[ins.key] = None
        for key, where in ins.frees:
            if where == stage:
                live.pop(key, None)


def fuse_adjacent(tasks: list[Task]) -> list[Task]:
    """Merges neighbouring tasks of one stage into one executable.

    Repeated tasks (one per microbatch, sharing an executable) are not fused:
    fusing them would give each microbatch an executable of its own to compile.
    """
    fused: list[Task] = []
    for t in tasks:
        prev = fused[-1] if fused else None
        if prev is not None and prev.stage == t.stage and not (prev.repeated or t.repeated):
            fused[-1] = Task(
                stage=t.stage,
                label=f"{prev.label}+{t.label}",
                ops=prev.ops + t.ops,
                repeated=False,
                kept=prev.kept + t.kept,
            )
        else:
            fused.append(t)
    return fused


def wire(tasks: list[Task], output_keys: tuple[Any, ...], per_mb: set[Any], mb_size: int) -> Program:
    """Finds each task's inputs and outputs, and adds transfers and frees."""
    home: dict[Key, int] = {}
    produced_in: dict[Key, int] = {}
    readers: dict[Key, list[int]] = {}
    for ti, t in enumerate(tasks):
        made: set[Key] = set()
        ins: list[Key] = []
        for op in t.ops:
            for k in op.ins:
                if isinstance(k, tuple) and k not in made and k not in ins:
                    ins.append(k)
            for k in op.outs:
                if k is not None:
                    made.add(k)
                    produced_in[k] = ti
                    home[k] = t.stage
        t.in_keys = tuple(ins)
        for k in ins:
            readers.setdefault(k, []).append(ti)
    wanted = {k for k in output_keys if isinstance(k, tuple)}
    for ti, t in enumerate(tasks):
        outs = []
        for op in t.ops:
            for k in op.outs:
                if k is not None and produced_in[k] == ti and (k in wanted or readers.get(k)):
                    if k not in outs:
                        outs.append(k)
        t.out_keys = tuple(outs)

    input_stages: dict[Key, list[int]] = {}
    instrs: list[Run | Transfer] = []
    for ti, t in enumerate(tasks):
        for k in t.in_keys:
            if k not in home and t.stage not in input_stages.setdefault(k, []):
                input_stages[k].append(t.stage)
        instrs.append(Run(task=ti))
        for k in t.out_keys:
            sent: list[int] = []
            for r in readers.get(k, []):
                dst = tasks[r].stage
                if dst != t.stage and dst not in sent:
                    sent.append(dst)
                    instrs.append(Transfer(key=k, src=t.stage, dst=dst))

    # Frees: after the last instruction that reads each (key, stage) location.
    last_use: dict[Location, int] = {}
    for n, instr in enumerate(instrs):
        if isinstance(instr, Run):
            t = tasks[instr.task]
            for k in t.in_keys:
                last_use[(k, t.stage)] = n
        else:
            last_use[(instr.key, instr.src)] = n
    keep = {(k, home[k]) for k in wanted if k in home}
    frees: dict[int, list[Location]] = {}
    for loc, n in last_use.items():
        if loc not in keep:
            frees.setdefault(n, []).append(loc)
    instrs = [dataclasses.replace(ins, frees=tuple(frees.get(n, ()))) for n, ins in enumerate(instrs)]
    return Program(
        tasks=tasks,
        instrs=instrs,
        input_stages={k: tuple(v) for k, v in input_stages.items()},
        output_keys=output_keys,
        home=home,
        per_microbatch=frozenset(per_mb),
        microbatch_size=mb_size,
    )
