"""The fixed cost of one task of autopar's driver on these devices, against the planner's constant.

The planner charges every forward or backward task a fixed ``task_overhead`` (the dispatch of
one compiled program; ``planner.DEFAULT_TASK_OVERHEAD``) on top of its FLOPs, memory traffic
and communication. This script measures it: a small MLP runs as one autopar stage on one
device (``--devices``) with 1, 2, 4, ... microbatches of the same global batch, so the work stays the same
while the number of tasks the driver runs (``Run`` instructions of the program) grows. The
slope of a least-squares line through (tasks, median step time) is the cost of one more task;
the intercept is what does not depend on them. For reference it also times the dispatch floor
of JAX itself: a chain of calls of a jitted ``x + 1`` on a small array, per call; and what each
argument or result buffer adds to a call: jitted functions of 1 to 1024 small arrays, each
returned plus one, chained, and a line fitted over the buffers in and out. A task of a large
model passes hundreds of buffers (its stage's weights, residuals and gradient sums), so that
slope, not the fixed cost, sets its dispatch time.

It uses ``jax.devices()``: with ``--platform default`` on a machine with a GPU it measures the
GPU's driver cost (a device count above what is there is capped).

    python benchmarks/task_overhead.py                          # one CPU device
    python benchmarks/task_overhead.py --platform default       # the default backend (e.g. a GPU)

The last line printed is ``task_overhead_us=<float>`` (the fitted slope, in microseconds).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402


def dispatch_floor(device: Any, *, calls: int = 200, rounds: int = 7) -> float:
    """Median seconds per call of a jitted ``x + 1`` on a 1024-element array, ``calls`` chained."""
    import jax
    import jax.numpy as jnp

    add = jax.jit(lambda x: x + 1)
    x = jax.device_put(jnp.zeros((1024,), jnp.float32), device)
    jax.block_until_ready(add(x))
    per_call = []
    for _ in range(rounds):
        y = x
        t0 = time.perf_counter()
        for _ in range(calls):
            y = add(y)
        jax.block_until_ready(y)
        per_call.append((time.perf_counter() - t0) / calls)
    return _common.summary(per_call)[0]


def dispatch_per_buffer(
    device: Any, *, widths: tuple[int, ...] = (1, 64, 256, 1024), calls: int = 30, rounds: int = 5
) -> tuple[float, dict[int, float]]:
    """``(seconds per buffer, {arrays: seconds per call})``: jitted functions of ``n`` small arrays
    that return each plus one, ``calls`` chained per timing; the slope is fitted over the ``2 n``
    buffers (in and out) of a call."""
    import jax
    import jax.numpy as jnp

    per_call: dict[int, float] = {}
    for n in widths:
        fn = jax.jit(lambda *xs: tuple(x + 1 for x in xs))
        xs = tuple(jax.device_put(jnp.zeros((16,), jnp.float32), device) for _ in range(n))
        jax.block_until_ready(fn(*xs))
        times = []
        for _ in range(rounds):
            ys = xs
            t0 = time.perf_counter()
            for _ in range(calls):
                ys = fn(*ys)
            jax.block_until_ready(ys)
            times.append((time.perf_counter() - t0) / calls)
        per_call[n] = _common.summary(times)[0]
    slope, _ = fit_line([2.0 * n for n in per_call], list(per_call.values()))
    return slope, per_call


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``(slope, intercept)`` of the least-squares line through ``(xs, ys)``.

    Raises:
      ValueError: with fewer than two distinct ``xs``.
    """
    import numpy as np

    if len(set(xs)) < 2:
        raise ValueError(f"a line needs at least two distinct task counts, got {xs}")
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(slope), float(intercept)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=1,
        help="devices of the stage (capped at those present); above 1 a task also reduces gradients",
    )
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--batch-size", type=int, default=128, help="global batch (divisible by each count)")
    parser.add_argument("--width", type=int, default=256, help="MLP width: small, so dispatch dominates")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--platform",
        choices=("cpu", "default"),
        default="cpu",
        help="cpu: simulated CPU devices; default: JAX's default backend (e.g. GPUs)",
    )
    parser.add_argument("--out-dir", default=_common.RESULTS, help="directory of the results file")
    args = parser.parse_args(argv)
    for m in args.microbatches:
        if m < 1 or args.batch_size % m:
            raise ValueError(
                f"--microbatches {m}: must be positive and divide --batch-size {args.batch_size}"
            )
    if args.platform == "cpu":
        _common.use_cpu_devices(args.devices)
    _common.RESULTS = args.out_dir  # write_markdown reads it at call time

    import jax
    import optax

    from autopar._src import bench, planner
    from autopar._src.api import autoparallel
    from autopar._src.program import Run, Transfer
    from models import train
    from models.mlp import MLPConfig

    devices = jax.devices()[: args.devices]
    n = len(devices)
    if args.batch_size % (n * max(args.microbatches)):
        raise ValueError(
            f"--batch-size {args.batch_size} must be divisible by {n} devices x "
            f"{max(args.microbatches)} microbatches"
        )
    config = MLPConfig(features=(args.width, args.width), in_features=args.width)
    step, state = train.setup("mlp", "linen", config, optax.sgd(0.1))
    batch = train.make_batch("mlp", config, args.batch_size)

    labels = {m: f"1 stage x {m} microbatch(es)" for m in args.microbatches}
    fns: dict[str, Any] = {}
    counts: dict[int, tuple[int, int]] = {}
    for m, label in labels.items():
        fn = autoparallel(step, num_stages=1, num_microbatches=m, devices=devices, sharding="data")
        instrs = fn.executable(state, batch).program.instrs
        counts[m] = (
            sum(isinstance(i, Run) for i in instrs),
            sum(isinstance(i, Transfer) for i in instrs),
        )
        fns[label] = fn
    states = {label: state for label in fns}

    def runner(label: str) -> Any:
        def run() -> Any:
            states[label], loss = fns[label](states[label], batch)
            return loss

        return run

    timed = {label: runner(label) for label in fns}
    for fn in timed.values():
        for _ in range(3):
            jax.block_until_ready(fn())
    times = bench.interleaved_times(timed, args.rounds)
    floor = dispatch_floor(devices[0])
    per_buffer, by_width = dispatch_per_buffer(devices[0])

    medians = {m: _common.summary(times[labels[m]])[0] for m in args.microbatches}
    slope, intercept = fit_line([counts[m][0] for m in args.microbatches], list(medians.values()))
    headers = ["configuration", "tasks run", "transfers", "median ms", "p10 ms", "p90 ms"]
    rows = []
    for m, label in labels.items():
        med, p10, p90 = _common.summary(times[label])
        rows.append(
            [label, counts[m][0], counts[m][1], f"{med * 1e3:.3f}", f"{p10 * 1e3:.3f}", f"{p90 * 1e3:.3f}"]
        )
    _common.print_table("task overhead", headers, rows)
    default_us = planner.DEFAULT_TASK_OVERHEAD * 1e6
    lines = [
        f"fitted cost per task: {slope * 1e6:.1f} us (intercept {intercept * 1e3:.3f} ms); "
        f"the planner's constant: {default_us:.1f} us",
        f"jax.jit dispatch floor (x + 1, chained): {floor * 1e6:.1f} us per call",
        f"jax.jit per buffer in or out: {per_buffer * 1e6:.2f} us (calls of n arrays: "
        + ", ".join(f"{n}: {t * 1e6:.0f} us" for n, t in by_width.items())
        + ")",
    ]
    path = _common.write_markdown(
        "task_overhead",
        "Fixed cost of one driver task vs the planner's constant",
        {
            "model": f"MLP {config.in_features} -> {config.features} -> {config.num_classes}, sgd",
            "stage": f"one autopar stage over {n} device(s), sharding='data'",
            "global batch": args.batch_size,
            "microbatches": args.microbatches,
            "rounds": f"{args.rounds} (configurations alternate every round, 3 warm-up steps each)",
            "fit": "least squares of median step time over tasks run (Run instructions per step)",
            "command": "python benchmarks/task_overhead.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
        },
        headers,
        rows,
        notes="\n".join(lines)
        + f"\n\nDevices: {n} x {devices[0].device_kind}. On simulated CPU devices the tasks of "
        "all devices share the host's cores, so the slope includes their compute contention.",
    )
    for line in lines:
        print(line)
    print(f"wrote {path}")
    print(f"dispatch_per_buffer_us={per_buffer * 1e6:.2f}")
    print(f"task_overhead_us={slope * 1e6:.1f}")


if __name__ == "__main__":
    main()
