"""Step time of autopar plans vs jax.jit with the same shardings on the same devices.

The one-stage, one-microbatch plan is data parallel over all devices, exactly what
``jax.jit`` does with the batch sharded and the state replicated: their ratio is
autopar's runtime overhead (target <= 1.05). 2- and 4-stage pipelines are shown
for reference (on simulated CPU devices that share the host's cores a pipeline
is not expected to be faster).

    python benchmarks/runtime_overhead.py [--model gpt-small] [--batch-size 32] [--rounds 30]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gpt-small", help="GPT preset (default gpt-small)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    _common.use_cpu_devices(args.devices)

    import optax

    from autopar._src import bench
    from models import train

    config = train.GPTConfig.preset(args.model)
    step, state = train.setup("gpt", "linen", config, optax.adamw(1e-3))
    batch = train.make_batch("gpt", config, args.batch_size)
    configs = {
        "autopar 1 stage x 1 microbatch": dict(num_stages=1, num_microbatches=1, sharding="data"),
        "autopar 2 stages x 4 microbatches (1f1b)": dict(num_stages=2, num_microbatches=4, sharding="data"),
        "autopar 4 stages x 4 microbatches (1f1b)": dict(num_stages=4, num_microbatches=4, sharding="data"),
    }
    times = bench.step_times(step, state, batch, configs, rounds=args.rounds)
    base = _common.summary(times[bench.JIT])[0]
    headers = ["configuration", "median ms", "p10 ms", "p90 ms", "ratio vs jax.jit"]
    rows = []
    for name in times:
        med, p10, p90 = _common.summary(times[name])
        rows.append([name, f"{med * 1e3:.1f}", f"{p10 * 1e3:.1f}", f"{p90 * 1e3:.1f}", f"{med / base:.3f}"])
    _common.print_table("runtime overhead", headers, rows)
    path = _common.write_markdown(
        "runtime_overhead",
        "autopar runtime overhead vs jax.jit",
        {
            "model": f"{args.model} ({config.num_layers} layers, hidden {config.hidden}, "
            f"seq {config.max_len}, vocab {config.vocab_size})",
            "batch size": args.batch_size,
            "optimizer": "adamw",
            "rounds": f"{args.rounds} (configurations alternate every round)",
            "command": f"python benchmarks/runtime_overhead.py --model {args.model} --batch-size "
            f"{args.batch_size} --rounds {args.rounds}",
        },
        headers,
        rows,
        notes="Target: one-stage ratio <= 1.05. Simulated CPU devices share the host's cores, so "
        "pipelines add dispatch and transfers without adding compute; their ratios are for reference.",
    )
    one = float(rows[1][-1])
    print(f"results: {path}")
    print(f"one_stage_ratio={one:.3f}")


if __name__ == "__main__":
    main()
