"""One-device GPT train step: autopar (one stage, one microbatch) vs plain ``jax.jit``, and MFU.

Both run the same linen GPT step (bfloat16 compute, float32 parameters, adamw) from the same
state on the same device-resident batch, alternating step by step, each donating its old
state. Model FLOPs per step follow PaLM's definition: ``6 * N * tokens`` for the matmul
parameters ``N`` (every parameter except the token and position embedding tables) plus
``12 * layers * hidden * seq_len * tokens`` for the attention scores and their use (the
causal mask is applied to a full ``seq_len x seq_len`` matmul). MFU divides model FLOP/s by
the device's measured peak: the best rate of a large bfloat16 matmul timed on the device.
Each plan's step time is waited for step by step; two more columns show the host's share: how
long a call takes to return, and the time per step when steps are dispatched back to back.

Runs on the first device of the default backend: a GPU when there is one, else the CPU.

    python benchmarks/gpu_single.py                          # gpt-350m, batch 8, seq 1024, 20 steps
    python benchmarks/gpu_single.py --batch-size 16 --steps 30
    python benchmarks/gpu_single.py --tiny --steps 3         # gpt-tiny, any machine, seconds

The last line printed is ``mfu=<float>`` (autopar's step, PaLM model FLOPs, measured peak).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402

AUTOPAR = "autopar (1 stage, 1 microbatch)"
JIT = "jax.jit"
EMBEDDINGS = ("embed", "pos_embed")


def measured_peak(device: Any, *, size: int, repeats: int = 10) -> float:
    """Best FLOP/s of ``size x size`` bfloat16 matmuls on ``device`` (``repeats`` chained per timing)."""
    import jax
    import jax.numpy as jnp

    a = jax.device_put(jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16), device)
    b = jax.device_put(jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16), device)

    @jax.jit
    def chain(a: jax.Array, b: jax.Array) -> jax.Array:
        # Each product feeds the next, so XLA can neither skip nor merge them.
        def body(_: int, x: jax.Array) -> jax.Array:
            return (x @ b) * jnp.bfloat16(1.0 / size**0.5)

        return jax.lax.fori_loop(0, repeats, body, a)

    jax.block_until_ready(chain(a, b))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(chain(a, b))
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 * repeats / best


def host_and_pipelined(run: Any, steps: int) -> tuple[float, float]:
    """``(median seconds a call takes to return, seconds per step over steps dispatched back to
    back and waited for once)``: what the caller's thread spends, and the step rate when the
    host runs ahead of the device (a loop that does not wait for every loss)."""
    import jax

    host = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = run()
        host.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = run()
    jax.block_until_ready(out)
    return _common.summary(host)[0], (time.perf_counter() - t0) / steps


def model_flops(params: Any, config: Any, tokens: int) -> tuple[float, float, int]:
    """``(6 N tokens, attention FLOPs, N)`` per train step (forward + backward)."""
    import jax
    import numpy as np

    n = sum(
        int(np.prod(x.shape))
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if not any(getattr(k, "key", None) in EMBEDDINGS for k in path)
    )
    attention = 12.0 * config.num_layers * config.hidden * config.max_len * tokens
    return 6.0 * n * tokens, attention, n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="GPT preset (default gpt-350m; gpt-tiny with --tiny)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 8; 4 tiny)")
    parser.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)"
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per plan (after 2 warm-ups)")
    parser.add_argument("--matmul-size", type=int, default=None, help="peak matmul size (8192 GPU, 1024 CPU)")
    parser.add_argument("--tiny", action="store_true", help="gpt-tiny with a small batch, for any machine")
    parser.add_argument(
        "--microbatches",
        type=int,
        nargs="+",
        default=[1],
        help="autopar's microbatch counts, one plan each (one stage on the one device; default 1)",
    )
    parser.add_argument("--out-dir", default=_common.RESULTS, help="directory of the results file")
    args = parser.parse_args(argv)
    args.model = args.model or ("gpt-tiny" if args.tiny else "gpt-350m")
    args.batch_size = args.batch_size or (4 if args.tiny else 8)
    for m in args.microbatches:
        if m < 1 or args.batch_size % m:
            raise ValueError(
                f"--microbatches {m}: must be positive and divide --batch-size {args.batch_size}"
            )
    return args


def autopar_label(microbatches: int) -> str:
    return AUTOPAR if microbatches == 1 else f"autopar (1 stage, {microbatches} microbatches)"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _common.RESULTS = args.out_dir  # write_markdown reads it at call time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import autopar
    from models import train

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    seq = {"max_len": args.seq_len} if args.seq_len else {}
    config = train.GPTConfig.preset(args.model, dtype=jnp.bfloat16, **seq)
    tokens = args.batch_size * config.max_len

    with jax.default_device(device):
        step, state = train.setup("gpt", "linen", config, optax.adamw(1e-4))
    batch = jax.device_put(train.make_batch("gpt", config, args.batch_size), device)
    flops_6n, flops_attn, num_params = model_flops(state.params, config, tokens)

    fns: dict[str, Any] = {
        autopar_label(m): autopar.autoparallel(
            step, devices=[device], num_stages=1, num_microbatches=m, donate_argnums=(0,)
        )
        for m in args.microbatches
    }
    fns[JIT] = jax.jit(step, donate_argnums=(0,))
    # Each plan gets its own copy of the state (donated step after step).
    states = {name: jax.device_put(jax.tree.map(jnp.copy, state), device) for name in fns}
    del state
    losses: dict[str, Any] = {}

    def runner(name: str):
        def run() -> Any:
            states[name], losses[name] = fns[name](states[name], batch)
            return states[name], losses[name]

        return run

    runners = {name: runner(name) for name in fns}
    t0 = time.perf_counter()
    for _ in range(2):  # compile, then one more step so both reach steady state
        for run in runners.values():
            jax.block_until_ready(run())
    compile_seconds = time.perf_counter() - t0
    times = _common.interleaved_medians(runners, args.steps)
    dispatch = {name: host_and_pipelined(run, args.steps) for name, run in runners.items()}
    loss_diff = {
        m: float(np.abs(np.float64(losses[autopar_label(m)]) - np.float64(losses[JIT])))
        for m in args.microbatches
    }

    size = args.matmul_size or (8192 if on_gpu else 1024)
    peak = measured_peak(device, size=size)
    headers = [
        "plan",
        "median ms",
        "p10 ms",
        "p90 ms",
        "tokens/s",
        "model TFLOP/s",
        "MFU",
        "MFU (6N only)",
        "ratio vs jax.jit",
        "host ms per call",
        "pipelined ms/step",
    ]
    base = _common.summary(times[JIT])[0]
    rows, mfu = [], {}
    for name, ts in times.items():
        med, p10, p90 = _common.summary(ts)
        mfu[name] = (flops_6n + flops_attn) / med / peak
        rows.append(
            [
                name,
                f"{med * 1e3:.2f}",
                f"{p10 * 1e3:.2f}",
                f"{p90 * 1e3:.2f}",
                f"{tokens / med:,.0f}",
                f"{(flops_6n + flops_attn) / med / 1e12:.3f}",
                f"{mfu[name]:.3f}",
                f"{flops_6n / med / peak:.3f}",
                f"{med / base:.3f}",
                f"{dispatch[name][0] * 1e3:.2f}",
                f"{dispatch[name][1] * 1e3:.2f}",
            ]
        )
    _common.print_table(f"{args.model} train step on one {device.device_kind}", headers, rows)
    path = _common.write_markdown(
        "gpu_single",
        f"One-device GPT train step: autopar vs jax.jit ({device.device_kind})",
        {
            "model": f"{args.model}: {config.num_layers} layers, hidden {config.hidden}, "
            f"{config.num_heads} heads, vocab {config.vocab_size}; {num_params:,} matmul parameters",
            "batch": f"{args.batch_size} x {config.max_len} tokens ({tokens:,} per step)",
            "precision": "bfloat16 compute, float32 parameters, optax.adamw",
            "device": f"{device.device_kind} ({device.platform}), first of {jax.device_count()}",
            "steps": f"{args.steps} timed per plan after 2 warm-up steps, alternating, old state donated; "
            f"then {args.steps} timed one call at a time and {args.steps} back to back per plan",
            "model FLOPs per step": f"{(flops_6n + flops_attn):.4g} = 6 N tokens {flops_6n:.4g} "
            f"+ attention {flops_attn:.4g} (PaLM's definition)",
            "measured peak": f"{peak / 1e12:.4g} TFLOP/s: best of 5 timings of 10 chained "
            f"{size}x{size} bfloat16 matmuls",
            "compile + warm-up": f"{compile_seconds:.1f} s",
            "last-step |loss difference| vs jax.jit": ", ".join(
                f"{m} microbatch(es) {d:.2e}" for m, d in loss_diff.items()
            ),
            "command": " ".join(
                ["python benchmarks/gpu_single.py", *(sys.argv[1:] if argv is None else argv)]
            ),
        },
        headers,
        rows,
        notes="MFU = model FLOP/s / measured matmul peak. `MFU (6N only)` leaves out the attention "
        "FLOPs. All plans run the same step; with one microbatch the ratio is autopar's single-device "
        "overhead, with more it adds the smaller microbatches' work and the tasks' dispatch. "
        "`host ms per call`: how long a call takes to return (the device may still be working); "
        "`pipelined ms/step`: steps dispatched back to back, waited for once at the end.",
    )
    print(f"results: {path}")
    print(f"mfu={mfu[autopar_label(args.microbatches[0])]:.4f}")


if __name__ == "__main__":
    main()
