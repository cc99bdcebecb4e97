"""The sources pass the project's linters and type checker (configured in pyproject.toml)."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTHON = ["autopar", "models", "tests", "benchmarks"]


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", *PYTHON],
        ["ruff", "format", "--check", *PYTHON],
        ["mypy"],
    ],
    ids=lambda c: " ".join(c),
)
def test_sources_pass(command):
    done = subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
