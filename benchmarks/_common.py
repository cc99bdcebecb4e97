"""Shared helpers for the benchmark scripts: devices, timing, result files."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics
from collections.abc import Callable, Sequence
from typing import Any

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def use_cpu_devices(n: int) -> None:
    """Simulates ``n`` CPU devices; call before any JAX operation."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports on 127.0.0.1 that were free a moment ago (for local ``jax.distributed``
    processes)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def interleaved_medians(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Times each function once per round, alternating (see ``autopar._src.bench``)."""
    from autopar._src.bench import interleaved_times

    return interleaved_times(fns, rounds)


def summary(ts: Sequence[float]) -> tuple[float, float, float]:
    """Median, 10th and 90th percentile of ``ts``."""
    qs = statistics.quantiles(ts, n=10) if len(ts) >= 2 else [ts[0]] * 9
    return statistics.median(ts), qs[0], qs[-1]


def environment() -> dict[str, str]:
    """Library versions and machine description for result files."""
    import flax
    import jax
    import jaxlib
    import numpy
    import optax

    devices = jax.devices()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{socket.gethostname()} ({platform.machine()}, {os.cpu_count()} cores)",
        "devices": f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform})",
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "numpy": numpy.__version__,
    }


def machine_tag() -> str:
    """Short machine name for result file names: the device platform and count."""
    import jax

    return f"{jax.devices()[0].platform}{jax.device_count()}"


def write_markdown(
    name: str,
    title: str,
    config: dict[str, Any],
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    notes: str = "",
) -> str:
    """Writes ``results/<name>_<machine>_<date>.md`` and returns its path."""
    os.makedirs(RESULTS, exist_ok=True)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    path = os.path.join(RESULTS, f"{name}_{machine_tag()}_{date}.md")
    lines = [f"# {title}", "", "## Configuration", ""]
    lines += [f"- {k}: {v}" for k, v in config.items()]
    lines += ["", "## Environment", ""]
    lines += [f"- {k}: {v}" for k, v in environment().items()]
    lines += ["", "## Results", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    if notes:
        lines += ["", notes]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Prints a small rich table."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for h in headers:
        table.add_column(h)
    for row in rows:
        table.add_row(*[str(c) for c in row])
    Console().print(table)
