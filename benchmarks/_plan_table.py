"""The plan-quality table: one row per (model, cluster) cell and the margins over families.

A cell is the plain data :func:`benchmarks._plan_cell.plan_cell` returns: autopar's plan,
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


def faster(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """The faster of two plans (None: does not fit); ties keep ``a``."""
    if a is None or (b is not None and b["seconds"] < a["seconds"]):
        return b
    return a


def combine(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell of one (model, cluster) from its cells on several clusterings (or microbatch
    counts): autopar's plans and each grid are the fastest over them, as autopar's planner and a
    user trying each would find; the bound is the least (each holds for plans on its cells)."""
    first = cells[0]
    best: dict[str, Any] = {"autopar": None, "autopar_tp1": None}
    grids: dict[str, dict[str, Any] | None] = {}
    for cell in cells:
        for role in best:
            best[role] = faster(best[role], cell[role])
        for k, g in cell["grids"].items():
            grids[k] = faster(grids.get(k), g)
    return {
        **first,
        **best,
        "layers": first["layers"] if best["autopar"] is None else best["autopar"]["layers"],
        "layer_counts": list(dict.fromkeys(c["layers"] for c in cells)),
        "microbatch_candidates": sorted({b for c in cells for b in c["microbatch_candidates"]}),
        "grids": grids,
        "bound": min(c["bound"] for c in cells),
        "trace_seconds": sum(c["trace_seconds"] for c in cells),
        "plan_seconds": sum(c["plan_seconds"] for c in cells),
    }


def _seconds(plan: dict[str, Any] | None, missing: str = "OOM") -> str:
    return missing if plan is None else f"{plan['seconds']:.4g} (B={plan['microbatches']})"


def _meshes(plan: dict[str, Any] | None) -> str:
    if plan is None:
        return "-"
    return f"{len(plan['stages'])}: " + ",".join("{}x{}".format(*s["logical"]) for s in plan["stages"])


def _layers(cell: dict[str, Any]) -> str:
    counts = cell.get("layer_counts", [cell["layers"]])
    return str(cell["layers"]) if len(counts) == 1 else f"{cell['layers']} ({'/'.join(map(str, counts))})"


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
        _layers(cell),
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


def results_notes(
    cells: list[dict[str, Any]],
    *,
    costs: str,
    ilp_microbatches: list[int],
    summary: list[str],
    elapsed: float,
    reused: tuple[int, int],
) -> list[str]:
    """The notes under the table: how the cells were priced, how to read the columns, the
    margins ``summary`` and the grids that fit nowhere; ``reused = (k, n)``: ``k`` of the ``n``
    plans of a cell on a clustering came from a journal."""
    if costs == "ilp":
        method = [
            "Predicted step seconds, not measurements, with every layer priced by the sharding ILP on "
            "every logical mesh (power-of-two submeshes, tensor-parallel degree up to one host): free "
            "layouts for autopar, at most Megatron's bytes of each layer's inputs per device; Megatron-LM's "
            "layouts pinned for the grids (`autopar.megatron_rules`: attention and MLP column/row "
            "splits, each expert's hidden dim, Wide-ResNet's wide convolution pair), the ILP laying out "
            "the rest. Both trace one microbatch and reduce gradients once per step; both share the "
            f"analytic memory model. Microbatch counts: {', '.join(map(str, ilp_microbatches))}. "
            "`pure DP` is the grid (N, 1, 1). `autopar tp=1` is autopar on (n, 1) logical meshes only.",
            "",
            "GPT blocks are rematerialised: the backward recomputes each block inside a checkpoint "
            "call, whose equations the ILP lays out like any others (and the runtime pins inside the "
            "call). BERT, Wide-ResNet and MoE are not rematerialised.",
        ]
    else:
        method = [
            "Predicted step seconds of the analytic cost model, not measurements. `B` is the number of "
            "microbatches; every plan picks its best. `pure DP` is the grid (N, 1, 1). `autopar tp=1` is "
            "the stage search restricted to (n, 1) logical meshes. Tensor parallelism is priced as "
            "Megatron's on both sides (`--costs ilp` prices autopar with its own sharding search).",
            "",
            "The cost model charges every collective of a stage whose submesh spans hosts (data- and "
            "tensor-parallel alike) at the inter-host link, which on the V100 preset is slow (25 Gbit/s "
            "per 8 GPUs). A grid whose stages are wider than one host therefore pays inter-host "
            "all-reduces that Megatron-LM would keep inside a host for its tensor-parallel axis; the "
            "largest ratios below (wide stages forced by memory) come mostly from that.",
        ]
    notes = [
        *method,
        "",
        "`grid / autopar` >= 1 means autopar's plan is at least as fast as the best uniform "
        "(dp, tp, pp) grid. `bound s` is a lower bound on every plan's step under the same costs: "
        + (
            "one device's forward and backward of every layer (the ILP on a 1x1 mesh) times the "
            "microbatches over N, since no layout gives an equation on n devices less than 1/n of its "
            "one-device cost"
            if costs == "ilp"
            else "the step's FLOPs over N devices' peak plus its memory traffic over their bandwidth"
        )
        + " (perfect scaling, free communication, no bubble). `grid / bound` is therefore the most any "
        "plan could gain over the best grid: a target above it cannot be reached in that cell. "
        "`OOM grids` counts the grids that fit no microbatch count. Stage lists "
        "give each stage's logical mesh. Grids split the clustered layers as evenly as they divide "
        "(the first stages take one more), so `pp` is at most the number of layers. Each cell is "
        "planned on every automatic clustering (`clustering.BYTES_FACTORS`, then the finest, "
        "unbalanced one that `clustering.UNBALANCED_FACTORS` allows; `layers` gives the one "
        "autopar's plan uses, then all in parentheses) and at every microbatch count listed: "
        "autopar's plan, as its planner does, and each grid, as a user trying each would, are the "
        "fastest over them.",
        "",
        *[f"- {line}." for line in summary],
        "",
        "Grids that fit no microbatch count (dp x tp x pp):",
        "",
        *[
            f"- {c['model']} on {c['devices']}x{c['preset'].upper()}: "
            + (", ".join(cell_summary(c)["infeasible"]) or "none")
            for c in cells
        ],
        "",
        f"Every grid and plan is in the JSON file next to this one. Run time {elapsed:.0f} s"
        + (
            f"; {reused[0]} of the {reused[1]} plans of a cell on a clustering were read back from "
            "the journal."
            if reused[0]
            else "."
        ),
    ]
    return notes
