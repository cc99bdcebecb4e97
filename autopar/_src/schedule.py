"""Pipeline schedules as data: per-stage task lists and one dispatch order.

A schedule is, for every stage, the order in which it runs its forward (``F``)
and backward (``B``) tasks over microbatches. New schedules are new task lists;
the driver only follows the dispatch order these functions produce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

ScheduleName = Literal["gpipe", "1f1b"]
Pass = Literal["F", "B"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True, kw_only=True, order=True)
class PipeTask:
    """One (stage, microbatch, pass) of a pipeline schedule."""

    stage: int
    """Pipeline stage that runs the task."""
    microbatch: int
    """Microbatch index."""
    pass_: Pass
    """``F`` (forward) or ``B`` (backward)."""

    def __str__(self) -> str:
        return f"{self.pass_}{self.stage}.{self.microbatch}"


def gpipe(num_stages: int, num_microbatches: int) -> tuple[tuple[PipeTask, ...], ...]:
    """GPipe: every stage runs all forwards, then all backwards."""
    _check(num_stages, num_microbatches)
    return tuple(
        tuple(PipeTask(stage=s, microbatch=j, pass_="F") for j in range(num_microbatches))
        + tuple(PipeTask(stage=s, microbatch=j, pass_="B") for j in range(num_microbatches))
        for s in range(num_stages)
    )


def one_f_one_b(num_stages: int, num_microbatches: int) -> tuple[tuple[PipeTask, ...], ...]:
    """1F1B (PipeDream-flush): warm up with forwards, then alternate, then drain.

    Stage ``s`` holds at most ``num_stages - s`` microbatches of activations.
    """
    _check(num_stages, num_microbatches)
    per_stage = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        tasks = [PipeTask(stage=s, microbatch=j, pass_="F") for j in range(warmup)]
        for i in range(num_microbatches - warmup):
            tasks.append(PipeTask(stage=s, microbatch=warmup + i, pass_="F"))
            tasks.append(PipeTask(stage=s, microbatch=i, pass_="B"))
        tasks += [
            PipeTask(stage=s, microbatch=j, pass_="B")
            for j in range(num_microbatches - warmup, num_microbatches)
        ]
        per_stage.append(tuple(tasks))
    return tuple(per_stage)


def make(name: ScheduleName, num_stages: int, num_microbatches: int) -> tuple[tuple[PipeTask, ...], ...]:
    """The per-stage task lists of the named schedule.

    Raises:
      ValueError: for an unknown schedule name.
    """
    if name == "gpipe":
        return gpipe(num_stages, num_microbatches)
    if name == "1f1b":
        return one_f_one_b(num_stages, num_microbatches)
    raise ValueError(f"schedule={name!r} is not one of {SCHEDULES}")


def dependencies(task: PipeTask, num_stages: int) -> tuple[PipeTask, ...]:
    """Tasks whose results ``task`` reads."""
    s, j = task.stage, task.microbatch
    if task.pass_ == "F":
        return (PipeTask(stage=s - 1, microbatch=j, pass_="F"),) if s > 0 else ()
    deps = [PipeTask(stage=s, microbatch=j, pass_="F")]
    if s < num_stages - 1:
        deps.append(PipeTask(stage=s + 1, microbatch=j, pass_="B"))
    return tuple(deps)


def dispatch_order(per_stage: Sequence[Sequence[PipeTask]]) -> tuple[PipeTask, ...]:
    """Merges per-stage lists into one order that respects every dependency.

    Each round gives every stage the chance to issue its next task, so that with
    asynchronous dispatch all stages have work queued.

    Raises:
      ValueError: if the lists deadlock (a task waits on one that never comes).
    """
    num_stages = len(per_stage)
    done: set[PipeTask] = set()
    pos = [0] * num_stages
    order: list[PipeTask] = []
    total = sum(len(t) for t in per_stage)
    while len(order) < total:
        progressed = False
        for s in range(num_stages):
            if pos[s] < len(per_stage[s]):
                task = per_stage[s][pos[s]]
                if all(d in done for d in dependencies(task, num_stages)):
                    order.append(task)
                    done.add(task)
                    pos[s] += 1
                    progressed = True
        if not progressed:
            waiting = [str(per_stage[s][pos[s]]) for s in range(num_stages) if pos[s] < len(per_stage[s])]
            raise ValueError(f"The schedule deadlocks: next tasks {waiting} wait on tasks that never run")
    return tuple(order)


def _check(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
