"""Plan quality: autopar's stage search vs every Megatron-style (dp, tp, pp) grid and pure data parallel.

Each model is traced abstractly once per cluster preset at the whole global batch (nothing is
allocated), profiled, and costed analytically (``autopar._src.planner.stage_costs`` with
tensor-parallel logical meshes). For every microbatch count that divides the batch (up to 64),
three plans share that cost model:

- autopar: Alpa's stage DP over layer ranges x submeshes x logical (dp, tp) meshes;
- every uniform grid ``dp * tp * pp = N``: ``pp`` stages of equal layer counts, each on
  ``N / pp`` devices as a ``(dp, tp)`` mesh (Megatron-LM's 3-D parallelism);
- pure data parallel: the grid ``(N, 1, 1)``.

Each keeps its best microbatch count, and its best clustering: every cell is planned on each
automatic clustering (``clustering.BYTES_FACTORS``), as ``num_stages="auto"`` plans, and
autopar's plan and each grid are the fastest over them (``_plan_table.combine``). The ratio
best grid / autopar is >= 1 when autopar's plan is at least as fast; the grids lie inside the
stage search's space, so a ratio below 1 would be a bug. These are predicted step times of the
analytic model, not measurements. Each cell also records ``bound``, a lower bound on any plan's
step under the same costs (perfect scaling of one device's work), so best grid / bound is the
most any plan could gain.

With ``--costs ilp`` both sides are priced by the sharding ILP instead (see
``benchmarks/_plan_ilp.py``): the grids with Megatron-LM's layouts pinned, autopar with free
layouts that hold no more bytes per device; each microbatch count is a trace of one
microbatch and an ILP per distinct layer and logical mesh (minutes per cell; ``--jobs``
plans cells in parallel processes).

Models are paired with cluster sizes as in Alpa's weak scaling (Zheng et al., OSDI 2022,
Table 4), shifted down: the models Alpa ran on 1, 4, 8 and 16 GPUs run here on 8, 16, 32
and 64 devices (BERT, which Alpa did not run, keeps its largest preset on 64).

    python benchmarks/plan_quality.py                     # 4 families x 8..64 devices x v100, h100
    python benchmarks/plan_quality.py --quick             # GPT and BERT on 8, 16 V100s (< 1 min)
    python benchmarks/plan_quality.py --sizes alpa        # Alpa's own 8..64-GPU model sizes
    python benchmarks/plan_quality.py --families gpt --devices 8 --presets h100
    python benchmarks/plan_quality.py --smoke --out-dir /tmp/results   # one tiny model, seconds
    python benchmarks/plan_quality.py --costs ilp --jobs 2 --journal /tmp/pq.jsonl  # ILP-priced, hours

The last line printed is ``min_ratio_vs_best_grid=<float>`` (over the GPT and BERT cells run;
over all cells when there are none).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common, _journal  # noqa: E402
from benchmarks._plan_cell import DTYPES, SCHEDULE, layer_counts, plan_job  # noqa: E402
from benchmarks._plan_table import (  # noqa: E402
    HEADERS,
    combine,
    margins,
    results_notes,
    summary_lines,
    table_row,
)

DEVICE_COUNTS = (8, 16, 32, 64)
SIZES: dict[str, dict[str, dict[int, str]]] = {
    # Alpa's Table 4 models for 1, 4, 8 and 16 GPUs, placed on 8, 16, 32 and 64 devices.
    "shifted": {
        "gpt": {8: "gpt-350m", 16: "gpt-1.3b", 32: "gpt-2.6b", 64: "gpt-6.7b"},
        "bert": {8: "bert-large", 16: "bert-1.3b", 32: "bert-2.6b", 64: "bert-2.6b"},
        "wresnet": {8: "wresnet-250m", 16: "wresnet-1b", 32: "wresnet-2b", 64: "wresnet-4b"},
        "moe": {8: "moe-380m", 16: "moe-1.3b", 32: "moe-2.4b", 64: "moe-10b"},
    },
    # Alpa's Table 4 models for 8, 16, 32 and 64 GPUs (no 70B MoE preset: 27B on 64 too).
    "alpa": {
        "gpt": {8: "gpt-2.6b", 16: "gpt-6.7b", 32: "gpt-15b", 64: "gpt-39b"},
        "bert": {8: "bert-large", 16: "bert-1.3b", 32: "bert-2.6b", 64: "bert-2.6b"},
        "wresnet": {8: "wresnet-2b", 16: "wresnet-4b", 32: "wresnet-6.8b", 64: "wresnet-13b"},
        "moe": {8: "moe-2.4b", 16: "moe-10b", 32: "moe-27b", 64: "moe-27b"},
    },
}
FAMILIES = ("gpt", "bert", "wresnet", "moe")
HEADLINE_FAMILIES = ("gpt", "bert")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--devices", nargs="+", type=int, default=list(DEVICE_COUNTS), choices=DEVICE_COUNTS)
    parser.add_argument("--presets", nargs="+", default=["v100", "h100"], choices=sorted(DTYPES))
    parser.add_argument(
        "--sizes",
        default="shifted",
        choices=sorted(SIZES),
        help="model per cluster size: 'shifted' (Alpa's 1/4/8/16-GPU models on 8/16/32/64 devices, "
        "default) or 'alpa' (Alpa's 8/16/32/64-GPU models)",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        default=None,
        help="plan these presets on every --devices (overrides --families)",
    )
    parser.add_argument("--batch-size", type=int, default=None, help="default: Alpa's batch of each family")
    parser.add_argument("--max-microbatches", type=int, default=64)
    parser.add_argument(
        "--costs",
        default="analytic",
        choices=["analytic", "ilp"],
        help="analytic: the stage DP's analytic model, Megatron tensor parallelism on both sides "
        "(default); ilp: each layer priced by the sharding ILP, free for autopar and with Megatron's "
        "layouts pinned for the grids (slow: minutes per cell)",
    )
    parser.add_argument(
        "--ilp-microbatches",
        nargs="+",
        type=int,
        default=[64],
        help="microbatch counts priced with --costs ilp (each is a trace and an ILP per layer and mesh)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="GPT and BERT on 8 and 16 V100s (under a minute)"
    )
    parser.add_argument("--smoke", action="store_true", help="gpt-small, batch 64, 8 V100s (seconds)")
    parser.add_argument("--jobs", type=int, default=1, help="cells planned at once, one process each")
    parser.add_argument(
        "--journal",
        default=None,
        help="JSON-lines file: each planned cell is appended to it, and cells already in it "
        "(same model, preset, devices and options) are read back instead of planned again",
    )
    parser.add_argument(
        "--kernel-time",
        type=float,
        default=0.0,
        help="seconds per kernel given to the presets' devices (0, the default: the presets have none; "
        "5.65e-6 was measured on an H200, benchmarks/results/calibrate_kernels_h200_gpu1_2026-11-27.json)",
    )
    parser.add_argument("--out-dir", default=_common.RESULTS, help="directory of the results files")
    args = parser.parse_args(argv)
    if not 0 <= args.kernel_time < 1:
        parser.error(f"--kernel-time must be seconds in [0, 1), got {args.kernel_time}")
    if args.quick:
        args.families, args.devices, args.presets = ["gpt", "bert"], [8, 16], ["v100"]
    if args.smoke:
        args.models, args.devices, args.presets = ["gpt-small"], [8], ["v100"]
        args.batch_size = args.batch_size or 64
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _common.use_cpu_devices(1)
    _common.RESULTS = args.out_dir  # write_markdown reads it at call time

    pairs = []
    for preset in args.presets:
        if args.models:
            pairs += [(m, preset, n) for m in args.models for n in args.devices]
        else:
            pairs += [(SIZES[args.sizes][f][n], preset, n) for f in args.families for n in args.devices]
    start = time.perf_counter()
    options: dict[str, Any] = dict(
        batch_size=args.batch_size,
        max_microbatches=args.max_microbatches,
        costs=args.costs,
        ilp_microbatches=tuple(args.ilp_microbatches),
    )
    if args.kernel_time:  # only then: journals of runs without it keep their keys
        options["kernel_time"] = args.kernel_time
    counts = {}  # one trace per model and dtype gives the clusterings of all its cells
    for m, p, _ in pairs:
        if (m, DTYPES[p]) not in counts:
            counts[m, DTYPES[p]] = layer_counts(m, p, options)
    # With ILP costs each microbatch count is a job of its own (and a journal record), so that
    # adding a count to a journaled run plans only the new count.
    per_count = (
        [(b,) for b in args.ilp_microbatches] if args.costs == "ilp" else [options["ilp_microbatches"]]
    )
    tasks = [
        ((m, p, n, num), {**options, "ilp_microbatches": bs})
        for m, p, n in pairs
        for num in counts[m, DTYPES[p]]
        for bs in per_count
    ]
    done = _journal.read(args.journal)
    reused = sum(_journal.key(task) in done for task in tasks)
    by_pair: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for (job, _), cell in _journal.run(
        plan_job,
        tasks,
        journal=args.journal,
        done=done,
        processes=args.jobs,
        initializer=_common.use_cpu_devices,
        initargs=(1,),
    ):
        by_pair.setdefault(job[:3], []).append(cell)
        print(
            " | ".join(map(str, table_row(cell))),
            f"(trace {cell['trace_seconds']:.1f} s, plan {cell['plan_seconds']:.1f} s)",
            flush=True,
        )
    cells = [combine(by_pair[pair]) for pair in pairs]
    elapsed = time.perf_counter() - start
    rows = [table_row(c) for c in cells]
    _common.print_table("plan quality (predicted step seconds)", HEADERS, rows)

    summary = summary_lines(
        cells, [(HEADLINE_FAMILIES, "GPT and BERT"), (("wresnet",), "Wide-ResNet"), (("moe",), "MoE")]
    )
    notes = results_notes(
        cells,
        costs=args.costs,
        ilp_microbatches=args.ilp_microbatches,
        summary=summary,
        elapsed=elapsed,
        reused=(reused, len(tasks)),
    )
    config = {
        "pairs": "; ".join(f"{m} on {n}x{p.upper()}" for m, p, n in pairs),
        "model sizes": {
            "shifted": "Alpa's 1/4/8/16-GPU models on 8/16/32/64 devices",
            "alpa": "Alpa's 8/16/32/64-GPU models",
        }[args.sizes]
        if not args.models
        else "given",
        "cluster presets": ", ".join(args.presets) + " (8 devices per host)",
        "compute dtype": ", ".join(f"{p}: {DTYPES[p]}" for p in args.presets) + "; float32 parameters, adamw",
        "global batch": str(args.batch_size) if args.batch_size else "GPT/BERT/MoE 1024, Wide-ResNet 1536",
        "microbatches": f"every divisor of the batch up to {args.max_microbatches}"
        if args.costs == "analytic"
        else ", ".join(map(str, args.ilp_microbatches)),
        "schedule": SCHEDULE,
        "GPT blocks": "rematerialised",
        "costs": "analytic (autopar._src.planner.stage_costs, tensor_parallel=True)"
        if args.costs == "analytic"
        else "sharding ILP per layer (benchmarks/_plan_ilp.py), microbatches "
        + ", ".join(map(str, args.ilp_microbatches)),
        "grids": "baselines.uniform_grid_plans: dp * tp * pp = N, pp <= layers, equal layers per stage",
        "time per kernel": f"{args.kernel_time * 1e6:.2f} us (DeviceSpec.kernel_time)"
        if args.kernel_time
        else "none (the presets')",
        "command": " ".join(["python benchmarks/plan_quality.py", *(sys.argv[1:] if argv is None else argv)]),
    }
    full = not args.models and (args.families, args.devices, args.presets) == (
        list(FAMILIES),
        list(DEVICE_COUNTS),
        ["v100", "h100"],
    )
    mode = "" if full else "_smoke" if args.smoke else "_quick" if args.quick else "_subset"
    name = (
        "plan_quality"
        + ("_ilp" if args.costs == "ilp" else "")
        + ("_alpa" if args.sizes == "alpa" and not args.models else "")
        + (
            ""
            if args.costs == "analytic" or args.ilp_microbatches == [64]
            else "_b" + "-".join(map(str, args.ilp_microbatches))
        )
        + ("_kernels" if args.kernel_time else "")
        + mode
    )
    title = "Plan quality: autopar vs Megatron-style grids and data parallel"
    path = _common.write_markdown(name, title, config, HEADERS, rows, "\n".join(notes))
    with open(path.removesuffix(".md") + ".json", "w") as f:
        json.dump({"config": config, "cells": cells}, f, indent=1)
    print(f"results: {path}")
    print(*summary, sep="\n")
    headline = margins(cells, HEADLINE_FAMILIES) or margins(cells, FAMILIES) or (math.nan,) * 3
    print(f"min_ratio_vs_best_grid={headline[0]:.4f}")


if __name__ == "__main__":
    main()
