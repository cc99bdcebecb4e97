"""The program a plan compiles to: tasks of ops on stages, and the instructions that run them.

:func:`autopar._src.partition.build_program` makes a :class:`Program`; the driver runs it,
the memory model and the measured costs read it. Nothing here knows about devices.

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
    mode: Literal["", "zeros", "add", "sum", "copy", "mean", "concat", "fold"] = ""
    """For ``acc``: make a zero sum, add to it (one or more values), add up once-per-step
    values, pass a value on, divide the sum, join the microbatches' values of a per-example
    output, or make each microbatch's PRNG key."""
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
