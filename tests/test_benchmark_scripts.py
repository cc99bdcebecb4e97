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
    env.pop("XLA_FLAGS", None)
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


@pytest.mark.parametrize("costs", ["analytic", "ilp"])
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
    # A journaled cell without a bound (planned before cells recorded it) is read back and gets
    # only its bound computed; the cells recorded since read back as they are.
    [record] = [json.loads(line) for line in journal.read_text().splitlines()]
    assert record["cell"] == cell
    del record["cell"]["bound"]
    record["cell"]["autopar"]["seconds"] *= 2  # a mark: proves the plan was read back, not redone
    journal.write_text(json.dumps(record) + "\n")
    _run(
        "plan_quality.py", "--smoke", "--costs", costs, "--out-dir", str(tmp_path), "--journal", str(journal)
    )
    [again] = json.loads((tmp_path / md.replace(".md", ".json")).read_text())["cells"]
    assert again["autopar"]["seconds"] == 2 * cell["autopar"]["seconds"]
    assert again["bound"] == pytest.approx(cell["bound"], rel=1e-12)
    assert len(journal.read_text().splitlines()) == 2


def test_gpu_single_tiny_ends_with_mfu(tmp_path):
    lines = _run("gpu_single.py", "--tiny", "--steps", "3", "--out-dir", str(tmp_path))
    match = re.fullmatch(r"mfu=(\S+)", lines[-1])
    assert match, lines[-1]
    assert 0 < float(match[1]) < float("inf")
    [md] = os.listdir(tmp_path)
    assert md.startswith("gpu_single_") and "jax.jit" in (tmp_path / md).read_text()
