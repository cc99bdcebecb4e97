"""Memory traffic as XLA's fusion leaves it: the rule, the ILP's nodes and the analytic stage costs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_strategies import MEM_BW, mesh

from autopar._src import cluster, fusion, planner, planning, profile, trace
from autopar._src.expansion import expand_calls
from autopar._src.strategy_graph import GraphOp, build_graph
from models import train

F32 = jax.ShapeDtypeStruct((64, 32), jnp.float32)
BYTES = 64 * 32 * 4
WRITE = fusion.TRAFFIC_PER_WRITE * BYTES


def _ops(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr

    def name(v):
        return None if isinstance(v, jax.extend.core.Literal) else v

    ops, alias = [], {}
    for e in jaxpr.eqns:
        ops += expand_calls(GraphOp(e, tuple(map(name, e.invars)), tuple(map(name, e.outvars))), alias, [])
    return ops


def _traffic(fn, *args):
    return fusion.op_traffic(_ops(fn, *args))


def test_an_elementwise_chain_writes_only_its_result():
    # exp and sin fuse into the add's loop; only the result, which leaves, is written and read back.
    traffic = _traffic(lambda x: jnp.exp(x) * jnp.sin(x) + 1.0, F32)
    assert sum(traffic) == WRITE and traffic[-1] == WRITE


def test_a_value_a_matmul_reads_is_written_and_the_matmul_moves_nothing():
    w = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    assert _traffic(lambda x, w: jnp.tanh(x) @ w, F32, w) == [WRITE, 0.0]


def test_a_softmax_inside_its_call_writes_its_result_and_no_broadcast():
    # Reductions, their broadcasts back and the scalar fill of the max are fused or recomputed.
    assert sum(_traffic(lambda x: jax.nn.softmax(x, axis=-1), F32)) == WRITE
    ops = _ops(lambda x: jnp.where(x > 0, x, 0.0), F32)
    assert any(fusion.regenerated(op.eqn) for op in ops)
    assert sum(fusion.op_traffic(ops)) == WRITE


def test_a_scan_body_is_charged_once_per_iteration():
    def body(c, x):
        return c, jnp.exp(x) * 2.0

    xs = jax.ShapeDtypeStruct((5, 64, 32), jnp.float32)
    ops = _ops(lambda xs: jax.lax.scan(body, 0.0, xs)[1], xs)
    mul = next(k for k, op in enumerate(ops) if op.eqn.primitive.name == "mul")
    # The product is stacked into the result by an op of its own, which reads it in the loop.
    assert ops[mul].weight == 5
    assert fusion.written_outputs(ops)[mul] == (False,)
    assert sum(fusion.op_traffic(ops)) >= 5 * WRITE


def test_a_value_another_task_reads_is_written():
    exp, mul = _ops(lambda x: jnp.exp(x) * 2.0, F32)
    assert fusion.written_outputs([exp, mul]) == [(False,), (True,)]
    apart = [exp._replace(task="forward"), mul._replace(task="backward")]
    assert fusion.written_outputs(apart) == [(True,), (True,)]


def test_the_ilp_charges_the_written_bytes_as_each_layout_splits_them():
    nodes, _, _ = build_graph(jax.make_jaxpr(lambda x: jnp.exp(x) * 2.0)(F32), mesh(2, 1))
    exp, mul = nodes[1:]
    assert all(s.compute_cost == 0 for s in exp.strategies)  # fused into the mul
    costs = {s.output_specs[0]: s.compute_cost for s in mul.strategies}
    assert costs[(None, None)] == pytest.approx(WRITE / MEM_BW)
    assert costs[("data", None)] == pytest.approx(WRITE / 2 / MEM_BW)


def _gpt_tiny_profile():
    config = train.tiny_config("gpt")
    step, state = train.setup("gpt", "linen", config, optax.sgd(0.1))
    batch = train.make_batch("gpt", config, 16)
    num_state = len(jax.tree.leaves(state))
    ids = tuple(range(num_state, num_state + len(batch)))
    traced = planning.trace_at(step, (state, batch), ids, 16, trace.TraceOptions(num_layers=None))
    return profile.layer_profile(traced, ids)


def test_the_analytic_stage_costs_price_the_traffic_over_memory_bandwidth():
    prof = _gpt_tiny_profile()
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


def test_the_analytic_stage_costs_price_the_model_axis_of_a_two_host_stage_over_the_host_links():
    prof = _gpt_tiny_profile()
    spec = cluster.preset("h100", 2)
    faster = dataclasses.replace(spec, intra_host_bandwidth=2 * spec.intra_host_bandwidth)
    last = prof.num_layers - 1
    k = cluster.submesh_shapes(spec).index((2, 8))
    q = cluster.logical_shapes((2, 8)).index((2, 8))
    base, fast = (
        planner.stage_costs(prof, s, num_microbatches=1).latency[0, last, k, q] for s in (spec, faster)
    )
    # The model axis's 8 devices share a host: only its four activation all-reduces per layer
    # (each device's half of the batch) take the faster link; the data axis crosses hosts.
    acts = prof.boundary_bytes.sum() / 2
    saved = 4 * 2 * 7 / 8 * acts * (1 / spec.intra_host_bandwidth - 1 / faster.intra_host_bandwidth)
    assert saved > 0 and base - fast == pytest.approx(saved)


D = 64


D = 64


def _cast_step(extra_above_rows=None):
    import autopar

    def step(params, batch):
        def loss_fn(p):
            x = batch["x"]
            if extra_above_rows is not None and x.shape[0] > extra_above_rows:
                x = jnp.sin(x)  # a program that changes with the batch size
            h = x.astype(jnp.bfloat16) @ p["w"].astype(jnp.bfloat16)
            return jnp.mean(jnp.tanh(h.astype(jnp.float32)))

        loss, grads = autopar.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    return step, {"w": np.ones((D, D), np.float32)}


def _profile_at(step, params, rows):
    batch = {"x": np.ones((rows, D), np.float32)}
    traced = planning.trace_at(step, (params, batch), (1,), rows, trace.TraceOptions(num_layers=None))
    return planning.step_profile(step, (params, batch), (1,), rows, traced)


def test_weight_sized_traffic_is_fixed_and_priced_for_every_microbatch_and_device():
    step, params = _cast_step()
    prof = _profile_at(step, params, 16)
    # Written whatever the batch: the bf16 copy of w a matmul reads (2 bytes), the f32 gradient
    # that leaves (4 bytes; its transpose fuses into the cast) and the scalar loss.
    weight_sized = fusion.TRAFFIC_PER_WRITE * (2 * D * D + 4 * D * D + 4)
    assert prof.fixed_traffic.tolist() == [weight_sized]

    # The rest (the bf16 batch, what the backward keeps of tanh, the bf16 cotangent; which of
    # tanh's values depends on the jax version) doubles with the rows.
    def per_rows(p):
        return p.forward_traffic.sum() + p.backward_traffic.sum() - p.fixed_traffic.sum()

    doubled = _profile_at(step, params, 32)
    assert doubled.fixed_traffic.tolist() == [weight_sized]
    assert per_rows(prof) > 0 and per_rows(doubled) == 2 * per_rows(prof)

    spec = cluster.preset("cpu", devices_per_host=8)
    k = cluster.submesh_shapes(spec).index((1, 2))
    with_fixed = planner.stage_costs(prof, spec, num_microbatches=4, batch_scale=0.25, tensor_parallel=False)
    all_scaled = planner.stage_costs(
        dataclasses.replace(prof, fixed_traffic=np.zeros(0)),
        spec,
        num_microbatches=4,
        batch_scale=0.25,
        tensor_parallel=False,
    )
    # Each of the 2 data-parallel devices moves the whole weight-sized bytes for a quarter of the
    # batch, not a quarter of half of them.
    extra = weight_sized * (1 - 0.25 / 2) / spec.device.memory_bandwidth
    assert with_fixed.compute[0, 0, k, 0] - all_scaled.compute[0, 0, k, 0] == pytest.approx(extra)


def test_a_step_whose_program_changes_with_the_batch_size_has_no_fixed_traffic_read_off():
    step, params = _cast_step(extra_above_rows=16)
    prof = _profile_at(step, params, 16)  # the second trace, at 32 rows, has one more equation
    assert prof.fixed_traffic.tolist() == [0.0]
    assert prof.forward_traffic.sum() > 0


def _joined(activation, read_e_by_a_matmul):
    """A forward ``m = activation(x @ w) * 3`` and a backward that reads ``m`` through an add,
    and ``e = activation(x @ w)`` by a matmul or not at all; the ops split where the backward
    starts."""

    def fn(x, w):
        h = x @ w
        e = activation(h)
        m = e * 3.0
        r = (m + 1.0) @ w.T
        return (r, x.T @ e) if read_e_by_a_matmul else r

    ops = _ops(fn, F32, jax.ShapeDtypeStruct((32, 32), jnp.float32))
    first = next(i for i, op in enumerate(ops) if op.eqn.primitive.name == "add")
    return ops[:first], ops[first:]


@pytest.mark.parametrize(
    "activation,read_e_by_a_matmul,stored",
    [
        # m fuses into the backward's add, and e into m: only the matmul's output h is stored.
        (lambda h: jnp.maximum(h, 0.0), False, "h"),
        # A matmul reads e: e is stored, and m is recomputed from it.
        (lambda h: jnp.maximum(h, 0.0), True, "e"),
        # XLA does not compute an exp twice: e is stored, and m is recomputed from it.
        (jnp.exp, False, "e"),
    ],
)
def test_a_residual_xla_can_recompute_where_the_backward_reads_it_is_not_stored(
    activation, read_e_by_a_matmul, stored
):
    forward, backward = _joined(activation, read_e_by_a_matmul)
    h, e, m = (op.outs[0] for op in forward)
    names = {"h": h, "e": e, "m": m}
    expected = {"h": ("h",), "e": ("e",)}[stored]
    assert fusion.split_residuals(forward, backward)[0] == tuple(names[n] for n in expected)
    # What is not stored is computed again where it is read.
    recomputed = {"h": {"e", "m"}, "e": {"m"}}[stored]
    assert set(fusion.split_residuals(forward, backward)[1]) == {names[n] for n in recomputed}
