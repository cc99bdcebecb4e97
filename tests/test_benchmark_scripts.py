"""The benchmark scripts run end to end and end with their ``name=value`` summary line."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, *args: str) -> list[str]:
    env = dict(os.environ)
    # The scripts choose their own device count; this suite's 8-device flag would contradict it.
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # as in conftest.py
    proc = subprocess.run(
        [sys.executable, os.path.join("benchmarks", script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()


def _error(script: str, *args: str) -> str:
    """The stderr of a script run that must fail."""
    proc = subprocess.run(
        [sys.executable, os.path.join("benchmarks", script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0, f"{script} {args} succeeded:\n{proc.stdout[-3000:]}"
    return proc.stderr


@pytest.mark.parametrize("costs", ["analytic", pytest.param("ilp", marks=pytest.mark.slow)])  # ilp: ~50 s
def test_plan_quality_smoke_writes_results_and_ends_with_the_ratio(tmp_path, costs):
    journal = tmp_path / "journal.jsonl"
    lines = _run(
        "plan_quality.py", "--smoke", "--costs", costs, "--out-dir", str(tmp_path), "--journal", str(journal)
    )
    match = re.fullmatch(r"min_ratio_vs_best_grid=(\S+)", lines[-1])
    assert match, lines[-1]
    # Every grid is a plan the stage search considers, so autopar is never slower.
    assert float(match[1]) >= 1 - 1e-9
    [md] = [p for p in os.listdir(tmp_path) if p.endswith(".md")]
    assert md.startswith("plan_quality_ilp_smoke_" if costs == "ilp" else "plan_quality_smoke_")
    assert "| gpt-small | 8xV100 |" in (tmp_path / md).read_text()
    data = json.loads((tmp_path / md.replace(".md", ".json")).read_text())
    [cell] = data["cells"]
    assert cell["autopar"]["seconds"] > 0 and "8x1x1" in cell["grids"] and cell["costs"] == costs
    # The bound is below every plan: autopar's and each grid's that fits.
    seconds = [cell["autopar"]["seconds"], *(g["seconds"] for g in cell["grids"].values() if g)]
    assert 0 < cell["bound"] <= min(seconds)
    assert cell["layer_counts"] == [cell["layers"]]  # a transformer: every factor, one clustering
    # The journaled plan is read back as it is, not planned again.
    [record] = [json.loads(line) for line in journal.read_text().splitlines()]
    assert record["cell"] == {k: v for k, v in cell.items() if k != "layer_counts"}
    record["cell"]["autopar"]["seconds"] *= 2  # a mark: proves the plan was read back, not redone
    journal.write_text(json.dumps(record) + "\n")
    _run(
        "plan_quality.py", "--smoke", "--costs", costs, "--out-dir", str(tmp_path), "--journal", str(journal)
    )
    [again] = json.loads((tmp_path / md.replace(".md", ".json")).read_text())["cells"]
    assert again["autopar"]["seconds"] == 2 * cell["autopar"]["seconds"]
    assert len(journal.read_text().splitlines()) == 1


def test_plan_quality_prices_kernels_when_given_a_time_per_kernel(tmp_path):
    _run("plan_quality.py", "--smoke", "--out-dir", str(tmp_path / "none"))
    _run("plan_quality.py", "--smoke", "--kernel-time", "1e-5", "--out-dir", str(tmp_path / "timed"))
    [plain], [timed] = (
        [p for p in os.listdir(tmp_path / d) if p.endswith(".json")] for d in ("none", "timed")
    )
    assert timed.startswith("plan_quality_kernels_smoke_") and plain.startswith("plan_quality_smoke_")
    (before,), (after,) = (
        json.loads((tmp_path / d / f).read_text())["cells"] for d, f in (("none", plain), ("timed", timed))
    )
    # Every plan and the bound cost more, and the bound stays below every plan.
    assert after["autopar"]["seconds"] > before["autopar"]["seconds"] and after["bound"] > before["bound"]
    seconds = [after["autopar"]["seconds"], *(g["seconds"] for g in after["grids"].values() if g)]
    assert 0 < after["bound"] <= min(seconds)
    assert "10.00 us" in (tmp_path / "timed" / timed.replace(".json", ".md")).read_text()
    assert "--kernel-time must be seconds" in _error("plan_quality.py", "--smoke", "--kernel-time", "-1")


def test_plan_gap_factors_multiply_to_the_step_over_the_bound():
    import types

    import numpy as np

    from autopar._src import stages
    from benchmarks.plan_gap import decompose

    one = np.array([3.0, 1.0, 2.0, 2.0, 5.0, 1.0]) * 1e-3  # each layer on one device
    submeshes, num_devices, b = ((1, 1), (1, 2), (1, 4)), 4, 8
    prefix = np.concatenate([[0.0], np.cumsum(one)])
    work = prefix[None, 1:] - prefix[:-1, None]  # [i, j]: layers i..j
    latency = np.full((6, 6, 3, 1), np.inf)
    for k, (_, n) in enumerate(submeshes):  # 10% over perfect scaling, plus 0.1 ms per stage
        latency[..., k, 0] = np.where(np.triu(np.ones((6, 6))) > 0, 1.1 * work / n + 1e-4, np.inf)
    zeros = np.zeros_like(latency)
    sol = stages.solve_stages(
        latency, zeros, zeros, submesh_devices=[1, 2, 4], memory_budget=1.0, num_devices=num_devices,
        num_microbatches=b,
    )  # fmt: skip
    costs = types.SimpleNamespace(
        latency=latency, submeshes=submeshes, logical=[[(1, 1)], [(2, 1)], [(4, 1)]]
    )
    gap, rows = decompose(costs, one, sol, b, num_devices)
    assert len(rows) == len(sol.stages) and gap["step"] == pytest.approx(sol.objective)
    assert gap["bound"] == pytest.approx(one.sum() * b / num_devices)
    product = gap["bubble"] * gap["imbalance"] * gap["inefficiency"]
    assert gap["step"] / gap["bound"] == pytest.approx(product)
    assert gap["bubble"] >= 1 and gap["imbalance"] >= 1 and gap["inefficiency"] > 1.1


def test_plan_quality_cell_takes_the_fastest_plans_over_its_clusterings():
    from benchmarks._plan_table import combine, table_row

    def plan(seconds, layers, microbatches=8):
        return {"seconds": seconds, "microbatches": microbatches, "layers": layers, "stages": []}

    base = dict(
        model="m",
        family="wresnet",
        preset="v100",
        devices=16,
        trace_seconds=1.0,
        plan_seconds=2.0,
        microbatch_candidates=[8],
    )
    coarse = {
        **base,
        "layers": 11,
        "autopar": plan(3.0, 11),
        "autopar_tp1": plan(4.0, 11),
        "grids": {"16x1x1": plan(5.0, 11), "4x1x4": None},
        "bound": 1.0,
    }
    fine = {
        **base,
        "layers": 20,
        "autopar": plan(2.5, 20),
        "autopar_tp1": None,
        "grids": {"16x1x1": plan(6.0, 20), "4x1x4": plan(4.5, 20)},
        "bound": 0.9,
    }
    # The coarse clustering again at 2 microbatches: a cell of its own, as the ILP runs plan them.
    coarse_2 = {
        **coarse,
        "microbatch_candidates": [2],
        "autopar": plan(2.8, 11, 2),
        "autopar_tp1": plan(4.5, 11, 2),
        "grids": {"16x1x1": plan(4.8, 11, 2), "4x1x4": None},
        "bound": 0.95,
    }
    cell = combine([coarse, fine, coarse_2])
    assert cell["autopar"] == fine["autopar"] and cell["autopar_tp1"] == coarse["autopar_tp1"]
    assert cell["grids"] == {"16x1x1": coarse_2["grids"]["16x1x1"], "4x1x4": fine["grids"]["4x1x4"]}
    assert (cell["layers"], cell["layer_counts"], cell["bound"]) == (20, [11, 20], 0.9)
    assert cell["microbatch_candidates"] == [2, 8]
    assert (cell["trace_seconds"], cell["plan_seconds"]) == (3.0, 6.0)
    row = table_row(cell)
    assert row[2] == "20 (11/20)" and row[5] == "4x1x4" and row[7] == f"{4.5 / 2.5:.3f}"


def test_gpu_single_tiny_ends_with_mfu(tmp_path):
    lines = _run(
        "gpu_single.py", "--tiny", "--steps", "3", "--microbatches", "1", "2", "--out-dir", str(tmp_path)
    )
    match = re.fullmatch(r"mfu=(\S+)", lines[-1])
    assert match, lines[-1]
    assert 0 < float(match[1]) < float("inf")
    [md] = os.listdir(tmp_path)
    text = (tmp_path / md).read_text()
    assert md.startswith("gpu_single_") and "jax.jit" in text
    # One row per microbatch count, and each one's loss against jax.jit's.
    assert "| autopar (1 stage, 1 microbatch) |" in text and "| autopar (1 stage, 2 microbatches) |" in text
    diffs = re.search(r"1 microbatch\(es\) (\S+), 2 microbatch\(es\) (\S+)", text)
    assert diffs and all(float(d) < 1e-3 for d in diffs.groups()), diffs


def test_gpu_single_rejects_a_microbatch_count_that_does_not_divide_the_batch():
    assert "--microbatches 3" in _error("gpu_single.py", "--tiny", "--microbatches", "3")


def test_cost_model_repredicts_recorded_measurements_without_measuring(tmp_path):
    from autopar._src import cluster

    spec = cluster.preset("h200", devices_per_host=1)
    spec.save(tmp_path / "h200.json")
    recorded = tmp_path / "cost_model_gpu1_2026-01-01.md"
    # A results file of measurements from other devices (a GPU run), with its table alone.
    recorded.write_text(
        "# Cost model\n\n| model | devices | measured ms | predicted ms (calibrated) |\n"
        "|---|---|---|---|\n| mlp | 1 | 0.50 | 9.99 |\n| bert-tiny | 1 | 2.00 | 9.99 |\n"
    )
    args = ["--measured-from", str(recorded), "--cluster-file", str(tmp_path / "h200.json")]
    lines = _run("cost_model.py", *args, "--preset", "h200", "--no-progress", "--out-dir", str(tmp_path))
    ratio = float(re.fullmatch(r"median_ratio=(\S+)", lines[-1])[1])
    [md] = [p for p in os.listdir(tmp_path) if p.startswith("cost_model_repredicted_gpu1_2026-01-01_")]
    text = (tmp_path / md).read_text()
    assert (
        "Measurements read from" in text
        and "| mlp | 1 | 1 | 0.50 |" in text
        and "| bert-tiny | 1 | 1 | 2.00 |" in text
    )
    # The predictions are this version's, not the file's.
    assert "9.99" not in text and 0 < ratio < 9.99 / 0.5
    assert "needs --cluster-file" in _error("cost_model.py", "--measured-from", str(recorded))


def test_gradient_reductions_tiny_defers_and_ends_with_the_speedup(tmp_path):
    lines = _run(
        "gradient_reductions.py", "--hidden", "128", "--batch-size", "1024", "--microbatches", "2",
        "--rounds", "2", "--out-dir", str(tmp_path),
    )  # fmt: skip
    match = re.fullmatch(r"deferred_speedup=(\S+)", lines[-1])
    assert match, lines[-1]
    assert 0 < float(match[1]) < float("inf")
    [md] = os.listdir(tmp_path)
    text = (tmp_path / md).read_text()
    # Deferred: one all-reduce per microbatch (the loss) and one for the gradients. Per
    # microbatch: each microbatch's task (forward and backward joined) reduces the loss and
    # the gradients together, XLA combining them into one all-reduce.
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| autopar")]
    assert [int(r[1]) for r in rows] == [3, 2], rows
    # ... and the gradients' bytes once rather than once per microbatch.
    assert 0 < float(rows[0][2]) < float(rows[1][2]), rows
    assert "gradients kept as partial sums: 6 of 6" in text


def test_multihost_tiny_runs_both_ways_and_ends_with_the_step_ratio(tmp_path):
    lines = _run(
        "multihost.py", "--model", "gpt-tiny", "--batch-size", "16", "--rounds", "2", "--repeats", "1",
        "--mib", "1", "--timeout", "240", "--out-dir", str(tmp_path),
    )  # fmt: skip
    match = re.fullmatch(r"multihost_step_ratio=(\S+)", lines[-1])
    assert match, lines[-1]
    assert 0 < float(match[1]) < float("inf")
    [md] = os.listdir(tmp_path)
    rows = [line.split(" | ") for line in (tmp_path / md).read_text().splitlines() if line.startswith("| ")]
    assert [r[:2] for r in rows[1:]] == [
        ["| one process, 8 devices", "step"],
        ["| one process, 8 devices", "move 1 MiB"],
        ["| two processes, 4 devices each", "step"],
        ["| two processes, 4 devices each", "move 1 MiB"],
    ]


def test_task_overhead_counts_more_tasks_with_more_microbatches_and_fits_their_cost(tmp_path):
    lines = _run("task_overhead.py", "--microbatches", "1", "4", "--rounds", "3", "--out-dir", str(tmp_path))
    match = re.fullmatch(r"task_overhead_us=(\S+)", lines[-1])
    assert match, lines[-1]
    [md] = os.listdir(tmp_path)
    text = (tmp_path / md).read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| 1 stage")]
    # One fused task for one microbatch; for four, one per microbatch (its forward and backward
    # joined), the running sums' start and the update: the fit has two distinct task counts.
    tasks = [int(r[1]) for r in rows]
    assert tasks == [1, 6], rows
    assert "the planner's constant: 100.0 us" in text
    # JAX's own cost per buffer passed: positive, and the calls of more arrays take longer.
    per_buffer = re.fullmatch(r"dispatch_per_buffer_us=(\S+)", lines[-2])
    assert per_buffer and float(per_buffer[1]) > 0, lines[-2]
    widths = re.search(r"calls of n arrays: 1: (\d+) us, 64: \d+ us, 256: \d+ us, 1024: (\d+) us", text)
    assert widths and int(widths[2]) > int(widths[1]), text
    # Through two points the fitted slope is the step time added per task of the table. The table
    # rounds each time to 0.0005 ms and the slope to 0.05 us: the bound allows exactly that.
    ms = [float(r[3]) for r in rows]
    rounding_us = 2 * 0.0005e3 / (tasks[1] - tasks[0]) + 0.05
    slope_us = (ms[1] - ms[0]) / (tasks[1] - tasks[0]) * 1e3
    assert float(match[1]) == pytest.approx(slope_us, abs=rounding_us + 1e-9)


def test_task_overhead_rejects_a_microbatch_count_that_does_not_divide_the_batch():
    assert "--microbatches 3" in _error("task_overhead.py", "--microbatches", "3")


def test_cost_model_reads_measurements_with_and_without_a_microbatch_column(tmp_path):
    sys.path.insert(0, ROOT)
    from benchmarks.cost_model import read_measurements

    old = tmp_path / "old.md"
    old.write_text("| model | devices | measured ms | x |\n|---|---|---|---|\n| mlp | 2 | 1.50 | 9 |\n")
    new = tmp_path / "new.md"
    new.write_text(
        "| model | devices | microbatches | measured ms |\n|---|---|---|---|\n"
        "| mlp | 1 | 1 | 0.50 |\n| mlp | 1 | 4 | 2.00 |\n"
    )
    assert read_measurements(str(old)) == {("mlp", 2, 1): pytest.approx(1.5e-3)}
    assert read_measurements(str(new)) == {
        ("mlp", 1, 1): pytest.approx(0.5e-3),
        ("mlp", 1, 4): pytest.approx(2e-3),
    }
    bad = tmp_path / "bad.md"
    bad.write_text("| name | value |\n|---|---|\n| a | 1 |\n")
    with pytest.raises(ValueError, match="measured ms"):
        read_measurements(str(bad))
