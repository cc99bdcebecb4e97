"""Pipeline timelines: simulate a plan's schedule in time and draw it as a Gantt chart.

The simulation is event-driven and exact for the model it assumes: every stage runs its
own task list in order, one task at a time, and a task starts as soon as its stage is
free and everything it reads has arrived.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from autopar._src import schedule

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from autopar._src.plan import Plan

TaskKind = Literal["F", "B", "send"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimedTask:
    """One task of a simulated pipeline step, placed in time."""

    stage: int
    """Stage whose row the task occupies (the sender, for a transfer)."""
    kind: TaskKind
    """``F`` (forward), ``B`` (backward) or ``send`` (a transfer to a neighbouring stage)."""
    microbatch: int
    """Microbatch index."""
    start: float
    """Start time in seconds from the beginning of the step."""
    end: float
    """End time in seconds from the beginning of the step."""


def _task_durations(
    plan: Plan, forward_fraction: float, task_seconds: Mapping[tuple[int, str], float] | None
) -> dict[tuple[int, str], float]:
    """Seconds of each (stage, pass): measured, else predicted, else FLOP-proportional, else 1."""
    stages = plan.stages
    if any(st.latency > 0.0 for st in stages):
        fwd = [forward_fraction * st.latency for st in stages]
        bwd = [st.latency - f for st, f in zip(stages, fwd, strict=True)]
    elif any(st.forward_flops > 0.0 for st in stages):
        # Backward costs about twice the forward; the slowest stage's F+B is one unit.
        scale = 3.0 * max(st.forward_flops for st in stages)
        fwd = [st.forward_flops / scale for st in stages]
        bwd = [2.0 * st.forward_flops / scale for st in stages]
    else:
        fwd = bwd = [1.0] * len(stages)
    durations = {(s, p): t for s in range(len(stages)) for p, t in (("F", fwd[s]), ("B", bwd[s]))}
    given: set[tuple[int, str]] = set()
    for key, seconds in (task_seconds or {}).items():
        joined = isinstance(key, tuple) and len(key) == 2 and key[1] == "F+B" and (key[0], "F") in durations
        if key not in durations and not joined:
            raise ValueError(
                f"task_seconds key {key!r} is not a (stage, 'F' | 'B' | 'F+B') pair with stage in "
                f"[0, {len(stages)})"
            )
        if not seconds >= 0.0:
            raise ValueError(f"task_seconds[{key!r}]={seconds} must be a non-negative number of seconds")
        if joined:  # a stage's forward and backward run as one task: split by forward_fraction
            durations[(key[0], "F")] = forward_fraction * float(seconds)
            durations[(key[0], "B")] = float(seconds) - durations[(key[0], "F")]
            given |= {(key[0], "F"), (key[0], "B")}
        else:
            durations[key] = float(seconds)
            given.add(key)
    missing = sorted(durations.keys() - given)
    if task_seconds and missing and not any(st.latency > 0.0 for st in stages):
        raise ValueError(
            f"task_seconds has no time for {missing}, and the plan has no predicted latencies to fill "
            "them in seconds (only relative units); give every (stage, 'F' | 'B')"
        )
    return durations


def simulate(
    plan: Plan,
    *,
    forward_fraction: float = 1 / 3,
    transfer_seconds: Sequence[float] | None = None,
    task_seconds: Mapping[tuple[int, str], float] | None = None,
) -> tuple[TimedTask, ...]:
    """Places every task of the plan's schedule in time.

    Args:
      plan: the plan; its schedule, stage count and microbatch count fix the task lists.
      forward_fraction: share of a stage's predicted latency spent in the forward.
      transfer_seconds: ``transfer_seconds[s]`` is the time to send activations from stage
        ``s`` to ``s + 1`` (and gradients back); one entry per stage boundary, default 0.
      task_seconds: measured seconds keyed by ``(stage, "F" | "B")``; each entry overrides
        the predicted time of that stage and pass. ``(stage, "F+B")``, a stage that runs
        each microbatch's forward and backward as one task, is split by ``forward_fraction``.

    Returns:
      The forward and backward tasks in an order that respects every dependency, each
      followed by the transfers it sends (only nonzero ones are emitted).

    Raises:
      ValueError: for a plan without stages, ``forward_fraction`` outside (0, 1), or
        transfer or task times of the wrong length, key or sign.
    """
    num_stages = plan.num_stages
    if num_stages < 1:
        raise ValueError("The plan has no stages; there is nothing to simulate")
    if not 0.0 < forward_fraction < 1.0:
        raise ValueError(f"forward_fraction={forward_fraction} must lie strictly between 0 and 1")
    transfers = [0.0] * (num_stages - 1) if transfer_seconds is None else [float(t) for t in transfer_seconds]
    if len(transfers) != num_stages - 1:
        raise ValueError(
            f"transfer_seconds has {len(transfers)} entries; a plan with {num_stages} stages needs "
            f"{num_stages - 1} (one per stage boundary)"
        )
    if any(not t >= 0.0 for t in transfers):
        raise ValueError(f"transfer_seconds={transfers} must all be non-negative")
    durations = _task_durations(plan, forward_fraction, task_seconds)

    per_stage = schedule.make(plan.schedule, num_stages, plan.num_microbatches)
    # Stage lists are fixed and the graph is acyclic, so visiting tasks in any
    # dependency-respecting order gives every task its earliest start.
    end: dict[schedule.PipeTask, float] = {}
    free = [0.0] * num_stages
    timed: list[TimedTask] = []
    for task in schedule.dispatch_order(per_stage):
        start = free[task.stage]
        for dep in schedule.dependencies(task, num_stages):
            delay = 0.0 if dep.stage == task.stage else transfers[min(dep.stage, task.stage)]
            start = max(start, end[dep] + delay)
        finish = start + durations[(task.stage, task.pass_)]
        end[task] = free[task.stage] = finish
        timed.append(
            TimedTask(stage=task.stage, kind=task.pass_, microbatch=task.microbatch, start=start, end=finish)
        )
        # Forwards send to the next stage, backwards to the previous one.
        target = task.stage + 1 if task.pass_ == "F" else task.stage - 1
        if 0 <= target < num_stages:
            delay = transfers[min(task.stage, target)]
            if delay > 0.0:
                timed.append(
                    TimedTask(
                        stage=task.stage,
                        kind="send",
                        microbatch=task.microbatch,
                        start=finish,
                        end=finish + delay,
                    )
                )
    return tuple(timed)


def makespan(tasks: Sequence[TimedTask]) -> float:
    """Seconds from the start of the step to the end of its last task (0 for no tasks)."""
    return max((t.end for t in tasks), default=0.0)


def bubble_fraction(tasks: Sequence[TimedTask], num_stages: int) -> float:
    """Share of the stages' time spent idle: ``1 - busy / (num_stages * makespan)``.

    Only forward and backward tasks count as busy; transfers do not.

    Raises:
      ValueError: if ``num_stages < 1`` or the tasks take no time.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    span = makespan(tasks)
    if span <= 0.0:
        raise ValueError(f"The tasks have makespan {span}; a bubble fraction needs a positive one")
    busy = sum(t.end - t.start for t in tasks if t.kind != "send")
    return 1.0 - busy / (num_stages * span)


_COLOURS = {"F": "#4c72b0", "B": "#dd8452"}


def draw(tasks: Sequence[TimedTask], path: str, *, num_stages: int, title: str = "") -> Figure:
    """Writes a Gantt chart of the tasks to a PNG file, one row per stage (stage 0 on top).

    Returns:
      The drawn figure (its y tick labels name the rows).

    Raises:
      ValueError: if ``path`` does not end in ``.png``, there are no tasks, or a task's
        stage is outside ``[0, num_stages)``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if os.path.splitext(path)[1].lower() != ".png":
        raise ValueError(f"path={path!r} must end in .png; the timeline is drawn as a PNG image")
    if not tasks:
        raise ValueError("tasks is empty; simulate a plan first")
    bad = sorted({t.stage for t in tasks if not 0 <= t.stage < num_stages})
    if bad:
        raise ValueError(f"Tasks on stages {bad} lie outside num_stages={num_stages}")
    span = makespan(tasks)
    bubble = bubble_fraction(tasks, num_stages)
    scale, unit = (1e3, "ms") if span < 1.0 else (1.0, "s")

    fig = Figure(figsize=(max(6.0, min(16.0, 0.2 * len(tasks))), 1.0 + 0.6 * num_stages), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for t in tasks:
        left, width = t.start * scale, (t.end - t.start) * scale
        if t.kind == "send":
            ax.barh(
                t.stage + 0.35,
                width,
                left=left,
                height=0.12,
                color="0.85",
                edgecolor="0.4",
                hatch="////",
                linewidth=0.5,
            )
            continue
        ax.barh(
            t.stage, width, left=left, height=0.6, color=_COLOURS[t.kind], edgecolor="white", linewidth=0.8
        )
        if width >= 0.025 * span * scale:
            ax.text(
                left + width / 2,
                t.stage,
                str(t.microbatch),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )

    ax.set_yticks(range(num_stages), labels=[f"stage {s}" for s in range(num_stages)])
    ax.set_ylim(num_stages - 0.5, -0.5)
    ax.set_xlim(0.0, span * scale * 1.01)
    ax.set_xlabel(f"time ({unit})")
    handles = [Patch(color=_COLOURS["F"], label="forward"), Patch(color=_COLOURS["B"], label="backward")]
    if any(t.kind == "send" for t in tasks):
        handles.append(Patch(facecolor="0.85", edgecolor="0.4", hatch="////", label="transfer"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    heading = f"bubble {bubble:.1%}, step {span * scale:.3g} {unit}"
    ax.set_title(f"{title}: {heading}" if title else heading, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return fig


def plan_timeline(plan: Plan, path: str, **simulate_kwargs: Any) -> tuple[TimedTask, ...]:
    """Simulates the plan's schedule and draws it to the PNG file ``path``.

    Args:
      plan: the plan to simulate.
      path: where to write the chart (must end in ``.png``).
      **simulate_kwargs: passed to :func:`simulate`.

    Returns:
      The simulated tasks.
    """
    tasks = simulate(plan, **simulate_kwargs)
    title = f"{plan.schedule}, {plan.num_stages} stages, {plan.num_microbatches} microbatches"
    if not simulate_kwargs.get("task_seconds") and all(st.latency == 0.0 for st in plan.stages):
        title += " (no predicted latencies: relative times)"
    draw(tasks, path, num_stages=plan.num_stages, title=title)
    return tasks
