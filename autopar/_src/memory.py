"""Per-device memory of a stage: what the compiled program really holds, and what
the planner's model predicts.

The ground truth follows the runtime exactly. The driver's instruction list is
static, so the buffers alive on a stage's devices at each instruction are known:
inputs placed at the start, values made by the stage's tasks or received from
other stages, each until its last use. While a task runs, its compiled
executable's ``memory_analysis()`` adds its temporaries, and its donated inputs
turn into outputs (aliased bytes are not counted twice). The peak over the step
is the stage's per-device memory.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from autopar._src import cost
from autopar._src.driver import Executable
from autopar._src.plan import DATA_AXIS
from autopar._src.program import Key, live_at_runs


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryTrace:
    """The compiled program's per-device memory on one stage."""

    peak: float
    """Largest bytes alive on one device of the stage during a step."""
    at_task: str
    """Label of the task running at the peak."""
    live: float
    """Bytes of buffers alive at the peak outside the running task's temporaries."""
    temporaries: float
    """Temporary bytes of the running task's executable (XLA's buffer assignment)."""


def device_bytes(exe: Executable, key: Key, stage: int) -> float:
    """Bytes one device of ``stage`` holds of ``key`` under its sharding."""
    held = exe.abstract(key, stage)
    shape = held.sharding.shard_shape(held.shape)
    return float(cost.aval_bytes(key[0].aval.update(shape=shape)))


def _temporaries(exe: Executable, task_index: int) -> float:
    fn = exe.fns[task_index]
    analysis = fn.lower(*exe.abstract_inputs(task_index)).compile().memory_analysis()
    # A backend without memory analysis: the check counts the program's buffers only.
    return 0.0 if analysis is None else float(analysis.temp_size_in_bytes)


def compiled_peak(exe: Executable, stage: int) -> MemoryTrace:
    """The per-device peak of ``stage`` over one step of the compiled program."""
    program = exe.program
    size = functools.cache(lambda key: device_bytes(exe, key, stage))
    placed = sum(size(k) for k, on in program.input_stages.items() if stage in on)
    best = MemoryTrace(peak=placed, at_task="(inputs)", live=placed, temporaries=0.0)
    temps: dict[int, float] = {}
    for ins, live in live_at_runs(program, stage):
        t = program.tasks[ins.task]
        if id(exe.fns[ins.task]) not in temps:
            temps[id(exe.fns[ins.task])] = _temporaries(exe, ins.task)
        # Donated inputs already became outputs: leave them out.
        freed = {loc[0] for loc in ins.frees if loc[1] == stage}
        donated = {k for k in t.in_keys if k in freed and _donated(exe, ins.task, k)}
        now = sum(size(k) for k in dict.fromkeys((*live, *t.out_keys)) if k not in donated)
        temp = temps[id(exe.fns[ins.task])]
        if now + temp > best.peak:
            best = MemoryTrace(peak=now + temp, at_task=t.label, live=now, temporaries=temp)
    return best


def _donated(exe: Executable, task_index: int, key: Key) -> bool:
    return exe.program.tasks[task_index].in_keys.index(key) in exe.donated[task_index]


def predicted_peak(exe: Executable, stage: int, profile: Any) -> float:
    """The planner's memory model for ``stage`` of ``exe``'s plan (see :func:`planner.planned_peak`),
    with the stage's inputs, gradient sums and stashes as the sharding ILP laid them out where
    it did."""
    from autopar._src import planner

    inputs, stashes, sums, rest = planner.planned_peak(profile, exe.plan, stage)
    rest -= _reused_by_backward(exe, stage, profile)
    chosen = exe.shardings[stage] if exe.shardings else None
    if chosen is None:
        return inputs + stashes + sums + rest
    # A deferred gradient stays among the backward's transients: XLA makes a task's partial
    # sums before it adds them to their running sums, and holds most of them at once.
    return chosen.memory_bytes + rest


def _reused_by_backward(exe: Executable, stage: int, profile: Any) -> float:
    """Per-device bytes of the backward's largest value that need no memory of their own
    where every backward of ``stage`` runs in the task of its forward: the value (the gradient
    of the logits, say) is made from a residual (the logits) as that residual dies, and XLA
    gives it the residual's buffer. Between two tasks the residual is an input of the
    backward and lives to its end. 0 where some backward runs alone."""
    tasks = [t for t in exe.program.tasks if t.stage == stage]
    if not any(t.kept for t in tasks) or any(t.label.startswith("B") for t in tasks):
        return 0.0
    st = exe.plan.stages[stage]
    start, stop = st.layers
    dp = st.mesh_shape[st.axis_names.index(DATA_AXIS)]
    largest = max(
        float(profile.backward_peak_bytes[start:stop].max(initial=0.0)) / dp,
        float(profile.backward_peak_replicated_bytes[start:stop].max(initial=0.0)),
    )
    kept = max(device_bytes(exe, k, stage) for t in tasks for k in t.kept)
    return min(largest, kept)


def relative_error(predicted: float, actual: float) -> float:
    """``|predicted - actual| / actual``."""
    return abs(predicted - actual) / actual
