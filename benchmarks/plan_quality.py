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
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common, _journal, _plan_ilp  # noqa: E402
from benchmarks._plan_table import (  # noqa: E402
    HEADERS,
    combine,
    faster,
    grid_name,
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
DTYPES = {"v100": "float16", "h100": "bfloat16", "a100": "bfloat16", "cpu": "float32"}
"""Compute dtype per preset: V100 has no bfloat16 arithmetic."""
SCHEDULE = "1f1b"
HEADLINE_FAMILIES = ("gpt", "bert")


def abstract_step(model: str, dtype: str, batch_size: int | None = None):
    """``(step, state, batch, kind, batch_size)`` of a preset, all abstract (nothing allocated).

    GPT blocks are rematerialised, as large GPTs are trained.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from models import registry, train

    kind, config = registry.lookup(model)
    overrides: dict[str, Any] = {"dtype": jnp.dtype(dtype)}
    if kind == "gpt":
        overrides["remat"] = True
    config = type(config).preset(model, **overrides)
    batch_size = batch_size or registry.DEFAULT_BATCH[kind]
    sample = train.make_batch(kind, config, 2)
    batch = {k: jax.ShapeDtypeStruct((batch_size, *v.shape[1:]), v.dtype) for k, v in sample.items()}
    state = jax.eval_shape(lambda: train.linen_state(kind, config, optax.adamw(1e-4)))
    return train.linen_step(kind), state, batch, kind, batch_size


def _stage_search(costs, common: dict[str, Any]) -> dict[str, Any] | None:
    """autopar's stage DP on one microbatch count's costs, as plain data (None if nothing fits)."""
    from autopar._src import stages

    try:
        sol = stages.solve_stages(
            costs.latency,
            costs.param_memory,
            costs.activation_memory,
            **common,
            submesh_shapes=costs.submeshes,
            logical_shapes=costs.logical,
        )
    except stages.NoFeasiblePlanError:
        return None
    return {
        "seconds": sol.objective,
        "microbatches": common["num_microbatches"],
        "layers": len(costs.latency),
        "stages": [
            {
                "layers": [c.start, c.stop],
                "submesh": list(costs.submeshes[c.submesh]),
                "logical": list(costs.logical[c.submesh][c.logical]),
            }
            for c in sol.stages
        ],
    }


def _cluster(preset: str, num_devices: int):
    from autopar._src.cluster import preset as cluster_preset

    per_host = min(num_devices, 8)
    return cluster_preset(preset, num_devices // per_host, devices_per_host=per_host)


def _ilp_candidates(batch_size: int, ilp_microbatches: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(b for b in ilp_microbatches if batch_size % b == 0)


def _flops_bound(prof, spec) -> float:
    """The analytic costs' lower bound on any plan's step: the step's FLOPs over all devices'
    peak (every stage's compute term is its FLOPs over its devices' peak)."""
    flops = float((prof.forward_flops + prof.backward_flops).sum())
    return flops / (spec.num_devices * spec.device.flops(prof.dtype))


def plan_cell(
    model: str,
    preset: str,
    num_devices: int,
    *,
    batch_size: int | None = None,
    max_microbatches: int = 64,
    costs: str = "analytic",
    ilp_microbatches: tuple[int, ...] = (64,),
    num_layers: int | None = None,
) -> dict[str, Any]:
    """Traces, profiles and plans one (model, cluster) cell on one clustering (``num_layers``
    layers; None: the first automatic one); returns its results as plain data.

    ``costs="ilp"`` prices both sides with the sharding ILP (see ``benchmarks/_plan_ilp.py``)
    at the microbatch counts ``ilp_microbatches``. :func:`combine` takes a cell's clusterings.
    """
    import numpy as np

    from autopar._src import baselines, planner

    t0 = time.perf_counter()
    step, state, batch, kind, batch_size = abstract_step(model, DTYPES[preset], batch_size)
    spec = _cluster(preset, num_devices)
    if costs == "ilp":
        candidates = _ilp_candidates(batch_size, ilp_microbatches)
        priced, bounds = {}, []
        for b in candidates:
            free, pinned, prof, traced = _plan_ilp.ilp_costs(
                step,
                state,
                batch,
                spec,
                batch_size=batch_size,
                num_microbatches=b,
                dtype=DTYPES[preset],
                num_layers=num_layers,
            )
            # On the microbatch just traced: the bound only adds each layer's (trivial) 1x1 solve.
            bounds.append(_plan_ilp.step_bound(traced, spec, num_microbatches=b, dtype=DTYPES[preset]))
            data_parallel = np.array(
                [[s[1] == 1 for s in q] + [False] * (free.latency.shape[3] - len(q)) for q in free.logical]
            )
            only_dp = dataclasses.replace(free, latency=np.where(data_parallel, free.latency, np.inf))
            priced[b] = {"autopar": free, "autopar_tp1": only_dp, "grids": pinned}
    else:
        prof = _plan_ilp.trace_microbatch(
            step, state, batch, batch_size=batch_size, num_microbatches=1, num_layers=num_layers
        )[1]
        bounds = [_flops_bound(prof, spec)]
        candidates = planner.microbatch_candidates(batch_size, max_microbatches=max_microbatches)
    trace_seconds = time.perf_counter() - t0

    t1 = time.perf_counter()
    found: dict[str, dict[str, Any] | None] = {"autopar": None, "autopar_tp1": None}
    grids: dict[tuple[int, int, int], dict[str, Any] | None] = {}
    for b in candidates:
        if costs == "ilp":
            plans = priced[b]
        else:
            tp, dp = (
                planner.stage_costs(prof, spec, num_microbatches=b, batch_scale=1.0 / b, tensor_parallel=t)
                for t in (True, False)
            )
            plans = {"autopar": tp, "autopar_tp1": dp, "grids": tp}
        for role, c in plans.items():
            common = dict(
                memory_budget=float(spec.device.memory_bytes),
                num_devices=spec.num_devices,
                num_microbatches=b,
                schedule=SCHEDULE,
                submesh_devices=[h * d for h, d in c.submeshes],
            )
            if role == "grids":  # Megatron-style grids
                arrays = (c.latency, c.param_memory, c.activation_memory)
                for grid, g in baselines.uniform_grid_plans(
                    *arrays, logical_shapes=c.logical, **common
                ).items():
                    grid_plan = (
                        None
                        if g is None
                        else {"seconds": g.objective, "microbatches": b, "layers": prof.num_layers}
                    )
                    grids[grid] = faster(grids.get(grid), grid_plan)
                continue
            found[role] = faster(found[role], _stage_search(c, common))
    plan_seconds = time.perf_counter() - t1
    return {
        "model": model,
        "family": kind,
        "preset": preset,
        "devices": num_devices,
        "cluster": spec.name,
        "dtype": DTYPES[preset],
        "batch": batch_size,
        "layers": prof.num_layers,
        "costs": costs,
        "microbatch_candidates": list(candidates),
        "autopar": found["autopar"],
        "autopar_tp1": found["autopar_tp1"],
        "grids": {grid_name(k): v for k, v in grids.items()},
        "bound": min(bounds),
        "trace_seconds": trace_seconds,
        "plan_seconds": plan_seconds,
    }


def layer_counts(model: str, preset: str, options: dict[str, Any]) -> tuple[int, ...]:
    """The automatic clusterings' layer counts of a cell (``clustering.BYTES_FACTORS``), on the
    microbatch :func:`plan_cell` traces first."""
    step, state, batch, _, batch_size = abstract_step(model, DTYPES[preset], options["batch_size"])
    b = 1 if options["costs"] == "analytic" else _ilp_candidates(batch_size, options["ilp_microbatches"])[0]
    traced = _plan_ilp.trace_microbatch(step, state, batch, batch_size=batch_size, num_microbatches=b)[0]
    info = traced.jaxpr.eqns[traced.region_index()].params["info"]
    return (len(info.cuts) + 1, *info.other_layer_counts)


def _plan_job(model: str, preset: str, num_devices: int, num_layers: int, **options: Any) -> dict[str, Any]:
    """:func:`plan_cell` of one journal task (job ``(model, preset, devices, layers)``)."""
    return plan_cell(model, preset, num_devices, num_layers=num_layers, **options)


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
    parser.add_argument("--out-dir", default=_common.RESULTS, help="directory of the results files")
    args = parser.parse_args(argv)
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
    options = dict(
        batch_size=args.batch_size,
        max_microbatches=args.max_microbatches,
        costs=args.costs,
        ilp_microbatches=tuple(args.ilp_microbatches),
    )
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
        _plan_job,
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
