"""Human-readable rendering of plans and cluster specs (rich tables)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from autopar._src.stage_problem import format_bytes

if TYPE_CHECKING:
    from autopar._src.cluster import ClusterSpec
    from autopar._src.plan import Plan


def _seconds(x: float) -> str:
    if x >= 10:
        return f"{x:.2f} s"
    return f"{x * 1e3:.2f} ms" if x >= 1e-3 else f"{x * 1e6:.2f} us"


def _rate(x: float, unit: str) -> str:
    """``x`` with a decimal prefix (K to P) before ``unit``."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}".rstrip()


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
            _rate(st.forward_flops, ""),
        ]
        if predicted:
            budget = f" / {format_bytes(plan.memory_budget)}" if plan.memory_budget else ""
            row += [
                _seconds(st.compute_time),
                _seconds(st.latency - st.compute_time),
                format_bytes(st.memory_bytes) + budget,
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


def cluster_table(spec: ClusterSpec, width: int = 100) -> str:
    """The spec as a text table: peak FLOP/s per dtype, memory bandwidth and size, time per
    kernel, links."""
    table = Table(title=f"cluster {spec.name}", title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("device", spec.device.name)
    table.add_row("hosts x devices", f"{spec.num_hosts} x {spec.devices_per_host}")
    for dtype, flops in spec.device.peak_flops:
        table.add_row(f"peak {dtype}", _rate(flops, "FLOP/s"))
    table.add_row("memory bandwidth", _rate(spec.device.memory_bandwidth, "B/s"))
    table.add_row("memory", format_bytes(spec.device.memory_bytes))
    table.add_row("time per kernel", _seconds(spec.device.kernel_time))
    table.add_row("intra-host link", _rate(spec.intra_host_bandwidth, "B/s"))
    table.add_row("intra-host latency", _seconds(spec.intra_host_latency))
    table.add_row("inter-host link", _rate(spec.inter_host_bandwidth, "B/s"))
    table.add_row("inter-host latency", _seconds(spec.inter_host_latency))
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None).print(table)
    return buf.getvalue().rstrip()
