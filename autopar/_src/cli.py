"""The ``plan``, ``compare``, ``bench`` and ``calibrate`` commands of ``python -m autopar``.

Arguments are checked by argparse (the ``type=`` functions of :mod:`autopar._src.cli_args`)
before anything is built; errors a user can still cause while a command runs (``ValueError``, ``OSError``)
are turned into one ``autopar <command>: error: ...`` line by :func:`autopar.__main__.main`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from typing import Any

from autopar._src.cli_args import (
    cluster_file,
    cluster_text,
    cpu_preset_name,
    int_at_least,
    output_path,
    positive_int,
    positive_int_or_auto,
    preset_name,
)


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
        "--model",
        required=True,
        type=preset_name,
        help="preset, e.g. gpt-2.6b, bert-large, wresnet-1b, moe-1.3b",
    )
    where = plan.add_mutually_exclusive_group(required=True)
    where.add_argument("--cluster", type=cluster_text, help="HOSTSxDEVICESxKIND, e.g. 2x8xH100, 1x8xV100")
    where.add_argument(
        "--cluster-file", type=cluster_file, help="a ClusterSpec JSON file (autopar calibrate --out)"
    )
    plan.add_argument("--batch-size", type=positive_int, help="global batch (default: Alpa's for the family)")
    plan.add_argument(
        "--microbatches",
        type=positive_int_or_auto,
        default="auto",
        help="positive int or auto (default auto)",
    )
    plan.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    plan.add_argument("--no-remat", action="store_true", help="GPT blocks without rematerialisation")
    plan.add_argument("--data-parallel-only", action="store_true", help="no tensor-parallel logical meshes")
    plan.add_argument("--json", type=output_path, help="write the plan as JSON here")
    plan.add_argument("--timeline", type=output_path, help="draw the schedule as a PNG here")

    cmp = sub.add_parser(
        "compare",
        help="autopar vs a hand-written pjit plan on simulated CPU devices",
        description="Run a tiny model preset with autopar and with a manual pjit plan on the same "
        "simulated CPU devices; report step time, memory and whether results agree.",
        epilog="example: autopar compare --model gpt-tiny --manual megatron",
    )
    cmp.add_argument(
        "--model",
        type=cpu_preset_name,
        default="gpt-tiny",
        help="a preset small enough for CPU: mlp or a *-tiny / *-small one (default gpt-tiny)",
    )
    cmp.add_argument(
        "--manual",
        choices=["megatron", "data"],
        default="megatron",
        help="megatron: 2 x N/2 (data x model) mesh with Megatron rules; data: pure data parallel",
    )
    cmp.add_argument("--devices", type=positive_int, default=8, help="simulated CPU devices (default 8)")
    cmp.add_argument(
        "--stages", type=positive_int_or_auto, default="2", help="autopar's num_stages (int or auto)"
    )
    cmp.add_argument("--microbatches", type=positive_int, default=2)
    cmp.add_argument("--batch-size", type=positive_int, default=16)
    cmp.add_argument(
        "--steps", type=int_at_least(2), default=6, help="training steps, >= 2 (the first warms up)"
    )


def add_bench(sub: Any) -> None:
    """Adds ``bench``."""
    bench = sub.add_parser(
        "bench",
        help="step time of autopar plans vs jax.jit on simulated CPU devices",
        description="Median step time of autopar plans and of jax.jit with the same data-parallel "
        "shardings, alternating round by round.",
        epilog="example: autopar bench --model gpt-small --stages 1 2 4 --microbatches 4",
    )
    bench.add_argument(
        "--model",
        type=cpu_preset_name,
        default="gpt-small",
        help="a preset small enough for CPU: mlp or a *-tiny / *-small one (default gpt-small)",
    )
    bench.add_argument("--devices", type=positive_int, default=8, help="simulated CPU devices (default 8)")
    bench.add_argument(
        "--stages",
        nargs="+",
        type=positive_int_or_auto,
        default=[1, 2],
        help="num_stages values (int or auto)",
    )
    bench.add_argument(
        "--microbatches", type=positive_int, default=4, help="microbatches of multi-stage plans"
    )
    bench.add_argument("--batch-size", type=positive_int, default=32)
    bench.add_argument("--rounds", type=positive_int, default=10)


def _check_bench_devices(args: argparse.Namespace) -> None:
    if args.batch_size % args.devices:
        works = [n for n in range(1, args.batch_size + 1) if args.batch_size % n == 0]
        raise ValueError(
            f"--batch-size {args.batch_size} does not split over --devices {args.devices}: the jax.jit "
            f"baseline puts an equal share of the batch on each device; use --devices in {works} or a "
            f"--batch-size that is a multiple of {args.devices}"
        )


def run_bench(args: argparse.Namespace) -> int:
    """``autopar bench``."""
    _check_bench_devices(args)
    _use_cpu_devices(args.devices)
    import optax
    from rich.console import Console
    from rich.table import Table

    from autopar._src import bench
    from models import registry, train

    kind, config = registry.lookup(args.model)
    step, state = train.setup(kind, "linen", config, optax.adamw(1e-3))
    batch = train.make_batch(kind, config, args.batch_size)
    configs = {}
    for stages in args.stages:
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


def _use_cpu_devices(num_devices: int) -> None:
    """Starts JAX on ``num_devices`` simulated CPU devices.

    Raises:
      ValueError: if JAX has already started with another device count (the count can only be set
        before its backends start, e.g. when the command is called from a running program).
    """
    import jax

    jax.config.update("jax_platforms", "cpu")
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", num_devices)
    started = len(jax.devices())
    if started != num_devices:
        raise ValueError(
            f"--devices {num_devices}: JAX has already started with {started} devices in this process; "
            f"pass --devices {started} or run the command in a fresh process"
        )


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
    spec = args.cluster_file if args.cluster_file is not None else args.cluster
    compute = jnp.float16 if "v100" in spec.device.name.lower() else jnp.bfloat16
    if hasattr(config, "dtype"):
        config = dataclasses.replace(config, dtype=compute)
    if kind == "gpt" and not args.no_remat:
        config = dataclasses.replace(config, remat=True)
    batch_size = registry.DEFAULT_BATCH[kind] if args.batch_size is None else args.batch_size
    state = jax.eval_shape(lambda: train.linen_state(kind, config, optax.adamw(1e-4)))
    sample = train.make_batch(kind, config, 2)
    batch = {k: jax.ShapeDtypeStruct((batch_size, *v.shape[1:]), v.dtype) for k, v in sample.items()}
    plan = autopar.plan_step(
        train.linen_step(kind),
        state,
        batch,
        cluster=spec,
        num_microbatches=args.microbatches,
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


def _compare_mesh_shape(manual: str, num_devices: int) -> dict[str, int] | None:
    """Axis sizes of the manual plan's mesh in ``run_compare``; None where it cannot be built."""
    if manual == "megatron":
        return None if num_devices % 2 else {"data": 2, "model": num_devices // 2}
    return {"data": num_devices, "model": 1}


def _compare_fits(specs: Any, args: tuple[Any, ...], axes: dict[str, int] | None) -> bool:
    """Whether every dim that ``specs`` splits is divisible by the size of its mesh axes."""
    import jax
    import numpy as np

    if axes is None:
        return False
    for spec, leaf in zip(
        jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)),
        jax.tree.leaves(args),
        strict=True,
    ):
        for size, entry in zip(np.shape(leaf), spec, strict=False):
            if entry is None:
                continue
            names = entry if isinstance(entry, tuple) else (entry,)
            if size % math.prod(axes[n] for n in names):
                return False
    return True


def _check_compare_devices(args: argparse.Namespace, rules: Any, state: Any, batch: Any) -> None:
    """Raises ValueError naming the device counts that work if the manual plan's mesh cannot shard
    the model's state and batch on ``args.devices`` devices."""
    from autopar._src.compare import rule_specs

    specs = rule_specs(rules, (state, batch))

    def fits(n: int) -> bool:
        return _compare_fits(specs, (state, batch), _compare_mesh_shape(args.manual, n))

    if fits(args.devices):
        return
    works = [n for n in range(1, 65) if fits(n)]
    mesh = "2 x N/2 (data x model)" if args.manual == "megatron" else "N x 1 (data x model)"
    raise ValueError(
        f"--devices {args.devices} does not fit the pjit {args.manual} plan: its {mesh} mesh must "
        f"split {args.model}'s parameters and the --batch-size {args.batch_size} batch evenly; "
        f"device counts it can use (up to 64): {works or 'none'}"
    )


def run_compare(args: argparse.Namespace) -> int:
    """``autopar compare``; exit status 1 when the results disagree."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    import numpy as np
    import optax
    from jax.sharding import Mesh

    import autopar
    from models import registry, train

    kind, config = registry.lookup(args.model)
    rules = autopar.megatron_rules() if args.manual == "megatron" else []
    # Shapes only (eval_shape starts no backend), so a device count the manual mesh cannot use
    # is refused before any work.
    shapes = jax.eval_shape(lambda: train.linen_state(kind, config, optax.adamw(1e-3, eps=1e-5)))
    _check_compare_devices(args, rules, shapes, train.make_batch(kind, config, args.batch_size))
    _use_cpu_devices(args.devices)
    step, state = train.setup(kind, "linen", config, optax.adamw(1e-3, eps=1e-5))
    batches = [train.make_batch(kind, config, args.batch_size, seed=i) for i in range(args.steps)]
    devices = np.array(jax.devices())
    if args.manual == "megatron":
        mesh = Mesh(devices.reshape(2, -1), ("data", "model"))
    else:
        mesh = Mesh(devices.reshape(-1, 1), ("data", "model"))
    manual = autopar.Manual.from_rules(mesh, rules, (state, batches[0]), name=f"pjit {args.manual}")
    result = autopar.compare(
        step,
        state,
        batches,
        manual=manual,
        num_stages=args.stages,
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
    parser.add_argument("--out", type=output_path, help="write the spec as JSON here")
    parser.add_argument("--quick", action="store_true", help="shorter timed calls, fewer repeats")
    parser.add_argument(
        "--devices",
        type=positive_int,
        help="simulate N CPU devices and calibrate them (CPU platform only)",
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
        if args.devices < 1:  # argparse refuses it; this is for callers that build the Namespace
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
