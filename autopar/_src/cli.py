"""The ``plan``, ``compare``, ``bench`` and ``calibrate`` commands of ``python -m autopar``."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any


def add_commands(sub: Any) -> None:
    """Adds ``plan`` and ``compare`` to the command line's sub-parsers."""
    plan = sub.add_parser(
        "plan",
        help="plan a model preset for a cluster (a dry run: nothing is allocated)",
        description="Plan a model preset for a cluster spec; prints the plan, optionally writes JSON "
        "and a timeline PNG.",
        epilog="example: autopar plan --model gpt-2.6b --cluster 1x8xV100 --json out.json --timeline out.png",
    )
    plan.add_argument(
        "--model", required=True, help="preset, e.g. gpt-2.6b, bert-large, wresnet-1b, moe-1.3b"
    )
    plan.add_argument("--cluster", help="HOSTSxDEVICESxKIND, e.g. 2x8xH100, 1x8xV100")
    plan.add_argument("--cluster-file", help="a ClusterSpec JSON file instead of a preset")
    plan.add_argument("--batch-size", type=int, help="global batch (default: Alpa's for the family)")
    plan.add_argument("--microbatches", default="auto", help="int or auto (default auto)")
    plan.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    plan.add_argument("--no-remat", action="store_true", help="GPT blocks without rematerialisation")
    plan.add_argument("--data-parallel-only", action="store_true", help="no tensor-parallel logical meshes")
    plan.add_argument("--json", help="write the plan as JSON here")
    plan.add_argument("--timeline", help="draw the schedule as a PNG here")

    cmp = sub.add_parser(
        "compare",
        help="autopar vs a hand-written pjit plan on simulated CPU devices",
        description="Run a tiny model preset with autopar and with a manual pjit plan on the same "
        "simulated CPU devices; report step time, memory and whether results agree.",
        epilog="example: autopar compare --model gpt-tiny --manual megatron",
    )
    cmp.add_argument("--model", default="gpt-tiny")
    cmp.add_argument(
        "--manual",
        choices=["megatron", "data"],
        default="megatron",
        help="megatron: 2 x 4 (data x model) mesh with Megatron rules; data: pure data parallel",
    )
    cmp.add_argument("--devices", type=int, default=8)
    cmp.add_argument("--stages", default="2", help="autopar's num_stages (int or auto)")
    cmp.add_argument("--microbatches", type=int, default=2)
    cmp.add_argument("--batch-size", type=int, default=16)
    cmp.add_argument("--steps", type=int, default=6)


def add_bench(sub: Any) -> None:
    """Adds ``bench``."""
    bench = sub.add_parser(
        "bench",
        help="step time of autopar plans vs jax.jit on simulated CPU devices",
        description="Median step time of autopar plans and of jax.jit with the same data-parallel "
        "shardings, alternating round by round.",
        epilog="example: autopar bench --model gpt-small --stages 1 2 4 --microbatches 4",
    )
    bench.add_argument("--model", default="gpt-small")
    bench.add_argument("--devices", type=int, default=8)
    bench.add_argument("--stages", nargs="+", default=["1", "2"], help="num_stages values (int or auto)")
    bench.add_argument("--microbatches", type=int, default=4, help="microbatches of multi-stage plans")
    bench.add_argument("--batch-size", type=int, default=32)
    bench.add_argument("--rounds", type=int, default=10)


def run_bench(args: argparse.Namespace) -> int:
    """``autopar bench``."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    import optax
    from rich.console import Console
    from rich.table import Table

    from autopar._src import bench
    from models import registry, train

    kind, config = registry.lookup(args.model)
    step, state = train.setup(kind, "linen", config, optax.adamw(1e-3))
    batch = train.make_batch(kind, config, args.batch_size)
    configs = {}
    for s in args.stages:
        stages = _int_or_auto(s)
        nmb = 1 if stages == 1 else args.microbatches
        configs[f"autopar {stages} stage(s) x {nmb} microbatch(es)"] = dict(
            num_stages=stages, num_microbatches=nmb
        )
    times = bench.step_times(step, state, batch, configs, rounds=args.rounds)
    base = bench.median(times[bench.JIT])
    table = Table(title=f"{args.model}, batch {args.batch_size}, {args.devices} CPU devices")
    for col in ("configuration", "median step", "ratio vs jax.jit"):
        table.add_column(col)
    for name, ts in times.items():
        table.add_row(name, f"{bench.median(ts) * 1e3:.1f} ms", f"{bench.median(ts) / base:.3f}")
    Console().print(table)
    return 0


def _int_or_auto(text: str) -> int | str:
    return text if text == "auto" else int(text)


def run_plan(args: argparse.Namespace) -> int:
    """``autopar plan``."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax

    jax.config.update("jax_platforms", "cpu")
    import autopar
    from models import registry, train

    kind, config = registry.lookup(args.model)
    spec = (
        autopar.ClusterSpec.load(args.cluster_file)
        if args.cluster_file
        else autopar.parse_cluster(args.cluster)
    )
    compute = jnp.float16 if "v100" in spec.device.name.lower() else jnp.bfloat16
    if hasattr(config, "dtype"):
        config = dataclasses.replace(config, dtype=compute)
    if kind == "gpt" and not args.no_remat:
        config = dataclasses.replace(config, remat=True)
    batch_size = args.batch_size or registry.DEFAULT_BATCH[kind]
    state = jax.eval_shape(lambda: train.linen_state(kind, config, optax.adamw(1e-4)))
    sample = train.make_batch(kind, config, 2)
    batch = {k: jax.ShapeDtypeStruct((batch_size, *v.shape[1:]), v.dtype) for k, v in sample.items()}
    plan = autopar.plan_step(
        train.linen_step(kind),
        state,
        batch,
        cluster=spec,
        num_microbatches=_int_or_auto(args.microbatches),
        schedule=args.schedule,
        tensor_parallel=not args.data_parallel_only,
    )
    print(plan)
    if args.json:
        plan.save(args.json)
        print(f"plan written to {args.json}")
    if args.timeline:
        plan.timeline(args.timeline)
        print(f"timeline written to {args.timeline}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    """``autopar compare``; exit status 1 when the results disagree."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np
    import optax
    from jax.sharding import Mesh

    import autopar
    from models import registry, train

    kind, config = registry.lookup(args.model)
    step, state = train.setup(kind, "linen", config, optax.adamw(1e-3, eps=1e-5))
    batches = [train.make_batch(kind, config, args.batch_size, seed=i) for i in range(args.steps)]
    devices = np.array(jax.devices())
    if args.manual == "megatron":
        mesh = Mesh(devices.reshape(2, -1), ("data", "model"))
        rules = autopar.megatron_rules()
    else:
        mesh = Mesh(devices.reshape(-1, 1), ("data", "model"))
        rules = []
    manual = autopar.Manual.from_rules(mesh, rules, (state, batches[0]), name=f"pjit {args.manual}")
    result = autopar.compare(
        step,
        state,
        batches,
        manual=manual,
        num_stages=_int_or_auto(args.stages),
        num_microbatches=args.microbatches,
    )
    return 0 if result.agree else 1


def add_calibrate(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``calibrate`` to the command line's sub-parsers."""
    parser = subparsers.add_parser(
        "calibrate",
        help="measure this machine's devices and write a cluster spec",
        description="Time matmuls, memory bandwidth and all-reduces on this machine's devices; print "
        "the figures and optionally write them as a ClusterSpec JSON for `autopar plan --cluster-file`.",
        epilog="example: autopar calibrate --quick --devices 8 --out cluster.json",
    )
    parser.add_argument("--out", help="write the spec as JSON here")
    parser.add_argument("--quick", action="store_true", help="smaller problems, fewer repeats")
    parser.add_argument(
        "--devices", type=int, help="simulate N CPU devices and calibrate them (CPU platform only)"
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return parser


def run_calibrate(args: argparse.Namespace) -> int:
    """``autopar calibrate``."""
    import jax

    from autopar._src.calibrate import calibrate
    from autopar._src.report import cluster_table

    devices = None
    if args.devices is not None:
        if args.devices < 1:
            raise ValueError(f"--devices must be >= 1, got {args.devices}")
        jax.config.update("jax_platforms", "cpu")
        with contextlib.suppress(RuntimeError):
            # Refused once JAX has started its backends (e.g. when called from a running program);
            # the devices already there are then used if there are enough.
            jax.config.update("jax_num_cpu_devices", args.devices)
        available = jax.devices("cpu")
        if len(available) < args.devices:
            raise ValueError(
                f"--devices {args.devices} asks for more than the {len(available)} CPU devices JAX has "
                "started; run calibrate in a fresh process"
            )
        devices = available[: args.devices]
    spec = calibrate(devices, quick=args.quick, progress=args.progress)
    print(cluster_table(spec))
    if args.out:
        spec.save(args.out)
        print(f"cluster spec written to {args.out}")
    return 0
