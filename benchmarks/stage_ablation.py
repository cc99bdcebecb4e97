"""Stage DP vs equal-layer and equal-operator stage splits (Alpa's ablation).

For each model and cluster the three methods share one cost model (analytic,
from the traced step) and each picks its best number of microbatches; the table
gives each plan's predicted step time and its ratio to the DP's.

    python benchmarks/stage_ablation.py                   # GPT-2.6B, Wide-ResNet-2B; 16 and 32 V100s
    python benchmarks/stage_ablation.py --devices 16 --models gpt-2.6b
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402

BATCH = {"gpt": 1024, "wresnet": 1536}  # Alpa's global batch sizes for these benchmarks


def abstract_step(model: str):
    """``(step, abstract_state, abstract_batch, kind)`` for a model preset, nothing allocated."""
    import jax
    import jax.numpy as jnp
    import optax

    from models import train

    kind = "gpt" if model.startswith("gpt") else "wresnet"
    if kind == "gpt":
        config = train.GPTConfig.preset(model, dtype=jnp.float16, remat=True)
        batch = {"tokens": jax.ShapeDtypeStruct((BATCH[kind], config.max_len), jnp.int32)}
    else:
        config = train.WResNetConfig.preset(model, dtype=jnp.float16)
        size = config.image_size
        batch = {
            "images": jax.ShapeDtypeStruct((BATCH[kind], size, size, 3), jnp.float32),
            "labels": jax.ShapeDtypeStruct((BATCH[kind],), jnp.int32),
        }
    state = jax.eval_shape(lambda: train.linen_state(kind, config, optax.adamw(1e-4)))
    return train.linen_step(kind), state, batch, kind


def compare(model: str, num_devices: int, schedule: str = "1f1b"):
    """Predicted step time of the DP, equal-layer and equal-operator plans (best over microbatches)."""
    import jax

    from autopar._src import baselines, planner, planning, stages, trace
    from autopar._src.cluster import preset

    step, state, batch, kind = abstract_step(model)
    spec = preset("v100", max(num_devices // 8, 1), devices_per_host=min(num_devices, 8))
    num_state = len(jax.tree.leaves(state))
    batch_ids = tuple(range(num_state, num_state + len(jax.tree.leaves(batch))))
    traced = planning.trace_at(
        step, (state, batch), batch_ids, BATCH[kind], trace.TraceOptions(num_layers=None)
    )
    prof = planning.step_profile(step, (state, batch), batch_ids, BATCH[kind], traced)
    best: dict[str, tuple[float, int, int] | None] = {
        "stage DP": None,
        "equal layers": None,
        "equal operators": None,
    }
    for b in planner.microbatch_candidates(BATCH[kind]):
        costs = planner.stage_costs(prof, spec, num_microbatches=b, batch_scale=1.0 / b)
        common = dict(
            submesh_devices=[h * d for h, d in costs.submeshes],
            memory_budget=float(spec.device.memory_bytes),
            num_devices=spec.num_devices,
            num_microbatches=b,
            schedule=schedule,
        )
        arrays = (costs.latency, costs.param_memory, costs.activation_memory)
        try:
            dp = stages.solve_stages(*arrays, **common)
        except stages.NoFeasiblePlanError:
            dp = None
        results = {
            "stage DP": dp,
            "equal layers": baselines.equal_layer_plan(*arrays, **common),
            "equal operators": baselines.equal_operator_plan(*arrays, layer_ops=prof.num_ops, **common),
        }
        for name, sol in results.items():
            if sol is not None and (best[name] is None or sol.objective < best[name][0]):
                best[name] = (sol.objective, sol.num_stages, b)
    return best, prof.num_layers


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["gpt-2.6b", "wresnet-2b"])
    parser.add_argument("--devices", nargs="+", type=int, default=[16, 32])
    args = parser.parse_args()
    _common.use_cpu_devices(1)

    headers = [
        "model",
        "V100s",
        "layers",
        "method",
        "predicted step s",
        "stages",
        "microbatches",
        "ratio to stage DP",
    ]
    rows = []
    never_worse = True
    for model in args.models:
        for n in args.devices:
            best, num_layers = compare(model, n)
            dp = best["stage DP"]
            for name, result in best.items():
                if result is None:
                    rows.append([model, n, num_layers, name, "does not fit", "-", "-", "-"])
                    continue
                t, s, b = result
                ratio = t / dp[0] if dp else float("nan")
                never_worse &= dp is not None and ratio >= 1 - 1e-9
                rows.append([model, n, num_layers, name, f"{t:.3f}", s, b, f"{ratio:.3f}"])
            print(rows[-3:], flush=True)
    _common.print_table("stage ablation", headers, rows)
    path = _common.write_markdown(
        "stage_ablation",
        "Stage DP vs equal-layer and equal-operator splits (V100 preset)",
        {
            "models": ", ".join(args.models),
            "devices": ", ".join(map(str, args.devices)),
            "cluster": "v100 preset (p3.16xlarge-like: 8 per host)",
            "schedule": "1f1b",
            "global batch": "GPT 1024, Wide-ResNet 1536",
            "costs": "analytic (autopar._src.planner)",
            "command": "python benchmarks/stage_ablation.py --models "
            + " ".join(args.models)
            + " --devices "
            + " ".join(map(str, args.devices)),
        },
        headers,
        rows,
        notes="Each method picks its own best number of microbatches. A ratio > 1 means the "
        "baseline's predicted step is slower than the stage DP's.",
    )
    print(f"results: {path}")
    print(f"dp_never_worse={never_worse}")


if __name__ == "__main__":
    main()
