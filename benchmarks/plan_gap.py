"""Where the step time of autopar's plan goes, against the lower bound on any plan.

One plan-quality cell (``plan_quality.py --costs ilp``: every layer priced by the sharding ILP)
on one clustering. The stage DP is exact for its costs, so this says what any plan of
contiguous stages on these submeshes under 1F1B gives up against the bound (one device's
forward and backward of every layer, times the microbatches, over the devices):

    step / bound = bubble x imbalance x inefficiency

- **bubble**: ``(sum of stage latencies + (B - 1) * slowest) / (B * slowest)``, the 1F1B
  fill and drain;
- **imbalance**: the slowest stage against the device-weighted mean stage latency;
- **inefficiency**: the stages' device-seconds per microbatch over one device's seconds
  (communication, the activations each stage sends, per-task overhead, layouts that do not
  divide the work evenly).

    python benchmarks/plan_gap.py --model wresnet-1b --preset v100 --devices 16 --layers 32

Each run takes minutes (the ILP prices every layer on every mesh). The last line is
``gap=<step / bound>``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402


def decompose(
    costs, one, solution, num_microbatches: int, num_devices: int
) -> tuple[dict[str, float], list[list[str]]]:
    """The step, the bound and the factors of one over the other, and a table row per stage.

    ``one``: each layer's seconds on one device (the ILP on a 1x1 mesh).
    """
    rows, device_seconds, latencies = [], 0.0, []
    for st in solution.stages:
        hosts, width = costs.submeshes[st.submesh]
        n = hosts * width
        latency = float(costs.latency[st.start, st.stop - 1, st.submesh, st.logical])
        work = float(one[st.start : st.stop].sum())
        device_seconds += n * latency
        latencies.append(latency)
        rows.append(
            [
                f"{st.start}-{st.stop - 1}",
                f"{hosts}x{width}",
                "x".join(map(str, costs.logical[st.submesh][st.logical])),
                f"{latency * 1e3:.3f}",
                f"{work / n * 1e3:.3f}",
                f"{work / n / latency:.3f}",
            ]
        )
    slowest, b = max(latencies), num_microbatches
    step = sum(latencies) + (b - 1) * slowest
    factors = {
        "step": step,
        "bound": float(one.sum()) * b / num_devices,
        "bubble": step / (b * slowest),
        "imbalance": slowest / (device_seconds / num_devices),
        "inefficiency": device_seconds / float(one.sum()),
    }
    return factors, rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="wresnet-1b")
    parser.add_argument("--preset", default="v100", choices=["v100", "h100"])
    parser.add_argument("--devices", type=int, default=16)
    parser.add_argument("--layers", type=int, default=None, help="clustering (default: the first automatic)")
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--out-dir", default=_common.RESULTS, help="directory of the results file")
    args = parser.parse_args()
    _common.use_cpu_devices(1)
    _common.RESULTS = args.out_dir  # write_markdown reads it at call time

    from autopar._src import baselines
    from benchmarks import _plan_cell, _plan_ilp

    dtype = _plan_cell.DTYPES[args.preset]
    step, state, batch, _, batch_size = _plan_cell.abstract_step(args.model, dtype)
    if batch_size % args.microbatches:
        raise ValueError(f"--microbatches {args.microbatches} does not divide the batch of {batch_size}")
    spec = _plan_cell._cluster(args.preset, args.devices)
    free, pinned, prof, traced = _plan_ilp.ilp_costs(
        step,
        state,
        batch,
        spec,
        batch_size=batch_size,
        num_microbatches=args.microbatches,
        dtype=dtype,
        num_layers=args.layers,
    )
    one = _plan_ilp.one_device(traced, spec, num_microbatches=args.microbatches, dtype=dtype)
    common = _plan_cell.stage_options(spec, free, args.microbatches)
    sol = _plan_cell.solve(free, common)
    grids = baselines.uniform_grid_plans(
        pinned.latency, pinned.param_memory, pinned.activation_memory, logical_shapes=pinned.logical, **common
    )
    best_grid = min((g.objective for g in grids.values() if g is not None), default=float("inf"))
    gap, rows = decompose(free, one, sol, args.microbatches, spec.num_devices)
    headers = ["layers", "submesh", "mesh (dp x tp)", "latency ms", "one device / n ms", "efficiency"]
    ratio = gap["step"] / gap["bound"]
    summary = (
        f"step {gap['step']:.4g} s, bound {gap['bound']:.4g} s, best grid on these layers {best_grid:.4g} s "
        f"(best grid / autopar {best_grid / gap['step']:.3f}); step / bound {ratio:.3f} = "
        f"bubble {gap['bubble']:.3f} x imbalance {gap['imbalance']:.3f} x inefficiency "
        f"{gap['inefficiency']:.3f}"
    )
    _common.print_table(f"{args.model} on {spec.name}: {prof.num_layers} layers", headers, rows)
    print(summary)
    tag = f"{args.model}_{args.devices}x{args.preset}_{prof.num_layers}l"
    path = _common.write_markdown(
        f"plan_gap_{tag}",
        f"Where autopar's step goes: {args.model} on {spec.name}",
        {
            "model": args.model,
            "cluster": spec.name,
            "compute dtype": dtype,
            "global batch": batch_size,
            "microbatches": args.microbatches,
            "layers": prof.num_layers,
            "costs": "sharding ILP per layer (benchmarks/_plan_ilp.py), as plan_quality.py --costs ilp",
            "command": "python benchmarks/plan_gap.py " + " ".join(sys.argv[1:]),
        },
        headers,
        rows,
        notes=summary + "\n\n" + __doc__.split("\n\n    python")[0],
    )
    print(f"results: {path}")
    print(f"gap={ratio:.4f}")


if __name__ == "__main__":
    main()
