"""One process of a multi-process run (see test_multihost.py): 4 simulated CPU devices per
process, JAX's distributed runtime over 127.0.0.1, gloo collectives, socket transfers.

    python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES COORDINATOR_PORT TRANSFER_PORT CASE OUT

Runs CASE's steps through autopar and through single-device ``jax.jit``, asserts that every
block this process holds of the losses and the new state equals jit's, and writes what it
checked and the plan it ran to OUT (JSON).
"""

import faulthandler
import json
import os
import sys

import jax


def main(process_id: int, num_processes: int, port: int, transfer_port: int, case: str, out: str) -> None:
    # A process left waiting on another prints where it waits before the test gives up on it.
    faulthandler.dump_traceback_later(float(os.environ.get("MULTIHOST_WORKER_TIMEOUT", 540)), exit=True)
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_cross_host_transfer_socket_address", f"127.0.0.1:{transfer_port}")
    jax.config.update("jax_cross_host_transport_addresses", "127.0.0.1:0")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id)

    import numpy as np
    from equality import OPTIMIZERS, TOLERANCES, as_numpy

    import autopar
    from models import train

    kind, api, opt, options = CASES[case]
    config = train.tiny_config(kind)
    step, state = train.setup(kind, api, config, OPTIMIZERS[opt]())
    batches = [train.make_batch(kind, config, 16, seed=i) for i in range(3)]
    changed = _plan_otherwise() if case == "disagree" and process_id == 1 else {}
    if options.get("devices") == "across":  # each stage's devices: two of each process
        devices = jax.devices()
        options = dict(options, devices=[devices[i] for i in (0, 1, 4, 5, 2, 3, 6, 7)])
    par = autopar.autoparallel(step, **options)
    ref = jax.jit(step)
    tol = TOLERANCES[opt]
    s_par, s_ref = state, state
    losses = []
    for batch in batches:
        s_par, loss_par = par(s_par, batch)
        s_ref, loss_ref = ref(s_ref, batch)
        for shard in loss_par.addressable_shards:
            np.testing.assert_allclose(np.asarray(shard.data), np.asarray(loss_ref), **tol)
        if loss_par.addressable_shards:
            losses.append(float(np.asarray(loss_par.addressable_shards[0].data)))
    leaves = {}
    moved = False
    for i, (a, r, before) in enumerate(
        zip(jax.tree.leaves(s_par), jax.tree.leaves(s_ref), jax.tree.leaves(state), strict=True)
    ):
        r, before = as_numpy(r), as_numpy(before)
        for shard in a.addressable_shards:
            np.testing.assert_allclose(as_numpy(shard.data), r[shard.index], **tol)
            moved |= not np.allclose(as_numpy(shard.data), before[shard.index])
        leaves[i] = len(a.addressable_shards)
    exe = par.executable(state, batches[0])
    layouts = [None if s is None else sorted(map(str, s.strategies.values())) for s in exe.shardings]
    with open(out, "w") as f:
        json.dump(
            dict(
                plan=exe.plan.to_json(),
                layouts=layouts,
                losses=losses,
                leaves=leaves,
                moved=moved,
                changed=changed,
                devices=[sorted(d.id for d in m.devices.flat) for m in exe.meshes],
            ),
            f,
        )
    jax.distributed.shutdown()


def _plan_otherwise() -> dict:
    """Makes this process's own planning differ from process 0's: its stage search returns a
    different stage count, and every sharding ILP picks each node's first strategy. Returns
    what was changed (filled in as planning runs)."""
    import dataclasses

    from autopar._src import autoplan, ilp_merge, intra_op, planning

    search = autoplan.auto_plan
    changed = {"stages": [], "layouts": False}

    def other_stages(fn, args, **kwargs):
        _, found = search(fn, args, **kwargs)
        num_stages = 2 if found.num_stages == 1 else 1
        changed["stages"].append((found.num_stages, num_stages))
        devices = [d for i in kwargs["device_ids"] for d in jax.devices() if d.id == i]
        return planning.uniform_plan(
            fn,
            args,
            batch_ids=kwargs["batch_ids"],
            batch_size=kwargs["batch_size"],
            devices=devices,
            num_stages=num_stages,
            num_microbatches=found.num_microbatches,
            schedule=kwargs["schedule"],
        )

    def first_strategies(nodes, edges, **kwargs):
        solution, groups = ilp_merge.solve_merged(nodes, edges, **kwargs)
        first = tuple(0 for _ in nodes)
        changed["layouts"] |= first != solution.choices
        return dataclasses.replace(solution, choices=first), groups

    autoplan.auto_plan = other_stages
    intra_op.solve_merged = first_strategies
    return changed


CASES = {
    # Stages 0-1 on process 0's devices, 2-3 on process 1's: activations move within a process
    # (between device sets) and across processes, 16 microbatches deep.
    "pipeline": ("gpt", "linen", "sgd", dict(num_stages=4, num_microbatches=16, mesh_shape=(1, 2))),
    # One stage over both processes' devices: its layouts' collectives cross processes.
    "spanning": ("gpt", "linen", "adamw", dict(num_stages=1, num_microbatches=2)),
    # Two stages, each over two devices of each process: collectives cross processes, and
    # activations move between device sets of the same two processes (which JAX's device_put
    # refuses), block by block within each process.
    "across": (
        "gpt",
        "linen",
        "sgd",
        dict(num_stages=2, num_microbatches=4, devices="across", cluster="1x8xCPU"),
    ),
    # The stage search and the sharding ILP on every process, MoE routing (gathers, scatters).
    "auto_moe": ("moe", "linen", "adamw", dict(num_stages="auto", num_microbatches=4)),
    "nnx": ("gpt", "nnx", "adamw", dict(num_stages=2, num_microbatches=2)),
    # Process 1 plans otherwise; process 0's plan and layouts are run.
    "disagree": ("mlp", "linen", "sgd", dict(num_stages="auto", num_microbatches=2)),
}


if __name__ == "__main__":
    pid, n, port, transfer, case_name, out_path = sys.argv[1:]
    main(int(pid), int(n), int(port), int(transfer), case_name, out_path)
