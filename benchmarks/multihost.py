"""One plan run by two processes (``jax.distributed``, 4 CPU devices each) vs by one process
with all 8 devices: step time, and the time to move an array between the two halves.

The plan is two stages of four devices each; with two processes each stage is one process's
devices, so every activation and gradient between the stages crosses processes (block by
block, waited for on arrival: ``autopar._src.transfers.copy_blocks``). Every process waits
for the blocks of each step it holds; a step takes as long as the slowest process, a move as
long as its receiver waits. One-process and two-process runs alternate ``--repeats`` times.

    python benchmarks/multihost.py [--model gpt-small] [--batch-size 32] [--microbatches 4]
        [--rounds 10] [--repeats 2] [--mib 1 4 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402

DEVICES = 8


def worker(args: argparse.Namespace) -> None:
    """One process: times the steps and the transfers, writes them to ``args.out`` (process 0)."""
    import faulthandler

    import jax

    # A process left waiting on the other prints where it waits before the parent gives up.
    faulthandler.dump_traceback_later(max(args.timeout - 30, 30), exit=True)
    n = args.num_processes
    _common.use_cpu_devices(DEVICES // n)
    if n > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_cross_host_transfer_socket_address", f"127.0.0.1:{args.transfer_port}")
        jax.config.update("jax_cross_host_transport_addresses", "127.0.0.1:0")
        jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=n, process_id=args.process_id)
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import autopar
    from autopar._src import transfers
    from models import train

    config = train.GPTConfig.preset(args.model)
    step, state = train.setup("gpt", "linen", config, optax.adamw(1e-3))
    batch = train.make_batch("gpt", config, args.batch_size)
    par = autopar.autoparallel(step, num_stages=2, num_microbatches=args.microbatches)
    for _ in range(2):  # compile and warm up
        state, loss = par(state, batch)
        jax.block_until_ready((state, loss))
    # Each process waits for the blocks it holds; the process of the last stage waits for the
    # whole step. (A barrier over all devices after cross-process transfers can hang on CPUs.)
    t0 = time.perf_counter()
    steps = []
    for _ in range(args.rounds):
        state, loss = par(state, batch)
        jax.block_until_ready((state, loss))
        steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
    devices = jax.devices()
    half = DEVICES // 2
    src = NamedSharding(Mesh(np.array(devices[:half]), ("data",)), PartitionSpec("data"))
    dst = NamedSharding(Mesh(np.array(devices[half:]), ("data",)), PartitionSpec("data"))
    moves = {}
    for mib in args.mib:
        x = jax.device_put(np.ones((mib * 2**20 // 4,), np.float32), src)
        jax.block_until_ready(transfers.copy_blocks(x, dst))
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            jax.block_until_ready(transfers.copy_blocks(x, dst))  # the receiving process waits
            times.append(time.perf_counter() - t0)
        moves[mib] = times
    with open(f"{args.out}.{args.process_id}", "w") as f:
        json.dump({"steps": steps, "moves": moves, "receives": dst.is_fully_addressable}, f)
    if n > 1:
        jax.distributed.shutdown()


def _launch(args: argparse.Namespace, num_processes: int, out: str) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    port, *transfer = _common.free_ports(1 + num_processes)
    common = [
        "--model", args.model, "--batch-size", str(args.batch_size), "--microbatches",
        str(args.microbatches), "--rounds", str(args.rounds), "--mib", *map(str, args.mib),
        "--timeout", str(args.timeout),
    ]  # fmt: skip

    def command(i: int) -> list[str]:
        own = ["--process-id", str(i), "--num-processes", str(num_processes), "--port", str(port)]
        own += ["--transfer-port", str(transfer[i]), "--out", out]
        return [sys.executable, os.path.abspath(__file__), *common, "--worker", *own]

    procs = [
        subprocess.Popen(command(i), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(num_processes)
    ]
    logs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        said = "\n".join(f"process {i} of {num_processes}:\n{log[-4000:]}" for i, log in enumerate(logs))
        raise RuntimeError(f"a process failed:\n{said}")
    reports = []
    for i in range(num_processes):
        with open(f"{out}.{i}") as f:
            reports.append(json.load(f))
    # A step takes as long as its slowest process; a move, as long as its receiver waits.
    steps = [max(ts) for ts in zip(*(r["steps"] for r in reports), strict=True)]
    receiver = next(r for r in reports if r["receives"])
    return {"steps": steps, "moves": receiver["moves"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gpt-small", help="GPT preset (default gpt-small)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2, help="alternations of the two runs")
    parser.add_argument("--mib", type=int, nargs="+", default=[1, 4, 16], help="array sizes moved, MiB")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    parser.add_argument("--out-dir", default=_common.RESULTS, help="directory of the results file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--transfer-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    _common.RESULTS = args.out_dir  # write_markdown reads it at call time
    if args.worker:
        worker(args)
        return
    runs: dict[int, dict] = {1: {"steps": [], "moves": {}}, 2: {"steps": [], "moves": {}}}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            for n in (1, 2):
                got = _launch(args, n, os.path.join(tmp, f"{n}_{k}.json"))
                runs[n]["steps"] += got["steps"]
                for mib, ts in got["moves"].items():
                    runs[n]["moves"].setdefault(mib, []).extend(ts)
    _common.use_cpu_devices(DEVICES)
    headers = ["run", "what", "median ms", "p10 ms", "p90 ms", "vs one process"]
    rows = []
    base = {}
    for n in (1, 2):
        label = "one process, 8 devices" if n == 1 else "two processes, 4 devices each"
        items = [("step", runs[n]["steps"])] + [(f"move {m} MiB", ts) for m, ts in runs[n]["moves"].items()]
        for what, ts in items:
            med, p10, p90 = _common.summary(ts)
            base.setdefault(what, med)
            rows.append(
                [
                    label,
                    what,
                    f"{med * 1e3:.2f}",
                    f"{p10 * 1e3:.2f}",
                    f"{p90 * 1e3:.2f}",
                    f"{med / base[what]:.2f}",
                ]
            )
    _common.print_table("one plan on one process and on two", headers, rows)
    mibs = " ".join(map(str, args.mib))
    path = _common.write_markdown(
        "multihost",
        "One plan on one process and on two (jax.distributed)",
        {
            "model": f"{args.model}, batch {args.batch_size}, adamw",
            "plan": f"2 stages of 4 devices, {args.microbatches} microbatches, 1f1b",
            "rounds": f"{args.rounds} steps per run after 2 warm-up steps, {args.repeats} alternations",
            "transfers": f"{mibs} MiB float32, split over 4 devices, from the first 4 devices to the last 4",
            "command": f"python benchmarks/multihost.py --model {args.model} --batch-size "
            f"{args.batch_size} --microbatches {args.microbatches} --rounds {args.rounds} --repeats "
            f"{args.repeats} --mib {mibs}",
        },
        headers,
        rows,
        notes="Both runs share this machine's cores. With two processes, blocks between them go "
        "through JAX's socket transfers and each is waited for where it arrives; a step is the "
        "slowest process's. `environment` below is the parent process's (8 devices).",
    )
    ratio = float(rows[len(args.mib) + 1][-1])
    print(f"results: {path}")
    print(f"multihost_step_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
