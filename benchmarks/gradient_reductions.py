"""Gradient all-reduces deferred to the last microbatch vs reduced in every microbatch.

One data-parallel stage over 8 simulated CPU devices with several microbatches: the same
plan and layouts, run by the driver both ways (``Executable.defer_reductions``), and
``jax.jit`` of the whole batch (state replicated, batch split) for reference. The table gives
the all-reduce instructions of one step (summed over the compiled tasks; XLA combines the
all-reduces of one task into one) and the step times, measured alternating round by round.

    python benchmarks/gradient_reductions.py [--microbatches 8] [--hidden 1024] [--batch-size 8192]
    python benchmarks/gradient_reductions.py --model gpt-remat --hidden 256 --batch-size 256 --rounds 10

``--model gpt-remat`` is a two-block GPT (sequences of 32 tokens, vocabulary 1024) with
rematerialised blocks, whose weight gradients are made inside the blocks' backward calls.

The last line printed is ``deferred_speedup=<float>``: the per-microbatch step time over the
deferred one.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402

ALL_REDUCE = re.compile(r"= (\([^)]*\)|[a-z0-9]+\[[0-9,]*\]\S*) all-reduce\(")
ARRAY = re.compile(r"[a-z]+([0-9]*)\[([0-9,]*)\]")


def all_reduced(hlo: str) -> tuple[int, int]:
    """``(all-reduce instructions, bytes of their results)`` in compiled HLO text."""
    count = size = 0
    for match in ALL_REDUCE.finditer(hlo):
        count += 1
        for bits, dims in ARRAY.findall(match[1]):
            elements = math.prod(int(d) for d in dims.split(",") if d)
            size += elements * max(int(bits or 8), 8) // 8
    return count, size


def _all_reduces(exe) -> tuple[int, int]:
    """:func:`all_reduced` summed over the tasks that one step of ``exe`` runs."""
    found = [
        all_reduced(fn.lower(*exe.abstract_inputs(i)).compile().as_text()) for i, fn in enumerate(exe.fns)
    ]
    return sum(c for c, _ in found), sum(b for _, b in found)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--model", choices=["mlp", "gpt-remat"], default="mlp")
    parser.add_argument(
        "--hidden", type=int, default=1024, help="width of the MLP's three layers or the GPT's"
    )
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--out-dir", default=_common.RESULTS, help="directory of the results file")
    args = parser.parse_args()
    _common.RESULTS = args.out_dir  # write_markdown reads it at call time
    _common.use_cpu_devices(args.devices)

    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import autopar
    from models import train
    from models.gpt import GPTConfig
    from models.mlp import MLPConfig

    if args.model == "mlp":
        kind, what = "mlp", f"MLP, 3 layers of width {args.hidden}"
        config = MLPConfig(features=(args.hidden,) * 2, in_features=args.hidden, num_classes=args.hidden)
    else:
        heads = max(args.hidden // 64, 1)
        config = GPTConfig(
            vocab_size=1024, num_layers=2, num_heads=heads, hidden=args.hidden, max_len=32, remat=True
        )
        kind, what = "gpt", f"GPT, 2 rematerialised blocks of width {args.hidden}, 32 tokens, vocabulary 1024"
    step, state = train.setup(kind, "linen", config, optax.adamw(1e-3))
    batch = train.make_batch(kind, config, args.batch_size)
    par = autopar.autoparallel(
        step, num_stages=1, num_microbatches=args.microbatches, mesh_shape=(args.devices,)
    )
    deferred = par.executable(state, batch)
    eager = dataclasses.replace(deferred, defer_reductions=False)
    kept = sum(len(d.accumulators) for d in deferred.deferred)
    grads = len(jax.tree.leaves(state.params))
    num_params = sum(x.size for x in jax.tree.leaves(state.params))

    def driver_step(exe):
        current = {"state": state}

        def run():
            new_state, loss = jax.tree.unflatten(
                exe.step.out_tree, exe(jax.tree.leaves((current["state"], batch)))
            )
            current["state"] = new_state
            return loss

        return run

    mesh = Mesh(np.array(jax.devices()), ("data",))
    jitted = jax.jit(step)
    ref = {"state": jax.device_put(state, NamedSharding(mesh, PartitionSpec()))}
    ref_batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))

    def jit_step():
        ref["state"], loss = jitted(ref["state"], ref_batch)
        return loss

    names = {
        "deferred": f"autopar, {args.microbatches} microbatches, gradients reduced once per step",
        "eager": f"autopar, {args.microbatches} microbatches, gradients reduced every microbatch",
        "jit": "jax.jit, whole batch (data parallel)",
    }
    fns = {
        names["deferred"]: driver_step(deferred),
        names["eager"]: driver_step(eager),
        names["jit"]: jit_step,
    }
    losses = {name: [float(jax.block_until_ready(fn())) for _ in range(3)] for name, fn in fns.items()}
    times = _common.interleaved_medians(fns, args.rounds)
    counts = {
        names["deferred"]: _all_reduces(deferred),
        names["eager"]: _all_reduces(eager),
        names["jit"]: all_reduced(jitted.lower(ref["state"], ref_batch).compile().as_text()),
    }
    base = _common.summary(times[names["deferred"]])[0]
    headers = [
        "configuration",
        "all-reduces per step",
        "MB all-reduced per step",
        "median ms",
        "p10 ms",
        "p90 ms",
        "ratio vs deferred",
    ]
    rows = []
    for name in fns:
        med, p10, p90 = _common.summary(times[name])
        rows.append(
            [
                name,
                counts[name][0],
                f"{counts[name][1] / 1e6:.2f}",
                f"{med * 1e3:.1f}",
                f"{p10 * 1e3:.1f}",
                f"{p90 * 1e3:.1f}",
                f"{med / base:.3f}",
            ]
        )
    _common.print_table("gradient reductions", headers, rows)
    first = [losses[name][0] for name in fns]
    path = _common.write_markdown(
        "gradient_reductions" + ("" if args.model == "mlp" else f"_{args.model}"),
        "Gradient all-reduces deferred to the last microbatch",
        {
            "model": f"{what} ({num_params:,} parameters), adamw",
            "batch": f"{args.batch_size} {'rows' if kind == 'mlp' else 'sequences'}, "
            f"{args.microbatches} microbatches, one stage on {args.devices} "
            "devices as (8,) (sharding ILP)",
            "gradients kept as partial sums": f"{kept} of {grads}",
            "first-step losses (deferred, per microbatch, jit)": ", ".join(f"{x:.6f}" for x in first),
            "rounds": f"{args.rounds} (configurations alternate every round, after 3 warm-up steps)",
            "command": f"python benchmarks/gradient_reductions.py --model {args.model} "
            f"--microbatches {args.microbatches} "
            f"--hidden {args.hidden} --batch-size {args.batch_size} --rounds {args.rounds}",
        },
        headers,
        rows,
        notes="All-reduces per step count the all-reduce instructions of every compiled task that runs "
        "once in a step (XLA combines a task's independent all-reduces into one); MB all-reduced adds up "
        "their results' bytes on one device. The simulated devices "
        "share the host's cores, so an all-reduce costs memory traffic and synchronisation, not link time.",
    )
    speedup = _common.summary(times[names["eager"]])[0] / base
    print(f"results: {path}")
    print(f"deferred_speedup={speedup:.3f}")


if __name__ == "__main__":
    main()
