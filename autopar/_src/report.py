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


def _bytes(x: float, budget: float) -> str:
    text = f"{x / 2**20:.1f} MiB"
    return f"{text} / {budget / 2**30:.1f} GiB" if budget else text


def plan_table(plan: Plan) -> str:
    """The plan as a text table: one row per stage, then the schedule."""
    table = Table(title="autopar plan", title_justify="left")
    predicted = any(st.latency for st in plan.stages)
    cols = ["stage", "layers", "devices", "mesh", "fwd FLOPs / microbatch"]
    cols += ["time / microbatch", "memory / device"] if predicted else []
    for col in cols:
        table.add_column(col)
    for i, st in enumerate(plan.stages):
        mesh = " x ".join(f"{n}={s}" for n, s in zip(st.axis_names, st.mesh_shape, strict=True))
        table.add_row(
            str(i),
            str(st.layers[0]) if st.layers[1] - st.layers[0] == 1 else f"{st.layers[0]}..{st.layers[1] - 1}",
            ",".join(map(str, st.device_ids)),
            mesh,
            _flops(st.forward_flops),
            *([f"{st.latency * 1e3:.2f} ms", _bytes(st.memory_bytes, plan.memory_budget)]
              if predicted else []),
        )
    buf = io.StringIO()
    console = Console(file=buf, width=100, force_terminal=False, color_system=None)
    console.print(table)
    summary = (
        f"schedule={plan.schedule}  microbatches={plan.num_microbatches}  "
        f"layers={plan.num_layers}  stages={plan.num_stages}"
    )
    if plan.predicted_step_time:
        summary += f"  predicted step {plan.predicted_step_time * 1e3:.2f} ms"
    console.print(summary)
    return buf.getvalue().rstrip()
