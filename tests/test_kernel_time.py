"""Kernels: how many a step launches, what each costs beyond its work, and how the planner
prices them."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_fusion import F32, _gpt_tiny_profile, _ops

from autopar._src import cluster, fusion, kernel_time, planner
from autopar._src.cluster import ClusterSpec, DeviceSpec

W = jax.ShapeDtypeStruct((32, 32), jnp.float32)


def _kernels(fn, *args):
    return fusion.op_kernels(_ops(fn, *args))


def test_an_elementwise_chain_is_one_kernel_and_a_matmul_another():
    assert sum(_kernels(lambda x: jnp.exp(x) * jnp.sin(x) + 1.0, F32)) == 1
    # The matmul, and the tanh loop that reads its output: two, as XLA compiles them.
    assert _kernels(lambda x, w: jnp.tanh(x @ w), F32, W) == [1.0, 1.0]
    # The loop before a matmul is written for it: a kernel too.
    assert _kernels(lambda x, w: jnp.tanh(x) @ w, F32, W) == [1.0, 1.0]


def test_a_reshape_of_a_value_in_memory_is_no_kernel_but_one_of_a_loop_is():
    def relabel(x, w):
        return (x @ w).reshape(32, 64) @ w.reshape(64, 16)

    kernels = dict(
        zip((op.eqn.primitive.name for op in _ops(relabel, F32, W)), _kernels(relabel, F32, W), strict=True)
    )
    assert kernels["reshape"] == 0 and sum(_kernels(relabel, F32, W)) == 2
    # exp, then the reshape the matmul reads: one loop, counted where it is written.
    assert sum(_kernels(lambda x, w: jnp.exp(x).reshape(64, 32) @ w, F32, W)) == 2


def test_ops_that_cannot_fuse_are_kernels_and_regenerated_values_are_not():
    idx = jax.ShapeDtypeStruct((8,), jnp.int32)
    ops = _ops(lambda x, i: x[i] * 2.0, F32, idx)
    kernels = {op.eqn.primitive.name: k for op, k in zip(ops, fusion.op_kernels(ops), strict=True)}
    assert kernels["gather"] == 1 and kernels["mul"] == 1  # the gather, then the loop reading it
    ops = _ops(lambda x: jnp.where(x > 0, x, 0.0), F32)
    assert [k for op, k in zip(ops, fusion.op_kernels(ops), strict=True) if fusion.regenerated(op.eqn)] == [
        0.0
    ]
    assert sum(fusion.op_kernels(ops)) == 1


def test_a_scan_body_launches_its_kernels_every_iteration():
    xs = jax.ShapeDtypeStruct((5, 64, 32), jnp.float32)
    assert (
        sum(_kernels(lambda xs, w: jax.lax.scan(lambda c, x: (c, jnp.tanh(x @ w)), 0.0, xs)[1], xs, W)) >= 10
    )


def test_every_device_of_a_stage_pays_for_each_kernel_every_microbatch():
    prof = _gpt_tiny_profile()
    assert prof.kernels.shape == (prof.num_layers,) and np.all(prof.kernels > 0)
    spec = cluster.preset("cpu", devices_per_host=8)
    assert spec.device.kernel_time == 0.0  # no preset claims a figure
    timed = dataclasses.replace(spec, device=dataclasses.replace(spec.device, kernel_time=5e-6))
    last = prof.num_layers - 1
    launches = prof.kernels.sum() * 5e-6
    for m in (1, 4):
        base, costed = (
            planner.stage_costs(prof, s, num_microbatches=m, batch_scale=1 / m, tensor_parallel=False)
            for s in (spec, timed)
        )
        for n in (1, 2, 8):
            k = cluster.submesh_shapes(spec).index((1, n))
            # Not divided by the devices nor scaled with the microbatch: m microbatches pay m times.
            assert costed.compute[0, last, k, 0] - base.compute[0, last, k, 0] == pytest.approx(launches)
            assert costed.latency[0, last, k, 0] - base.latency[0, last, k, 0] == pytest.approx(launches)
        # A range of layers pays for its own kernels.
        assert costed.latency[0, 0, 0, 0] - base.latency[0, 0, 0, 0] == pytest.approx(prof.kernels[0] * 5e-6)


def test_a_bad_kernel_time_is_refused_and_an_older_spec_file_loads(tmp_path):
    device = cluster.preset("cpu").device
    for bad in (-1e-6, math.inf, "5us", True):
        with pytest.raises(ValueError, match="kernel_time"):
            dataclasses.replace(device, kernel_time=bad)
    data = cluster.preset("h100").to_dict()
    assert data["device"].pop("kernel_time") == 0.0
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert ClusterSpec.load(path) == cluster.preset("h100")
    timed = dataclasses.replace(
        cluster.preset("h100"), device=DeviceSpec(**{**data["device"], "kernel_time": 3e-6})
    )
    timed.save(path)
    assert ClusterSpec.load(path).device.kernel_time == 3e-6


def test_the_chain_matmuls_do_about_a_microsecond_of_work():
    assert kernel_time.link_size(20e9) == 16  # a CPU: the floor
    assert kernel_time.link_size(440e12) == 512  # an H200's float32 (TF32) peak
    assert kernel_time.link_size(1e18) == 1024
    for peak in (1e12, 100e12):
        n = kernel_time.link_size(peak)
        assert 0.125e-6 < 2 * n**3 / peak < 8e-6


def test_the_measured_kernel_time_is_what_the_chains_work_leaves(monkeypatch):
    devices = jax.devices()[:2]
    seconds = {64: 1.0e-3, 192: 2.6e-3}
    monkeypatch.setattr(kernel_time, "_chain_seconds", lambda d, n, links, r: seconds[links])
    peak, bandwidth = 20e9, 5e9
    n = kernel_time.link_size(peak)
    work = 2 * n**3 / peak + 8 * n * n / bandwidth
    measured = kernel_time.measure(devices, peak_flops=peak, memory_bandwidth=bandwidth, repeats=1)
    assert measured == pytest.approx((1.6e-3 / 128 - work) / 2)
    # Work that explains all the time leaves the floor, not a negative figure.
    assert kernel_time.measure(devices, peak_flops=1e6, memory_bandwidth=bandwidth, repeats=1) == 1e-7


def test_chains_on_the_cpu_devices_take_longer_the_more_kernels_they_run():
    devices = jax.devices()[:2]
    # Medians of 15 calls of about a millisecond: one call the host preempts (another process on
    # the same cores) moves a median of 3 past the other chain's.
    short, long = (kernel_time._chain_seconds(devices, 16, links, 15) for links in (8, 64))
    assert 0 < short < long
