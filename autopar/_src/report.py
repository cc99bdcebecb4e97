"""Human-readable rendering of plans (rich tables)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from autopar._src.plan import Plan


def _flops(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f}"


def _bytes(x: float) -> str:
    from autopar._src.stage_problem import format_bytes

    return format_bytes(x)


def _seconds(x: float) -> str:
    return f"{x * 1e3:.2f} ms" if x < 10 else f"{x:.2f} s"


def _devices(ids: tuple[int, ...]) -> str:
    if len(ids) > 2 and list(ids) == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def plan_table(plan: Plan, width: int = 120) -> str:
    """The plan as text: a row per stage, each stage's code and largest tensors, the schedule."""
    from autopar._src import timeline

    predicted = any(st.latency for st in plan.stages)
    table = Table(title="autopar plan", title_justify="left")
    cols = ["stage", "layers", "devices", "mesh", "fwd FLOPs/mb"]
    cols += ["compute/mb", "comm/mb", "memory/device"] if predicted else []
    for col in cols:
        table.add_column(col)
    for i, st in enumerate(plan.stages):
        first, last = st.layers[0], st.layers[1] - 1
        row = [
            str(i),
            str(first) if first == last else f"{first}-{last}",
            _devices(st.device_ids),
            " x ".join(f"{n}={s}" for n, s in zip(st.axis_names, st.mesh_shape, strict=True)),
            _flops(st.forward_flops),
        ]
        if predicted:
            budget = f" / {_bytes(plan.memory_budget)}" if plan.memory_budget else ""
            row += [
                _seconds(st.compute_time),
                _seconds(st.latency - st.compute_time),
                _bytes(st.memory_bytes) + budget,
            ]
        table.add_row(*row)
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    console.print(table)
    for i, st in enumerate(plan.stages):
        if st.source[0] or st.largest_params:
            console.print(f"stage {i}: {st.source[0]} ... {st.source[1]}", soft_wrap=True)
            for p in st.largest_params:
                console.print(f"    {p}", soft_wrap=True)
    tasks = timeline.simulate(plan)
    summary = (
        f"schedule={plan.schedule}  microbatches={plan.num_microbatches}  layers={plan.num_layers}  "
        f"stages={plan.num_stages}  bubble={timeline.bubble_fraction(tasks, plan.num_stages):.1%}"
    )
    if plan.predicted_step_time:
        summary += f"  predicted step {_seconds(plan.predicted_step_time)}"
    console.print(summary)
    return buf.getvalue().rstrip()
