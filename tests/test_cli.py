"""The command line: bad arguments end in one ``autopar <command>: error: ...`` line and exit status 2.

Every case here fails before any model is built or planned, so each takes well under a second.
"""

import json

import jax
import optax
import pytest

from autopar.__main__ import main
from autopar._src import cli, cli_args
from models import registry, train


def _error_line(capsys, argv: list[str]) -> str:
    """Runs ``main(argv)``, checks it exits with status 2, returns the last line on stderr."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert lines, "nothing on stderr"
    assert "Traceback" not in captured.err
    return lines[-1]


ARGUMENT_ERRORS = [
    # (argv, what the error line must contain)
    (["plan", "--model", "gpt-nope", "--cluster", "1x8xV100"], ["--model", "'gpt-nope'", "gpt-2.6b"]),
    (["plan", "--model", "gpt-tiny", "--cluster", "banana"], ["--cluster", "'banana'", "HOSTSxDEVICESxNAME"]),
    (["plan", "--model", "gpt-tiny", "--cluster", "1x8xTPU"], ["--cluster", "'TPU'", "v100"]),
    (["plan", "--model", "gpt-tiny", "--cluster", "0x8xV100"], ["--cluster", "num_hosts", "got 0"]),
    (
        ["plan", "--model", "gpt-tiny", "--cluster", "1x8xV100", "--microbatches", "-2"],
        ["--microbatches", "positive integer or 'auto'", "-2"],
    ),
    (
        ["plan", "--model", "gpt-tiny", "--cluster", "1x8xV100", "--microbatches", "foo"],
        ["--microbatches", "positive integer or 'auto'", "'foo'"],
    ),
    (
        ["plan", "--model", "gpt-tiny", "--cluster", "1x8xV100", "--batch-size", "0"],
        ["--batch-size", "positive integer", "got 0"],
    ),
    (
        ["plan", "--model", "gpt-tiny", "--cluster", "1x8xV100", "--batch-size", "-4"],
        ["--batch-size", "positive integer", "got -4"],
    ),
    (["plan", "--model", "gpt-tiny"], ["one of the arguments --cluster --cluster-file is required"]),
    (["compare", "--stages", "0"], ["--stages", "positive integer or 'auto'", "got 0"]),
    (["compare", "--devices", "0"], ["--devices", "positive integer", "got 0"]),
    (["compare", "--steps", "0"], ["--steps", ">= 2", "got 0"]),
    (["compare", "--steps", "1"], ["--steps", ">= 2", "got 1"]),
    (["compare", "--microbatches", "0"], ["--microbatches", "positive integer"]),
    (["compare", "--batch-size", "x"], ["--batch-size", "positive integer", "'x'"]),
    (["compare", "--model", "gpt3-175b"], ["--model", "'gpt3-175b'", "too large", "gpt-tiny"]),
    (["compare", "--model", "nope"], ["--model", "unknown model 'nope'", "gpt-tiny"]),
    (["bench", "--model", "nope"], ["--model", "unknown model 'nope'", "gpt-small"]),
    (["bench", "--model", "bert-large"], ["--model", "'bert-large'", "too large", "bert-small"]),
    (["bench", "--rounds", "0"], ["--rounds", "positive integer", "got 0"]),
    (["bench", "--devices", "0"], ["--devices", "positive integer", "got 0"]),
    (["bench", "--stages", "1", "x"], ["--stages", "positive integer or 'auto'", "'x'"]),
    (["calibrate", "--devices", "0"], ["--devices", "positive integer", "got 0"]),
    (["demo", "--steps", "0"], ["--steps", "positive integer", "got 0"]),
    (["demo", "--stages", "-1"], ["--stages", "positive integer", "got -1"]),
]


@pytest.mark.parametrize(("argv", "expected"), ARGUMENT_ERRORS, ids=[" ".join(a) for a, _ in ARGUMENT_ERRORS])
def test_bad_arguments_give_one_error_line(capsys, argv, expected):
    line = _error_line(capsys, argv)
    assert line.startswith(f"autopar {argv[0]}: error: "), line
    for text in expected:
        assert text in line, (text, line)


def test_plan_refuses_both_cluster_options(capsys, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cli_args.cluster_text("1x8xV100").to_dict()))
    argv = ["plan", "--model", "gpt-tiny", "--cluster", "1x8xV100", "--cluster-file", str(path)]
    line = _error_line(capsys, argv)
    assert line.startswith("autopar plan: error: ") and "not allowed with" in line, line


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "No such file or directory"),
        ("{not json", "is not a cluster spec JSON file"),
        ("[1, 2]", "ClusterSpec data must be a JSON object, got list"),
        # ClusterSpec.from_dict's own message names the missing fields.
        ('{"name": "x"}', "ClusterSpec data has no ['device', 'devices_per_host'"),
    ],
)
def test_plan_reports_a_bad_cluster_file(capsys, tmp_path, content, expected):
    path = tmp_path / "cluster.json"
    if content is not None:
        path.write_text(content)
    line = _error_line(capsys, ["plan", "--model", "gpt-tiny", "--cluster-file", str(path)])
    assert line.startswith("autopar plan: error: argument --cluster-file: "), line
    assert str(path) in line and expected in line, line
    if content == '{"name": "x"}':
        assert "devices_per_host" in line, line


@pytest.mark.parametrize(
    "argv",
    [
        ["calibrate", "--out", "{missing}/c.json"],
        ["plan", "--model", "gpt-tiny", "--cluster", "1x8xV100", "--json", "{missing}/p.json"],
        ["plan", "--model", "gpt-tiny", "--cluster", "1x8xV100", "--timeline", "{missing}/t.png"],
    ],
)
def test_outputs_in_a_missing_directory_are_refused_before_any_work(capsys, tmp_path, argv):
    missing = tmp_path / "no" / "such"
    argv = [a.format(missing=missing) for a in argv]
    line = _error_line(capsys, argv)
    assert f"the directory {str(missing)!r}" in line and "does not exist" in line, line
    assert not missing.exists()


def test_output_that_is_a_directory_is_refused(capsys, tmp_path):
    line = _error_line(capsys, ["calibrate", "--out", str(tmp_path)])
    assert "is a directory" in line, line


def test_compare_names_the_device_counts_its_manual_mesh_can_use(capsys):
    # Megatron's mesh is 2 x N/2: odd counts cannot be reshaped and 6 (2 x 3) does not divide
    # gpt-tiny's 64-wide layers; the check uses shapes only, before JAX is asked for devices.
    for devices in ("3", "6"):
        line = _error_line(capsys, ["compare", "--model", "gpt-tiny", "--devices", devices])
        assert line.startswith(f"autopar compare: error: --devices {devices} does not fit"), line
        assert "[2, 4, 8, 16, 32, 64]" in line, line
    line = _error_line(capsys, ["compare", "--manual", "data", "--devices", "6", "--batch-size", "16"])
    assert "pjit data plan" in line and "[1, 2, 4, 8, 16]" in line, line


def test_bench_checks_the_batch_splits_over_the_devices(capsys):
    line = _error_line(capsys, ["bench", "--model", "mlp", "--devices", "5", "--batch-size", "32"])
    assert line.startswith("autopar bench: error: --batch-size 32 does not split over --devices 5"), line
    assert "[1, 2, 4, 8, 16, 32]" in line, line


def test_errors_from_inside_a_command_are_one_line(capsys, monkeypatch):
    def fail(args):
        raise ValueError("first line\nsecond line")

    monkeypatch.setattr(cli, "run_bench", fail)
    assert _error_line(capsys, ["bench", "--model", "mlp"]) == "autopar bench: error: first line second line"

    def missing(args):
        open("/no/such/file.json")

    monkeypatch.setattr(cli, "run_bench", missing)
    line = _error_line(capsys, ["bench", "--model", "mlp"])
    assert line == "autopar bench: error: No such file or directory: '/no/such/file.json'"


def test_programming_errors_are_not_swallowed(monkeypatch):
    def broken(args):
        return None + 1

    monkeypatch.setattr(cli, "run_bench", broken)
    with pytest.raises(TypeError):
        main(["bench", "--model", "mlp"])


def test_cpu_presets_are_the_small_ones():
    presets = cli_args.cpu_presets()
    assert {"mlp", "gpt-tiny", "gpt-small", "bert-tiny", "moe-tiny", "wresnet-tiny"} <= set(presets)
    assert set(presets) <= set(registry.names())
    assert not {"gpt3-175b", "gpt-2.6b", "bert-large", "wresnet-1b", "moe-1.3b"} & set(presets)
    for name in presets:
        kind, config = registry.lookup(name)
        state = jax.eval_shape(
            lambda kind=kind, config=config: train.linen_state(kind, config, optax.sgd(0.1))
        )
        num_params = sum(leaf.size for leaf in jax.tree.leaves(state.params))
        assert num_params < 5_000_000, (name, num_params)


def test_argument_types():
    assert cli_args.positive_int("3") == 3
    assert cli_args.positive_int_or_auto("auto") == "auto"
    assert cli_args.positive_int_or_auto("4") == 4
    assert cli_args.int_at_least(2)("2") == 2
    assert cli_args.cpu_preset_name("gpt-tiny") == "gpt-tiny"
    assert cli_args.preset_name("gpt3-175b") == "gpt3-175b"
    assert cli_args.cluster_text("2x8xH100").num_devices == 16
