"""Several processes (``jax.distributed``): two local processes of 4 CPU devices each run the
same step through autopar; together they hold every block of the results, and each block
equals single-device ``jax.jit``'s (see multihost_worker.py)."""

import json
import os
import subprocess
import sys

import jax
import pytest
from equality import OPTIMIZERS
from multihost_worker import CASES

import autopar
from benchmarks._common import free_ports
from models import train

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
NUM_PROCESSES = 2
TIMEOUT = 600


def _run(case, tmp_path):
    """Runs ``case`` on two processes; returns each one's report."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "device_count" not in f)
    env["JAX_PLATFORMS"] = "cpu"
    coordinator, *transfers = free_ports(1 + NUM_PROCESSES)
    outs = [tmp_path / f"{case}_{i}.json" for i in range(NUM_PROCESSES)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                WORKER,
                str(i),
                str(NUM_PROCESSES),
                str(coordinator),
                str(transfers[i]),
                case,
                str(out),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, out in enumerate(outs)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT)[0])
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{logs[i][-6000:]}"
    return [json.loads(out.read_text()) for out in outs]


def _check(reports, num_leaves):
    plans = {r["plan"] for r in reports}
    assert len(plans) == 1, "the processes ran different plans"
    assert len({json.dumps(r["layouts"]) for r in reports}) == 1, "the processes ran different layouts"
    # Every leaf of the new state has blocks on some process, and every process checked them.
    for i in range(num_leaves):
        assert sum(r["leaves"][str(i)] for r in reports) >= 1
    # The loss lives on the last stage's devices: the processes that hold it checked 3 steps.
    assert sorted({len(r["losses"]) for r in reports}) in ([3], [0, 3])
    assert any(r["moved"] for r in reports)
    return autopar.Plan.from_json(plans.pop())


def _num_leaves(case):
    kind, api, opt, _ = CASES[case]
    _, state = train.setup(kind, api, train.tiny_config(kind), OPTIMIZERS[opt]())
    return len(jax.tree.leaves(state))


def test_a_pipeline_over_two_processes_equals_jit(tmp_path):
    reports = _run("pipeline", tmp_path)
    plan = _check(reports, _num_leaves("pipeline"))
    # Stages 0-1 on process 0's devices, 2-3 on process 1's.
    owners = [{d // 2048 for d in devices} for devices in reports[0]["devices"]]
    assert owners == [{0}, {0}, {1}, {1}]
    assert plan.num_stages == 4
    assert [len(r["losses"]) for r in reports] == [0, 3]


def test_a_stage_over_both_processes_equals_jit(tmp_path):
    reports = _run("spanning", tmp_path)
    _check(reports, _num_leaves("spanning"))
    assert [{d // 2048 for d in devices} for devices in reports[0]["devices"]] == [{0, 1}]
    assert [len(r["losses"]) for r in reports] == [3, 3]


def test_stages_over_both_processes_pass_activations_block_by_block(tmp_path):
    reports = _run("across", tmp_path)
    _check(reports, _num_leaves("across"))
    assert [sorted(devices) for devices in reports[0]["devices"]] == [[0, 1, 2048, 2049], [2, 3, 2050, 2051]]
    assert [len(r["losses"]) for r in reports] == [3, 3]


def test_every_process_runs_process_0s_plan_and_layouts(tmp_path):
    # Process 1's stage search gives one stage and its ILPs pick first strategies; without
    # agreement the two would run different programs (and wait on each other's collectives).
    reports = _run("disagree", tmp_path)
    _check(reports, _num_leaves("disagree"))
    changed = reports[1]["changed"]
    assert changed["stages"] and all(own != other for own, other in changed["stages"])
    assert changed["layouts"]


@pytest.mark.slow  # ~2.5 min: the stage search and the ILPs on both processes
@pytest.mark.parametrize("case", ["auto_moe", "nnx"])
def test_searched_plans_and_nnx_over_two_processes_equal_jit(case, tmp_path):
    _check(_run(case, tmp_path), _num_leaves(case))
