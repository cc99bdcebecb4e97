"""How long planning takes: a GPT step traced abstractly, clustered and staged.

Nothing is allocated: parameters and optimizer state are ``jax.eval_shape``
structures, costs are analytic, the cluster is a preset.

    python benchmarks/planner_time.py --model gpt3-175b --hosts 8 --devices-per-host 8
    python benchmarks/planner_time.py --sweep      # 24/48/96 layers x 8/16/32/64 devices -> results/

The last line printed is ``planner_seconds=<float>`` (tracing + clustering + stage DP).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402


def plan_gpt(
    model: str,
    hosts: int,
    per_host: int,
    device: str,
    batch_size: int,
    num_layers: int | None,
    remat: bool = True,
    sharding_costs: bool = False,
):
    """Plans one GPT step; returns (plan, seconds)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    import autopar
    from models import train

    # Rematerialised blocks, as large GPTs are trained: without them a 175B step's
    # attention probabilities alone exceed any device's memory at this batch size.
    config = train.GPTConfig.preset(model, dtype=jnp.bfloat16, remat=remat)
    if num_layers is not None:
        config = dataclasses.replace(config, num_layers=num_layers)
    gpt = train.GPT(config)
    tokens = jax.ShapeDtypeStruct((batch_size, config.max_len), jnp.int32)
    tx = optax.adamw(1e-4)

    def make_state():
        params = gpt.init(jax.random.key(0), jnp.zeros((1, config.max_len), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=gpt.apply, params=params, tx=tx)

    state = jax.eval_shape(make_state)
    step = train.linen_step("gpt")
    spec = autopar.cluster_preset(device, hosts, devices_per_host=per_host)
    t0 = time.perf_counter()
    try:
        plan = autopar.plan_step(
            step,
            state,
            {"tokens": tokens},
            cluster=spec,
            num_microbatches="auto",
            sharding_costs=sharding_costs,
            platform="gpu",
        )
    except autopar.NoFeasiblePlanError as e:
        e.seconds = time.perf_counter() - t0
        raise
    return plan, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gpt3-175b")
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--devices-per-host", type=int, default=8)
    parser.add_argument("--device", default="h100", help="cluster preset device (h100, a100, v100)")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--sweep", action="store_true", help="24/48/96 layers x 8/16/32/64 devices")
    parser.add_argument("--no-remat", action="store_true", help="plan blocks without rematerialisation")
    parser.add_argument(
        "--sharding-costs", action="store_true", help="price stages with the per-layer sharding ILP"
    )
    args = parser.parse_args()
    _common.use_cpu_devices(1)
    from autopar import NoFeasiblePlanError

    if not args.sweep:
        plan, seconds = plan_gpt(
            args.model,
            args.hosts,
            args.devices_per_host,
            args.device,
            args.batch_size,
            None,
            remat=not args.no_remat,
            sharding_costs=args.sharding_costs,
        )
        print(plan)
        print(f"planner_seconds={seconds:.3f}")
        return

    rows = []
    total = 0.0
    for layers in (24, 48, 96):
        for devices in (8, 16, 32, 64):
            hosts, per_host = max(devices // 8, 1), min(devices, 8)
            try:
                plan, seconds = plan_gpt(
                    args.model, hosts, per_host, args.device, args.batch_size, layers, remat=not args.no_remat
                )
            except NoFeasiblePlanError as e:
                # The planner proves that nothing fits: report it (and how long that took).
                seconds = e.seconds
                rows.append([layers, devices, f"{seconds:.2f}", "-", "does not fit", "-", "-"])
            else:
                rows.append(
                    [
                        layers,
                        devices,
                        f"{seconds:.2f}",
                        plan.num_layers,
                        plan.num_stages,
                        plan.num_microbatches,
                        f"{plan.predicted_step_time:.3f}",
                    ]
                )
            total += seconds
            print(rows[-1], flush=True)
    headers = [
        "GPT layers",
        "devices",
        "planner s",
        "clustered layers",
        "stages",
        "microbatches",
        "predicted step s",
    ]
    _common.print_table("planner time", headers, rows)
    path = _common.write_markdown(
        "planner_time",
        "Planner time: GPT-3-175B-shaped steps, traced abstractly",
        {
            "model": f"{args.model} with the number of layers varied",
            "cluster": f"{args.device} preset, 8 per host",
            "global batch": args.batch_size,
            "dtype": "bfloat16 compute, float32 parameters, adamw",
            "blocks": "no rematerialisation" if args.no_remat else "rematerialised (nn.remat per block)",
            "timed": "tracing + layer clustering + stage DP (including the choice of microbatches)",
            "command": f"python benchmarks/planner_time.py --model {args.model} --sweep",
        },
        headers,
        rows,
    )
    print(f"results: {path}")
    print(f"planner_seconds={total:.3f}")


if __name__ == "__main__":
    main()
