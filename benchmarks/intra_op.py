"""The per-stage sharding ILP against hand-written data and tensor parallelism.

For GPT layers on each logical mesh (data, model) of 8 devices, three plans:

- ``ILP``: autopar's plan (one stage, ``mesh_shape=(data, model)``);
- ``data parallel``: the batch split over ``data``, parameters and optimizer state replicated;
- ``Megatron``: Megatron-LM rules over ``model`` (column-split q/k/v and first MLP matmul,
  row-split attention output and second MLP matmul, vocabulary-split embeddings) with the
  batch split over ``data``.

"predicted" prices each plan under the same cost model: the hand-written plans fix the
layouts of the parameters, optimizer state and batch, and the ILP lays out the rest around
them (as XLA's propagation does for a pjit program). "measured" is the median step time of
autopar's step (ILP) and of ``jax.jit`` with the hand-written ``in_shardings``, interleaved,
on the same devices. The cost model is the CPU preset (a full ``autopar calibrate`` of this
machine's simulated devices), a quick calibration with ``--calibrate`` (noisier: its link
figures vary several-fold between runs), or a saved spec with ``--cluster-file``.

    python benchmarks/intra_op.py [--model gpt-small] [--batch-size 16] [--rounds 10] [--calibrate]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402

MESHES = ((1, 8), (2, 4), (4, 2), (8, 1))


def _fixed(manual, args, arg_vars):
    """Input var -> spec tuple of a hand-written plan's in_shardings."""
    import jax

    leaves = jax.tree.leaves(manual.in_shardings, is_leaf=lambda x: hasattr(x, "spec"))
    return {v: tuple(sh.spec) for v, sh in zip(arg_vars, leaves, strict=True)}


def _runner(fn, state, batch):
    """A function that runs one step and feeds the new state back."""
    held = [state]

    def run():
        held[0], loss = fn(held[0], batch)
        return loss

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gpt-small", help="GPT preset (default gpt-small)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calibrate", action="store_true", help="price with a quick calibration")
    parser.add_argument("--cluster-file", help="a saved ClusterSpec JSON (e.g. from `autopar calibrate`)")
    args = parser.parse_args()
    _common.use_cpu_devices(8)

    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh

    import autopar
    from autopar._src import calibrate, cluster, intra_op
    from autopar._src.compare import Manual, megatron_rules
    from models import train

    if args.cluster_file:
        spec, source = cluster.ClusterSpec.load(args.cluster_file), f"--cluster-file {args.cluster_file}"
    elif args.calibrate:
        spec, source = calibrate.calibrate(quick=True, progress=False), "a quick calibration of these devices"
    else:
        spec, source = cluster.preset("cpu"), "the CPU preset"
    config = train.GPTConfig.preset(args.model)
    step, state = train.setup("gpt", "linen", config, optax.adamw(1e-3))
    batch = train.make_batch("gpt", config, args.batch_size)
    headers = [
        "mesh (data, model)",
        "plan",
        "predicted ms",
        "vs ILP",
        "measured ms",
        "vs ILP",
        "ILP solve s",
        "ILP groups",
    ]
    rows = []
    for shape in MESHES:
        mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "model"))
        par = autopar.autoparallel(step, num_stages=1, mesh_shape=shape, cluster=spec)
        exe = par.executable(state, batch)
        ilp = exe.shardings[0]
        carried = intra_op.carried_state(exe.step)
        manuals = {
            "data parallel": Manual.from_rules(mesh, [], (state, batch)),
            "Megatron": Manual.from_rules(mesh, megatron_rules(), (state, batch)),
        }
        predicted = {"ILP": ilp.objective}
        for name, manual in manuals.items():
            fixed = _fixed(manual, (state, batch), exe.step.arg_vars)
            predicted[name] = intra_op.solve_stage(
                exe.program, 0, ilp.mesh, carried=carried, fixed=fixed
            ).objective
        runners = {"ILP": (par, state, batch)}
        for name, manual in manuals.items():
            runners[name] = (
                jax.jit(step, in_shardings=manual.in_shardings, out_shardings=(manual.in_shardings[0], None)),
                jax.device_put(state, manual.in_shardings[0]),
                jax.device_put(batch, manual.in_shardings[1]),
            )
        fns = {name: _runner(*r) for name, r in runners.items()}
        for fn in fns.values():
            for _ in range(2):
                jax.block_until_ready(fn())
        times = _common.interleaved_medians(fns, args.rounds)
        measured = {name: _common.summary(ts)[0] for name, ts in times.items()}
        for name in ("ILP", "data parallel", "Megatron"):
            rows.append(
                [
                    str(shape),
                    name,
                    f"{predicted[name] * 1e3:.2f}",
                    f"{predicted[name] / predicted['ILP']:.2f}",
                    f"{measured[name] * 1e3:.1f}",
                    f"{measured[name] / measured['ILP']:.2f}",
                    f"{ilp.solve_seconds:.2f}" if name == "ILP" else "",
                    f"{ilp.num_variables} of {ilp.num_nodes}" if name == "ILP" else "",
                ]
            )
    _common.print_table("intra-op sharding: ILP vs hand-written plans", headers, rows)
    path = _common.write_markdown(
        "intra_op",
        "Per-stage sharding ILP vs hand-written data and Megatron tensor parallelism",
        {
            "model": f"{args.model} ({config.num_layers} layers, hidden {config.hidden}, "
            f"{config.num_heads} heads, seq {config.max_len}, vocab {config.vocab_size})",
            "batch size": args.batch_size,
            "optimizer": "adamw",
            "stages": "1 (the whole step on the 8-device logical mesh)",
            "cost model": f"{source}: {spec.device.flops('float32') / 1e9:.0f} GFLOP/s float32, links "
            f"{spec.intra_host_bandwidth / 1e6:.0f} MB/s and {spec.intra_host_latency * 1e6:.1f} us",
            "rounds": f"{args.rounds} interleaved steps per plan after 2 warm-up steps",
            "command": f"python benchmarks/intra_op.py --model {args.model} --batch-size {args.batch_size} "
            f"--rounds {args.rounds}" + (" --calibrate" if args.calibrate else ""),
        },
        headers,
        rows,
        notes=(
            "predicted: the stage's seconds per step under autopar's cost model (compute, "
            "collectives, resharding); the hand-written plans fix parameter, optimizer-state "
            "and batch layouts and the ILP lays out the rest. measured: median step time on 8 "
            "simulated CPU devices sharing the host's cores, so communication is nearly free and "
            "replicated work is not: the measured ratios show how the plans behave here, not on "
            "accelerators. ILP groups: decision groups left after merging forced choices, of all "
            "graph nodes."
        ),
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
