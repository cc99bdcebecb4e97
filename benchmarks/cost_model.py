"""Predicted vs measured time of single stages: how well the analytic cost model matches the devices.

For each model and each submesh of 1, 2, 4 and 8 devices, the whole train step runs as one
autopar stage (data parallel over the submesh; one microbatch, or each of ``--microbatches``)
and its median step time is measured with :func:`autopar._src.measure.measure`, one
configuration at a time so that no two share the host. The same step is traced and profiled
as the planner sees it, and :func:`autopar._src.planner.stage_costs` predicts the latency of
that stage on that submesh (logical mesh ``(n, 1)``; ``m`` microbatches take ``m`` times the
latency of one), with a calibrated cluster spec (``autopar calibrate``, quick) and with
the platform's preset. The ratio is predicted / measured: above 1 the model is pessimistic.

It uses ``jax.devices()``: with ``--platform default`` on a machine with GPUs the same script
compares the model with the accelerators (device counts above what is there are skipped).

    python benchmarks/cost_model.py                              # 5 models x 1, 2, 4, 8 CPU devices
    python benchmarks/cost_model.py --models gpt-tiny --devices 1 2 --runs 3
    python benchmarks/cost_model.py --cluster-file cluster.json  # a saved calibration instead
    python benchmarks/cost_model.py --platform default           # the default backend (e.g. GPUs)
    python benchmarks/cost_model.py --measured-from benchmarks/results/cost_model_gpu1_2026-11-26.md \
        --cluster-file benchmarks/results/calibrate_h200_gpu1_2026-11-26.json --preset h200 --batch-size 8
                                          # re-predict recorded GPU measurements, on any machine

The last line printed is ``median_ratio=<float>`` (calibrated predictions when there are some,
else the preset's).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402
from benchmarks._cost_cases import LARGE_MODEL_NAMES, MODEL_NAMES, Case, build_cases  # noqa: E402


def read_measurements(path: str) -> dict[tuple[str, int, int], float]:
    """``(model, devices, microbatches) -> measured seconds`` from the table of a results file of
    this script (files without a microbatches column measured one).

    Raises:
      ValueError: if the file has no such table.
    """
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.startswith("|")]
    headers = [c.strip() for c in lines[0].strip("|").split("|")] if lines else []
    with_microbatches = headers[:4] == ["model", "devices", "microbatches", "measured ms"]
    if not with_microbatches and headers[:3] != ["model", "devices", "measured ms"]:
        raise ValueError(
            f"{path} has no 'model | devices | [microbatches |] measured ms' table; pass a cost_model "
            "results file"
        )
    rows = ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])
    if with_microbatches:
        return {(r[0], int(r[1]), int(r[2])): float(r[3]) / 1e3 for r in rows}
    return {(r[0], int(r[1]), 1): float(r[2]) / 1e3 for r in rows}


def _measure(cases: list[Case], args: Any) -> tuple[list[float], Any]:
    """Median seconds of each case's step, one at a time, and the cost cache's counts."""
    from autopar._src import measure

    with tempfile.TemporaryDirectory(prefix="autopar-costs-") as tmp:
        cache = measure.CostCache(args.cache_dir or tmp)
        seconds = measure.measure_many(
            [(c.label, c.fn, c.args, c.key) for c in cases],
            cache,
            progress=args.progress,
            warmup=args.warmup,
            runs=args.runs,
        )
        return seconds, cache.stats


def _case_key(case: Case) -> tuple[str, int, int]:
    return case.model, case.num_devices, case.num_microbatches


def _spread(ratios: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(ratios, n=10, method="inclusive") if len(ratios) >= 2 else [ratios[0]] * 9
    return {
        "median": statistics.median(ratios),
        "p10": qs[0],
        "p90": qs[-1],
        "min": min(ratios),
        "max": max(ratios),
    }


def _config_text(config: Any) -> str:
    fields = [f for f in dataclasses.fields(config) if isinstance(getattr(config, f.name), int | tuple)]
    inner = ", ".join(f"{f.name}={getattr(config, f.name)}" for f in fields)
    return f"{type(config).__name__}({inner})"


def _spec_text(spec: Any) -> str:
    peaks = ", ".join(f"{d} {f / 1e9:.1f} GFLOP/s" for d, f in spec.device.peak_flops)
    return (
        f"{spec.name}: {peaks}; memory {spec.device.memory_bandwidth / 1e9:.1f} GB/s; intra-host link "
        f"{spec.intra_host_bandwidth / 1e9:.2f} GB/s, {spec.intra_host_latency * 1e6:.1f} us; "
        f"{spec.device.kernel_time * 1e6:.2f} us per kernel"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", nargs="+", default=list(MODEL_NAMES), choices=MODEL_NAMES + LARGE_MODEL_NAMES
    )
    parser.add_argument("--devices", nargs="+", type=int, default=[1, 2, 4, 8], help="submesh sizes")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--microbatches",
        type=int,
        nargs="+",
        default=[1],
        help="microbatch counts of the stage (above 1: one task per microbatch, forward and backward joined)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (the first compiles)")
    parser.add_argument("--runs", type=int, default=7, help="timed steps; the median is kept")
    parser.add_argument("--cluster-file", help="a saved ClusterSpec JSON (e.g. from `autopar calibrate`)")
    parser.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="without --cluster-file, predict with the preset only",
    )
    parser.add_argument("--cache-dir", help="cost cache directory to reuse (default: a fresh temporary one)")
    parser.add_argument(
        "--platform",
        choices=("cpu", "default"),
        default="cpu",
        help="cpu: 8 simulated CPU devices; default: JAX's default backend (e.g. GPUs)",
    )
    parser.add_argument(
        "--measured-from",
        metavar="RESULTS_MD",
        help="predict the measurements of an earlier results file instead of measuring (e.g. a GPU "
        "run re-predicted after a cost-model change); needs --cluster-file and --preset",
    )
    parser.add_argument("--preset", help="with --measured-from: the preset of the devices it measured")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.add_argument("--out-dir", default=_common.RESULTS, help="directory of the results file")
    args = parser.parse_args(argv)
    recorded = read_measurements(args.measured_from) if args.measured_from else None
    if recorded is not None:
        if not (args.cluster_file and args.preset):
            raise ValueError(
                f"--measured-from {args.measured_from} needs --cluster-file (the measured devices' "
                "calibration) and --preset (their preset); the devices here are not the ones measured"
            )
        args.models = list(dict.fromkeys(m for m, _, _ in recorded))
        args.devices = sorted({n for _, n, _ in recorded})
        args.microbatches = sorted({m for _, _, m in recorded})
    if args.platform == "cpu":
        _common.use_cpu_devices(8)
    _common.RESULTS = args.out_dir  # write_markdown reads it at call time

    import jax

    from autopar._src import calibrate, cluster, planning

    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    devices = jax.devices()
    counts = [n for n in args.devices if recorded is not None or n <= len(devices)]
    if len(counts) < len(args.devices):
        skipped = sorted(set(args.devices) - set(counts))
        print(f"skipping device counts {skipped}: only {len(devices)} devices")
    if not counts:
        raise ValueError(f"--devices {args.devices}: none fits the {len(devices)} available devices")

    if recorded is not None:
        preset = cluster.preset(args.preset, devices_per_host=max(counts))
    else:
        preset = planning.cluster_for(devices)
    specs: dict[str, Any] = {}
    calibration_seconds = 0.0
    if args.cluster_file:
        specs["calibrated"] = cluster.ClusterSpec.load(args.cluster_file)
        calibrated_from = f"--cluster-file {args.cluster_file}"
    elif args.calibrate:
        t0 = time.perf_counter()
        specs["calibrated"] = calibrate.calibrate(devices, quick=True, progress=False)
        calibration_seconds = time.perf_counter() - t0
        calibrated_from = f"calibrate(quick=True) on {len(devices)} devices, {calibration_seconds:.0f} s"
    else:
        calibrated_from = "none (--no-calibrate)"
    specs["preset"] = preset
    main_spec = "calibrated" if "calibrated" in specs else "preset"

    cases: list[Case] = []
    infos: dict[str, dict[str, Any]] = {}
    for name in args.models:
        model_cases, infos[name] = build_cases(
            name,
            device_counts=counts,
            batch_size=args.batch_size,
            microbatch_counts=tuple(args.microbatches),
            specs=specs,
            runnable=recorded is None,
        )
        cases += [c for c in model_cases if recorded is None or _case_key(c) in recorded]

    if recorded is not None:
        seconds = [recorded[_case_key(c)] for c in cases]
        stats = None
    else:
        seconds, stats = _measure(cases, args)

    headers = ["model", "devices", "microbatches", "measured ms"]
    if "calibrated" in specs:
        headers += ["predicted ms (calibrated)", "ratio (calibrated)", "compute share (calibrated)"]
    headers += ["predicted ms (preset)", "ratio (preset)"]
    rows = []
    ratios: dict[str, list[float]] = {label: [] for label in specs}
    for c, measured in zip(cases, seconds, strict=True):
        row: list[Any] = [c.model, c.num_devices, c.num_microbatches, f"{measured * 1e3:.2f}"]
        for label in ("calibrated", "preset"):
            if label not in specs:
                continue
            ratio = c.predicted[label] / measured
            ratios[label].append(ratio)
            row += [f"{c.predicted[label] * 1e3:.2f}", f"{ratio:.2f}"]
            if label == "calibrated":
                row.append(f"{c.predicted_compute[label] / c.predicted[label]:.2f}")
        rows.append(row)
    spreads = {label: _spread(r) for label, r in ratios.items()}
    elapsed = time.perf_counter() - start
    _common.print_table("cost model: predicted vs measured single-stage step time", headers, rows)

    summary_lines = [
        f"{label}: median ratio {s['median']:.3f}, p10 {s['p10']:.3f}, p90 {s['p90']:.3f}, "
        f"min {s['min']:.3f}, max {s['max']:.3f} (predicted / measured, {len(ratios[label])} stages)"
        for label, s in spreads.items()
    ]
    paired = list(zip(cases, ratios[main_spec], strict=True))
    by_count = [
        f"{main_spec}, {n} device(s): median ratio "
        f"{statistics.median(r for c, r in paired if c.num_devices == n):.3f}"
        for n in counts
    ]
    summary_lines += by_count
    headline = spreads[main_spec]
    tail = [
        f"spread ({main_spec}): min={headline['min']:.3f} p10={headline['p10']:.3f} "
        f"p90={headline['p90']:.3f} max={headline['max']:.3f}",
        f"median_ratio={headline['median']:.3f}",
    ]
    platform = devices[0].platform
    notes = "\n".join(
        [
            "Ratio = predicted / measured step time (above 1: the model is pessimistic). Compute share = "
            "the part of the calibrated prediction that is FLOPs over peak and memory traffic over "
            "bandwidth; the rest is the gradient all-reduce, boundary sends and a fixed 0.1 ms per task.",
            "",
            f"Measurements read from {args.measured_from} (recorded there, not taken here); the "
            "predictions are this version's."
            if recorded is not None
            else f"These {len(devices)} {platform} devices are simulated on a host with "
            f"{os.cpu_count()} cores: "
            "the cost model divides a stage's FLOPs over its devices as if each had its own cores, so "
            "on this machine predictions fall increasingly below the measurement as the submesh grows "
            "past the core count, and the gradient all-reduce between simulated devices is memory "
            "copies on the same cores."
            if platform == "cpu"
            else f"Devices: {len(devices)} x {devices[0].device_kind}.",
            "",
            "The script uses `jax.devices()`: on a machine with a GPU the same script applies with "
            "`--platform default` (device counts beyond the GPUs present are skipped), comparing the "
            "model with the accelerators instead of simulated CPU devices.",
            "",
            *summary_lines,
            "",
            *tail,
        ]
    )
    stem = os.path.splitext(os.path.basename(args.measured_from or ""))[0]
    path = _common.write_markdown(
        "cost_model_repredicted_" + stem.removeprefix("cost_model_")
        if recorded is not None
        else "cost_model",
        "Cost model: predicted vs measured single-stage step time",
        {
            "models": "; ".join(
                f"{n} ({i['layers']} layers, {i['gflops']:.3f} GFLOP/step fwd+bwd, "
                f"{i['param_mib']:.2f} MiB params): {_config_text(i['config'])}"
                for n, i in infos.items()
            ),
            "stage": "whole step as one autopar stage (num_stages=1, num_microbatches in "
            f"{args.microbatches}) on jax.devices()[:n], batch split over a ('data',) mesh, state replicated",
            "device counts": ", ".join(map(str, counts)),
            "batch size": args.batch_size,
            "optimizer": "optax.sgd(0.1), float32",
            "timing": f"measure(): median of {args.runs} steps after {args.warmup} warm-up steps, one "
            "configuration at a time",
            "prediction": "m * planner.stage_costs(step_profile(...), spec, num_microbatches=m, "
            "batch_scale=1/m, tensor_parallel=False).latency[0, L-1, submesh (1, n), logical (n, 1)]",
            "calibrated spec": (_spec_text(specs["calibrated"]) if "calibrated" in specs else "none")
            + f" (from {calibrated_from})",
            "preset spec": _spec_text(preset),
            "cost cache": f"{args.cache_dir or 'temporary directory'}: {stats.hits} hits, "
            f"{stats.misses} misses, {stats.writes} writes"
            if stats is not None
            else "none (measurements read from a file)",
            "runtime": f"{elapsed:.0f} s in all",
            # Other work on the host shows up in the measured times (not in the predictions).
            "host load": f"1-minute load average {load_before:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} cores)",
            "command": " ".join(
                ["python benchmarks/cost_model.py", *(sys.argv[1:] if argv is None else argv)]
            ),
        },
        headers,
        rows,
        notes=notes,
    )
    for line in summary_lines:
        print(line)
    print(f"results: {path} ({elapsed:.0f} s)")
    for line in tail:
        print(line)


if __name__ == "__main__":
    main()
