"""Memory traffic as XLA's fusion leaves it, and its place in the analytic stage costs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from autopar._src import cluster, fusion, planner, planning, profile, trace
from models import train

F32 = jax.ShapeDtypeStruct((64, 32), jnp.float32)
BYTES = 64 * 32 * 4


def _traffic(fn, *args):
    return fusion.equation_traffic(jax.make_jaxpr(fn)(*args).jaxpr)


def test_an_elementwise_chain_writes_only_its_result():
    # exp and sin fuse into the mul's loop; only the output is written (and read back once).
    traffic = _traffic(lambda x: jnp.exp(x) * jnp.sin(x) + 1.0, F32)
    assert sum(traffic) == fusion.TRAFFIC_PER_WRITE * BYTES
    assert traffic[-1] == fusion.TRAFFIC_PER_WRITE * BYTES


def test_a_value_a_matmul_reads_is_written_and_the_matmul_moves_nothing():
    w = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    traffic = _traffic(lambda x, w: jnp.tanh(x) @ w, F32, w)
    assert traffic == [fusion.TRAFFIC_PER_WRITE * BYTES, 0.0]


def test_reductions_and_broadcasts_fuse_so_a_softmax_writes_its_result():
    traffic = _traffic(lambda x: jax.nn.softmax(x, axis=-1), F32)
    # The call's body holds the whole softmax; its output leaves the body and is written.
    assert sum(traffic) == fusion.TRAFFIC_PER_WRITE * BYTES


def test_a_scan_body_is_charged_once_per_iteration():
    def body(c, x):
        return c, jnp.exp(x) * 2.0

    xs = jax.ShapeDtypeStruct((5, 64, 32), jnp.float32)
    traffic = _traffic(lambda xs: jax.lax.scan(body, 0.0, xs)[1], xs)
    assert sum(traffic) == 5 * fusion.TRAFFIC_PER_WRITE * BYTES


def test_the_analytic_stage_costs_price_the_traffic_over_memory_bandwidth():
    config = train.tiny_config("gpt")
    step, state = train.setup("gpt", "linen", config, optax.sgd(0.1))
    batch = train.make_batch("gpt", config, 16)
    num_state = len(jax.tree.leaves(state))
    ids = tuple(range(num_state, num_state + len(batch)))
    traced = planning.trace_at(step, (state, batch), ids, 16, trace.TraceOptions(num_layers=None))
    prof = profile.layer_profile(traced, ids)
    assert prof.forward_traffic.shape == prof.backward_traffic.shape == (prof.num_layers,)
    assert np.all(prof.forward_traffic > 0) and np.all(prof.backward_traffic > 0)

    spec = cluster.preset("cpu", devices_per_host=8)
    slow = dataclasses.replace(spec, device=dataclasses.replace(spec.device, memory_bandwidth=1e9))
    last = prof.num_layers - 1
    k = cluster.submesh_shapes(spec).index((1, 2))
    fast_costs, slow_costs = (
        planner.stage_costs(prof, s, num_microbatches=1, tensor_parallel=False) for s in (spec, slow)
    )
    traffic = prof.forward_traffic.sum() + prof.backward_traffic.sum()
    moved = traffic / 2 * (1 / slow.device.memory_bandwidth - 1 / spec.device.memory_bandwidth)
    # Two data-parallel devices each move half the bytes; nothing else depends on bandwidth.
    assert slow_costs.compute[0, last, k, 0] - fast_costs.compute[0, last, k, 0] == pytest.approx(moved)
    assert slow_costs.latency[0, last, k, 0] - fast_costs.latency[0, last, k, 0] == pytest.approx(moved)
