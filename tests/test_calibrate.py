"""Device calibration: measured specs are valid, round-trip through JSON and drive the planner."""

import argparse
import dataclasses
import math

import jax
import optax
import pytest

import autopar
from autopar._src import calibrate as calibrate_mod
from autopar._src import cli, cluster, report
from autopar._src.cluster import ClusterSpec
from models import train


@pytest.fixture(scope="module")
def spec8() -> ClusterSpec:
    return calibrate_mod.calibrate(quick=True, progress=False)


def _figures(spec: ClusterSpec) -> list[float]:
    return [
        *dict(spec.device.peak_flops).values(),
        spec.device.memory_bandwidth,
        spec.device.memory_bytes,
        spec.device.kernel_time,
        spec.intra_host_bandwidth,
        spec.intra_host_latency,
        spec.inter_host_bandwidth,
        spec.inter_host_latency,
    ]


def test_calibration_describes_the_eight_cpu_devices(spec8):
    assert spec8.num_hosts == jax.process_count() == 1
    assert spec8.devices_per_host == 8 and spec8.num_devices == 8
    assert sorted(dict(spec8.device.peak_flops)) == sorted(cluster.REQUIRED_DTYPES)
    for value in _figures(spec8):
        assert math.isfinite(value) and value > 0, spec8
    # The CPU runtime reports no memory size: it comes from the CPU preset, as do links between hosts.
    base = cluster.preset("cpu")
    assert spec8.device.memory_bytes == base.device.memory_bytes
    assert spec8.inter_host_latency == base.inter_host_latency
    assert spec8.inter_host_bandwidth <= spec8.intra_host_bandwidth
    # Each kernel costs the CPU devices more than the floor a chain whose work explained it all would give.
    assert spec8.device.kernel_time > 1e-7
    # The link was measured, not copied.
    assert (spec8.intra_host_bandwidth, spec8.intra_host_latency) != (
        base.intra_host_bandwidth,
        base.intra_host_latency,
    )


def test_calibration_round_trips_through_json(spec8, tmp_path):
    path = tmp_path / "cluster.json"
    spec8.save(path)
    loaded = ClusterSpec.load(path)
    assert loaded == spec8
    assert autopar.ClusterSpec.load(path) == spec8


def test_planner_accepts_a_calibrated_spec(spec8, tmp_path):
    path = tmp_path / "cluster.json"
    spec8.save(path)
    config = train.tiny_config("mlp")
    step, state = train.setup("mlp", "linen", config, optax.sgd(0.1))
    batch = train.make_batch("mlp", config, 16)
    plan = autopar.plan_step(step, state, batch, cluster=ClusterSpec.load(path))
    used = sorted(d for st in plan.stages for d in st.device_ids)
    assert used == list(range(8))


def test_single_device_keeps_the_base_links():
    base = dataclasses.replace(
        cluster.preset("cpu"), intra_host_bandwidth=3e9, intra_host_latency=7e-6, inter_host_bandwidth=1e9
    )
    spec = calibrate_mod.calibrate(jax.devices()[:1], quick=True, progress=False, base=base)
    assert spec.devices_per_host == 1 and spec.num_hosts == 1
    assert spec.intra_host_bandwidth == 3e9 and spec.intra_host_latency == 7e-6
    assert spec.inter_host_bandwidth == 1e9 and spec.inter_host_latency == base.inter_host_latency
    assert spec.device.memory_bytes == base.device.memory_bytes
    for value in _figures(spec):
        assert math.isfinite(value) and value > 0, spec


def test_calibrate_command_prints_the_table_and_writes_the_spec(tmp_path, capsys):
    path = tmp_path / "out" / "cluster.json"
    path.parent.mkdir()
    args = argparse.Namespace(out=str(path), quick=True, devices=2, progress=False)
    assert cli.run_calibrate(args) == 0
    spec = ClusterSpec.load(path)
    assert spec.devices_per_host == 2
    printed = capsys.readouterr().out
    for row in (
        "peak float32",
        "peak bfloat16",
        "peak float16",
        "memory bandwidth",
        "time per kernel",
        "intra-host link",
    ):
        assert row in printed
    assert str(path) in printed


def test_command_line_parser():
    parser = argparse.ArgumentParser()
    cli.add_calibrate(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calibrate", "--quick", "--devices", "4", "--out", "c.json"])
    assert (args.command, args.quick, args.devices, args.out, args.progress) == (
        "calibrate",
        True,
        4,
        "c.json",
        True,
    )
    args = parser.parse_args(["calibrate", "--no-progress"])
    assert (args.quick, args.devices, args.out, args.progress) == (False, None, None, False)


def test_bad_devices_are_refused():
    with pytest.raises(ValueError, match="at least one device"):
        calibrate_mod.calibrate([], progress=False)
    device = jax.devices()[0]
    with pytest.raises(ValueError, match="twice"):
        calibrate_mod.calibrate([device, device], progress=False)
    with pytest.raises(ValueError, match="--devices must be >= 1"):
        cli.run_calibrate(argparse.Namespace(out=None, quick=True, devices=0, progress=False))
    with pytest.raises(ValueError, match="fresh process"):
        cli.run_calibrate(argparse.Namespace(out=None, quick=True, devices=64, progress=False))


def test_default_base_matches_the_platform():
    assert calibrate_mod.default_base(jax.devices()[0]) == cluster.preset("cpu")


def test_steps_report_progress_and_refuse_non_finite_figures():
    results: dict[str, float] = {}
    calibrate_mod._run_steps([("one", lambda: 1.0), ("two", lambda: 2.0)], results, progress=True)
    assert results == {"one": 1.0, "two": 2.0}
    with pytest.raises(calibrate_mod.CalibrationError, match="'broken' measured nan"):
        calibrate_mod._run_steps([("broken", lambda: float("nan"))], {}, progress=False)
    with pytest.raises(calibrate_mod.CalibrationError, match="measured 0.0"):
        calibrate_mod._run_steps([("zero", lambda: 0.0)], {}, progress=False)


def test_the_link_bandwidth_is_the_slope_of_the_ring_times_and_ignores_a_cache_cliff():
    n, fixed, bandwidth = 8, 14 * 30e-6, 2e9
    sizes = [2**k for k in range(18, 26)]
    seconds = [fixed + 2 * (n - 1) / n * b / bandwidth for b in sizes]
    assert calibrate_mod.ring_bandwidth(sizes, seconds, n, fixed) == pytest.approx(bandwidth)
    # The largest message falls off the caches (10x slower) and the smallest reads high: the
    # median of the pairwise slopes is still the line's.
    cliff = [seconds[0] * 1.5, *seconds[1:-1], seconds[-1] * 10]
    assert calibrate_mod.ring_bandwidth(sizes, cliff, n, fixed) == pytest.approx(bandwidth)
    # One size, or no positive slope: the largest message with its transfer floored at half.
    assert calibrate_mod.ring_bandwidth([2**20], [4 * fixed], n, fixed) == pytest.approx(
        2 * (n - 1) / n * 2**20 / (3 * fixed)
    )
    flat = calibrate_mod.ring_bandwidth([2**18, 2**19], [fixed, fixed], n, fixed)
    assert flat == pytest.approx(2 * (n - 1) / n * 2**19 / (0.5 * fixed))


def test_cluster_table_lists_every_figure():
    text = report.cluster_table(cluster.H100_SXM_8)
    assert "989.00 TFLOP/s" in text and "3.35 TB/s" in text and "450.00 GB/s" in text
    assert "5.00 us" in text and "74.51 GiB" in text
    assert "time per kernel" in text
