"""The plan-quality table: one row per (model, cluster) cell and the margins over families.

A cell is the plain data :func:`benchmarks.plan_quality.plan_cell` returns: autopar's plan,
every grid (``None`` where it fits no microbatch count) and ``bound``, a lower bound on the
step seconds of any plan under the same costs (one device's work over ``N`` devices, see
:func:`benchmarks._plan_ilp.step_bound`). ``best grid / bound`` is therefore the most any plan
could gain over the best grid: where it is below a target ratio, no plan reaches that target.
"""

from __future__ import annotations

import math
import statistics
from typing import Any


def grid_name(grid: tuple[int, int, int]) -> str:
    """``"dp x tp x pp"`` spelled as the cells' ``grids`` keys."""
    return "x".join(map(str, grid))


def cell_summary(cell: dict[str, Any]) -> dict[str, Any]:
    """Best grid, pure data parallel, best grid / autopar, best grid / bound and infeasible
    grids of a cell.

    The ratio is inf when only autopar fits and 0 when only a grid fits (which would be a bug:
    every grid is a plan the stage search considers). ``headroom`` (best grid / bound) is None
    when no grid fits or the cell has no bound.
    """
    feasible = {k: v for k, v in cell["grids"].items() if v is not None}
    best_grid = min(feasible, key=lambda k: feasible[k]["seconds"]) if feasible else None
    ours = cell["autopar"]
    if ours is not None and best_grid is not None:
        ratio: float | None = feasible[best_grid]["seconds"] / ours["seconds"]
    elif ours is not None:
        ratio = math.inf
    else:
        ratio = None if best_grid is None else 0.0
    bound = cell.get("bound")
    return {
        "best_grid": best_grid,
        "ratio": ratio,
        "headroom": feasible[best_grid]["seconds"] / bound if best_grid and bound else None,
        "dp": cell["grids"].get(grid_name((cell["devices"], 1, 1))),
        "infeasible": [k for k, v in cell["grids"].items() if v is None],
    }


def _seconds(plan: dict[str, Any] | None, missing: str = "OOM") -> str:
    return missing if plan is None else f"{plan['seconds']:.4g} (B={plan['microbatches']})"


def _meshes(plan: dict[str, Any] | None) -> str:
    if plan is None:
        return "-"
    return f"{len(plan['stages'])}: " + ",".join("{}x{}".format(*s["logical"]) for s in plan["stages"])


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


HEADERS = [
    "model",
    "cluster",
    "layers",
    "autopar s",
    "autopar stages: dp x tp",
    "best grid dp x tp x pp",
    "best grid s",
    "grid / autopar",
    "bound s",
    "grid / bound",
    "pure DP s",
    "autopar tp=1 s",
    "OOM grids",
]


def table_row(cell: dict[str, Any]) -> list[Any]:
    """One row of the results table."""
    s = cell_summary(cell)
    grid = cell["grids"][s["best_grid"]] if s["best_grid"] else None
    bound = cell.get("bound")
    return [
        cell["model"],
        f"{cell['devices']}x{cell['preset'].upper()}",
        cell["layers"],
        _seconds(cell["autopar"], "does not fit"),
        _meshes(cell["autopar"]),
        s["best_grid"] or "none fits",
        _seconds(grid, "-"),
        _ratio(s["ratio"]),
        "-" if bound is None else f"{bound:.4g}",
        _ratio(s["headroom"]),
        _seconds(s["dp"]),
        _seconds(cell["autopar_tp1"]),
        f"{len(s['infeasible'])}/{len(cell['grids'])}",
    ]


def margins(
    cells: list[dict[str, Any]], families: tuple[str, ...], key: str = "ratio"
) -> tuple[float, float, float] | None:
    """(min, median, max) of best grid / autopar (``key="ratio"``) or best grid / bound
    (``key="headroom"``) over the cells of ``families`` where it is finite (a cell where only
    a grid fits counts as 0; one where only autopar fits is left out)."""
    values = [cell_summary(c)[key] for c in cells if c["family"] in families]
    finite = [r for r in values if r is not None and math.isfinite(r)]
    return (min(finite), statistics.median(finite), max(finite)) if finite else None


def summary_lines(cells: list[dict[str, Any]], groups: list[tuple[tuple[str, ...], str]]) -> list[str]:
    """Per group of families, the margin over the best grid and the most any plan could reach."""
    lines = []
    for families, label in groups:
        m = margins(cells, families)
        if m is None:
            continue
        line = f"{label}: best grid / autopar min {m[0]:.3f}, median {m[1]:.3f}, max {m[2]:.3f}"
        h = margins(cells, families, "headroom")
        if h is not None:
            line += f"; best grid / bound (the most any plan could reach) min {h[0]:.3f}, median {h[1]:.3f}"
        lines.append(line)
    return lines
