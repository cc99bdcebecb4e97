"""Measured step times of autopar plans vs hand-written pjit plans on 8 simulated CPU devices.

For the tiny GPT, BERT, Wide-ResNet and MoE configs, ``autopar.compare`` runs each autopar
plan and each manual plan from the same state on the same batches, alternating step by
step, and checks that losses and final states agree. Autopar plans: ``num_stages="auto"``
with the default cluster, and a 2-stage pipeline. Manual plans: pure data parallel
(``Manual.from_rules`` on an 8 x 1 mesh with no rules) and Megatron-style tensor parallelism
(``autopar.megatron_rules()`` on a 2 x 4 ("data", "model") mesh: attention and MLP
column/row splits, each expert's hidden dim, Wide-ResNet's wide convolution pair).

BatchNorm statistics and MoE routing groups are computed per microbatch, so Wide-ResNet and
MoE run one microbatch (other counts would be a different computation, not a rounding
difference). The simulated devices share the host's cores, so the times measure dispatch
and communication overheads more than parallel speed-up.

    python benchmarks/measured_runs.py                       # all four families, 10 steps each
    python benchmarks/measured_runs.py --kinds gpt --steps 5 --out-dir /tmp/results

The last line printed is ``measured_ok=<bool>``: every pair agreed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402

KINDS = ("gpt", "bert", "wresnet", "moe")
PER_MICROBATCH = ("wresnet", "moe")
"""Families whose step is not a mean over examples (BatchNorm statistics, MoE routing groups)."""


def _plan_text(plan: Any) -> str:
    meshes = ",".join("x".join(map(str, st.mesh_shape)) for st in plan.stages)
    return f"{plan.num_stages} stage(s) [{meshes}], {plan.num_microbatches} microbatch(es)"


def run_kind(kind: str, *, batch_size: int, steps: int, learning_rate: float) -> list[dict[str, Any]]:
    """Every (autopar plan, manual plan) comparison of one model family."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh

    import autopar
    from models import train

    config = train.tiny_config(kind)
    step, state = train.setup(kind, "linen", config, optax.sgd(learning_rate))
    batches = [train.make_batch(kind, config, batch_size, seed=i) for i in range(steps + 1)]
    devices = np.array(jax.devices()[:8])
    manuals = [
        autopar.Manual.from_rules(
            Mesh(devices.reshape(8, 1), ("data", "model")), [], (state, batches[0]), name="pjit data parallel"
        )
    ]
    manuals.append(
        autopar.Manual.from_rules(
            Mesh(devices.reshape(2, 4), ("data", "model")),
            autopar.megatron_rules(),
            (state, batches[0]),
            name="pjit Megatron 2x4",
        )
    )
    per_mb = kind in PER_MICROBATCH
    options = {
        "autopar auto": dict(num_stages="auto", num_microbatches=1 if per_mb else "auto"),
        "autopar 2 stages": dict(num_stages=2, num_microbatches=1 if per_mb else 4),
    }
    rows = []
    for label, opts in options.items():
        plan = autopar.autoparallel(step, **opts).plan(state, batches[0])
        for manual in manuals:
            t0 = time.perf_counter()
            result = autopar.compare(step, state, batches, manual=manual, print_table=False, **opts)
            rows.append(
                {
                    "kind": kind,
                    "autopar": label,
                    "plan": _plan_text(plan),
                    "manual": manual.name,
                    "result": result,
                    "seconds": time.perf_counter() - t0,
                }
            )
            print(
                f"{kind}: {label} ({_plan_text(plan)}) {result.autopar_step_seconds * 1e3:.1f} ms vs "
                f"{manual.name} {result.manual_step_seconds * 1e3:.1f} ms, agree={result.agree}",
                flush=True,
            )
    return rows


HEADERS = [
    "model",
    "autopar plan",
    "autopar ms",
    "manual plan",
    "manual ms",
    "autopar / manual",
    "autopar MiB",
    "manual MiB",
    "max loss diff",
    "agree",
]


def table_row(r: dict[str, Any]) -> list[Any]:
    """One row of the results table."""
    res = r["result"]
    return [
        r["kind"],
        f"{r['autopar']}: {r['plan']}",
        f"{res.autopar_step_seconds * 1e3:.1f}",
        r["manual"],
        f"{res.manual_step_seconds * 1e3:.1f}",
        f"{res.autopar_step_seconds / res.manual_step_seconds:.2f}",
        f"{res.autopar_memory_bytes / 2**20:.2f}",
        f"{res.manual_memory_bytes / 2**20:.2f}",
        f"{res.max_loss_difference:.1e}",
        res.agree,
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (one more warms up)")
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--out-dir", default=_common.RESULTS, help="directory of the results file")
    args = parser.parse_args(argv)
    _common.use_cpu_devices(8)
    _common.RESULTS = args.out_dir  # write_markdown reads it at call time

    start = time.perf_counter()
    results = []
    for kind in args.kinds:
        results += run_kind(
            kind, batch_size=args.batch_size, steps=args.steps, learning_rate=args.learning_rate
        )
    elapsed = time.perf_counter() - start
    rows = [table_row(r) for r in results]
    ok = all(r["result"].agree for r in results)
    _common.print_table("measured runs (8 simulated CPU devices)", HEADERS, rows)

    from models import train

    configs = {k: train.tiny_config(k) for k in args.kinds}
    path = _common.write_markdown(
        "measured_runs",
        "Measured step times: autopar vs pjit plans (8 simulated CPU devices)",
        {
            "models": "; ".join(
                f"{k}: {type(c).__name__}({', '.join(f'{f}={getattr(c, f)}' for f in _fields(c))})"
                for k, c in configs.items()
            ),
            "batch size": args.batch_size,
            "steps": f"{args.steps} timed (median) after 1 warm-up, autopar and manual alternating",
            "optimizer": f"optax.sgd({args.learning_rate}), float32",
            "microbatches": "Wide-ResNet and MoE: 1 (BatchNorm and MoE routing are per microbatch); "
            "GPT and BERT: auto for the auto plan, 4 for the 2-stage plan",
            "agreement": "autopar.compare defaults: rtol 1e-4, atol 1e-5 on losses and final states",
            "command": " ".join(
                ["python benchmarks/measured_runs.py", *(sys.argv[1:] if argv is None else argv)]
            ),
        },
        HEADERS,
        rows,
        notes="Each row is one `autopar.compare` call: both plans start from the same state and run "
        "the same batches, alternating step by step; times are medians, memory is the largest "
        "compiled executable's argument + output + temporary bytes per device. The 8 devices are "
        "simulated on the host's CPU cores, so these times show overheads (dispatch, transfers, "
        f"collectives), not parallel speed-up. Run time {elapsed:.0f} s.",
    )
    print(f"results: {path}")
    print(f"measured_ok={ok}")


def _fields(config: Any) -> list[str]:
    import dataclasses

    wanted = ("num_layers", "hidden", "num_heads", "max_len", "num_experts", "base_channels", "image_size")
    return [f.name for f in dataclasses.fields(config) if f.name in wanted]


if __name__ == "__main__":
    main()
