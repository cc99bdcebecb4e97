"""Per-equation sharding strategies and the strategy graph (autopar._src.strategies)."""

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from autopar._src import compat, cost, sharding_ilp
from autopar._src.collectives import all_reduce_cost, entry_axes, reduce_scatter_cost
from autopar._src.strategies import MeshSpec, eqn_strategies
from autopar._src.strategy_graph import build_graph, specs_of

PEAK = 1e12
MEM_BW = 1e12
BW = {"data": 1e11, "model": 2e11}
LAT = {"data": 2e-6, "model": 1e-6}


def mesh(data: int, model: int) -> MeshSpec:
    return MeshSpec(
        axis_names=("data", "model"),
        axis_sizes=(data, model),
        bandwidth=(BW["data"], BW["model"]),
        latency=(LAT["data"], LAT["model"]),
        peak_flops=PEAK,
        memory_bandwidth=MEM_BW,
    )


def link(axis: str) -> dict[str, float]:
    return {"bandwidth": BW[axis], "latency": LAT[axis]}


def eqns_of(fn, *args):
    return jax.make_jaxpr(fn)(*args).jaxpr.eqns


def by_name(strategies):
    names = [s.name for s in strategies]
    assert len(names) == len(set(names)), f"duplicate strategy names {names}"
    return dict(zip(names, strategies, strict=True))


def first_eqn(fn, *args, primitive):
    """The first ``primitive`` equation of ``fn``'s jaxpr, looking inside nested calls."""

    def walk(eqns):
        for e in eqns:
            yield e
            for body in compat.sub_jaxprs(e):
                yield from walk(body.eqns)

    return next(e for e in walk(eqns_of(fn, *args)) if e.primitive.name == primitive)


X = jnp.ones((64, 32))
W = jnp.ones((32, 16))
FLOPS = 2 * 64 * 32 * 16
OUT_BYTES = 64 * 16 * 4


def test_mesh_spec_validates_fields():
    with pytest.raises(ValueError, match="axis_sizes"):
        MeshSpec(
            axis_names=("a",),
            axis_sizes=(2, 2),
            bandwidth=(1.0,),
            latency=(0.0,),
            peak_flops=1,
            memory_bandwidth=1,
        )
    with pytest.raises(ValueError, match="bandwidth"):
        MeshSpec(
            axis_names=("a",),
            axis_sizes=(2,),
            bandwidth=(0.0,),
            latency=(0.0,),
            peak_flops=1,
            memory_bandwidth=1,
        )
    with pytest.raises(ValueError, match="axis_names"):
        MeshSpec(
            axis_names=("a", "a"),
            axis_sizes=(1, 2),
            bandwidth=(1, 1),
            latency=(0, 0),
            peak_flops=1,
            memory_bandwidth=1,
        )
    assert mesh(2, 4).num_devices == 8 and mesh(2, 4).size("model") == 4
    assert mesh(2, 4).size(("data", "model")) == 8
    assert mesh(2, 4).link(("data", "model")) == (BW["data"], LAT["data"])  # the slower link


def test_candidate_specs_split_dim0_over_every_device_of_a_2d_mesh():
    from autopar._src.layout_costs import candidate_specs

    assert ((("data", "model"), None)) in candidate_specs((64, 32), mesh(2, 4))
    assert not any(isinstance(a, tuple) for s in candidate_specs((12, 32), mesh(2, 4)) for a in s)  # 8 ∤ 12
    assert not any(isinstance(a, tuple) for s in candidate_specs((64, 32), mesh(1, 8)) for a in s)


def test_dot_general_on_1x8_mesh():
    (eqn,) = eqns_of(jnp.matmul, X, W)
    s = by_name(eqn_strategies(eqn, mesh(1, 8)))
    assert list(s) == [
        "replicated",
        "batch[model]",
        "column[model]",
        "row_allreduce[model]",
        "row_reducescatter[model]",
    ]

    rep = s["replicated"]
    assert rep.compute_cost == pytest.approx(FLOPS / PEAK) and rep.communication_cost == 0
    assert rep.memory_bytes == 32 * 16 * 4 + OUT_BYTES

    col = s["column[model]"]  # Megatron column split: no communication
    assert col.input_specs == ((None, None), (None, "model")) and col.output_specs == ((None, "model"),)
    assert col.communication_cost == 0
    assert col.compute_cost == pytest.approx(FLOPS / 8 / PEAK)
    assert col.memory_bytes == pytest.approx(32 * 16 * 4 / 8 + OUT_BYTES / 8)

    row = s["row_allreduce[model]"]  # partial sums of the full output, all-reduced over "model"
    assert row.input_specs == ((None, "model"), ("model", None)) and row.output_specs == ((None, None),)
    assert row.communication_cost == pytest.approx(all_reduce_cost(OUT_BYTES, 8, **link("model")))
    assert row.communication_cost == pytest.approx(2 * (7 / 8 * OUT_BYTES / BW["model"] + 7 * LAT["model"]))
    assert row.latency_cost == pytest.approx(2 * 7 * LAT["model"])  # the ring's steps, whatever the bytes
    assert row.compute_cost == pytest.approx(FLOPS / 8 / PEAK)
    assert row.memory_bytes == pytest.approx(32 * 16 * 4 / 8 + OUT_BYTES)

    rs = s["row_reducescatter[model]"]  # the same partial sums, reduce-scattered onto the batch dim
    assert rs.output_specs == (("model", None),)
    assert rs.communication_cost == pytest.approx(reduce_scatter_cost(OUT_BYTES, 8, **link("model")))
    assert rs.latency_cost == pytest.approx(7 * LAT["model"])
    assert rep.latency_cost == col.latency_cost == 0

    dp = s["batch[model]"]
    assert dp.input_specs == (("model", None), (None, None)) and dp.communication_cost == 0


def test_dot_general_on_2x4_mesh_has_2d_combinations():
    (eqn,) = eqns_of(jnp.matmul, X, W)
    strategies = eqn_strategies(eqn, mesh(2, 4))
    assert len(strategies) <= 16
    s = by_name(strategies)
    assert {"replicated", "batch[data]", "batch[model]", "column[model]", "row_allreduce[model]"} <= set(s)

    dp = s["batch[data]"]
    assert dp.input_specs == (("data", None), (None, None)) and dp.communication_cost == 0
    assert dp.compute_cost == pytest.approx(FLOPS / 2 / PEAK)
    assert dp.memory_bytes == pytest.approx(32 * 16 * 4 + OUT_BYTES / 2)

    both = s["batch[data]+column[model]"]
    assert both.input_specs == (("data", None), (None, "model")) and both.output_specs == (("data", "model"),)
    assert both.communication_cost == 0 and both.compute_cost == pytest.approx(FLOPS / 8 / PEAK)

    row = s["batch[data]+row_allreduce[model]"]  # each data shard all-reduces its half over "model"
    assert row.input_specs == (("data", "model"), ("model", None)) and row.output_specs == (("data", None),)
    assert row.communication_cost == pytest.approx(all_reduce_cost(OUT_BYTES / 2, 4, **link("model")))
    assert row.compute_cost == pytest.approx(FLOPS / 8 / PEAK)
    assert row.memory_bytes == pytest.approx(32 * 16 * 4 / 4 + OUT_BYTES / 2)

    every = s["batch[data.model]"]  # the batch over all 8 devices
    assert every.input_specs == ((("data", "model"), None), (None, None))
    assert every.output_specs == ((("data", "model"), None),) and every.communication_cost == 0
    assert every.compute_cost == pytest.approx(FLOPS / 8 / PEAK)
    assert every.memory_bytes == pytest.approx(32 * 16 * 4 + OUT_BYTES / 8)

    # partial sums over all 8 devices: a ring over both axes, as slow as the slower one
    row8 = s["row_allreduce[data.model]"]
    assert row8.input_specs == ((None, ("data", "model")), (("data", "model"), None))
    slow = {"bandwidth": BW["data"], "latency": LAT["data"]}
    assert row8.communication_cost == pytest.approx(all_reduce_cost(OUT_BYTES, 8, **slow))

    # a weight gradient under data x tensor parallelism: contracted batch over data, columns over model
    grad = s["row_allreduce[data]+column[model]"]
    assert grad.input_specs == ((None, "data"), ("data", "model")) and grad.output_specs == ((None, "model"),)
    assert grad.communication_cost == pytest.approx(all_reduce_cost(OUT_BYTES / 4, 2, **link("data")))


def test_batched_dot_general_splits_batch_and_heads():
    q, k = jnp.ones((4, 8, 16, 32)), jnp.ones((4, 8, 16, 32))
    eqn = first_eqn(lambda a, b: jnp.einsum("bhqd,bhkd->bhqk", a, b), q, k, primitive="dot_general")
    s = by_name(eqn_strategies(eqn, mesh(2, 4)))
    assert s["batch[data]+heads[model]"].input_specs == (("data", "model", None, None),) * 2
    assert s["batch[data]+heads[model]"].communication_cost == 0


def test_conv_batch_and_channel_splits():
    x, w = jnp.ones((8, 3, 16, 16)), jnp.ones((16, 3, 3, 3))
    (eqn,) = eqns_of(lambda a, b: lax.conv_general_dilated(a, b, (1, 1), "SAME"), x, w)
    s = by_name(eqn_strategies(eqn, mesh(2, 4)))
    assert set(s) == {
        "replicated",
        "batch[data]",
        "batch[model]",
        "channel[model]",
        "batch[data]+channel[model]",
        "batch[data.model]",
        "channel[data.model]",
    }
    assert s["channel[model]"].output_specs == ((None, "model", None, None),)
    assert s["batch[data.model]"].output_specs == ((("data", "model"), None, None, None),)
    assert s["batch[data]+channel[model]"].compute_cost == pytest.approx(s["replicated"].compute_cost / 8)


def test_conv_weight_gradient_of_a_batch_split_is_an_all_reduce():
    x, w = jnp.ones((8, 16, 16, 32)), jnp.ones((3, 3, 32, 64))

    def loss(x, w):
        dn = ("NHWC", "HWIO", "NHWC")
        return jnp.sum(lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn) ** 2)

    closed = jax.make_jaxpr(jax.grad(loss, argnums=1))(x, w)
    forward, wgrad = [e for e in closed.jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    s = by_name(eqn_strategies(wgrad, mesh(2, 4)))
    batch_split = ("data", None, None, None)  # x and dy split by their batch dim
    assert s["row_allreduce[data]"].input_specs == (batch_split, batch_split)
    dp = s["row_allreduce[data]+channel[model]"]  # batch over data, output channels over model
    assert dp.input_specs == (batch_split, ("data", None, None, "model"))
    assert dp.output_specs == ((None, None, None, "model"),)
    wgrad_bytes = 3 * 3 * 32 * 64 * 4
    assert dp.communication_cost == pytest.approx(all_reduce_cost(wgrad_bytes / 4, 2, **link("data")))
    every = s["row_allreduce[data.model]"]  # 8-way data parallel
    assert every.input_specs == ((("data", "model"), None, None, None),) * 2
    slow = {"bandwidth": BW["data"], "latency": LAT["data"]}
    assert every.communication_cost == pytest.approx(all_reduce_cost(wgrad_bytes, 8, **slow))
    # the forward convolution: Megatron's row split over input channels
    row = by_name(eqn_strategies(forward, mesh(2, 4)))["row_allreduce[model]"]
    assert row.input_specs == ((None, None, None, "model"), (None, None, "model", None))


def test_ragged_dot_and_its_gradients_split_columns_and_contractions_but_not_ragged_rows():
    m, k, n, g = 64, 32, 16, 4
    x, w, sizes = jnp.ones((m, k)), jnp.ones((g, k, n)), jnp.full((g,), m // g, jnp.int32)

    def loss(x, w):
        return jnp.sum(lax.ragged_dot(x, w, sizes) ** 2)

    closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
    eqns = {e.outvars[0].aval.shape: e for e in closed.jaxpr.eqns if e.primitive.name == "ragged_dot_general"}
    assert set(eqns) == {(m, n), (m, k), (g, k, n)}  # forward, rows' gradient, weights' gradient
    for eqn in eqns.values():  # every row meets one group's weights: no factor of g
        assert cost.eqn_flops(eqn) == 2 * m * k * n
    forward = by_name(eqn_strategies(eqns[m, n], mesh(2, 4)))
    assert forward["column[model]"].input_specs == ((None, None), (None, None, "model"), (None,))
    assert forward["column[model]"].output_specs == ((None, "model"),)
    assert forward["column[model]"].communication_cost == 0
    row = forward["row_allreduce[model]"]
    assert row.input_specs == ((None, "model"), (None, "model", None), (None,))
    assert row.communication_cost == pytest.approx(all_reduce_cost(m * n * 4, 4, **link("model")))
    assert forward["column[data.model]"].compute_cost == pytest.approx(forward["replicated"].compute_cost / 8)
    # The ragged rows are never split outside a contraction.
    for eqn in eqns.values():
        for strategy in eqn_strategies(eqn, mesh(2, 4)):
            assert strategy.input_specs[0][0] is None or (g, k, n) == eqn.outvars[0].aval.shape
    # The weights' gradient leads with the groups: the rows' features split its second dim.
    wgrad = by_name(eqn_strategies(eqns[g, k, n], mesh(2, 4)))
    assert wgrad["lhs_column[model]"].output_specs == ((None, "model", None),)
    assert wgrad["column[model]"].output_specs == ((None, None, "model"),)
    assert wgrad["row_allreduce[data]"].input_specs == (("data", None), ("data", None), (None,))


def test_fft_splits_the_dims_it_does_not_transform_and_is_priced_as_5_n_log_n():
    x = jnp.ones((8, 16, 32), jnp.complex64)
    eqn = first_eqn(lambda a: lax.fft(a, lax.FftType.FFT, (16, 32)), x, primitive="fft")
    strategies = by_name(eqn_strategies(eqn, mesh(2, 4)))
    assert strategies["split[d0@data]"].output_specs == (("data", None, None),)
    assert strategies["split[d0@data]"].communication_cost == 0
    # The transformed dims are never split.
    assert all(spec[1:] == (None, None) for s in strategies.values() for spec in s.output_specs)
    assert cost.eqn_flops(eqn) == pytest.approx(5 * 8 * 512 * np.log2(512))
    rfft = first_eqn(lambda a: lax.fft(a, lax.FftType.RFFT, (32,)), jnp.ones((8, 16, 32)), primitive="fft")
    assert {s.output_specs[0] for s in eqn_strategies(rfft, mesh(2, 4))} >= {
        ("data", None, None),
        (None, "model", None),
    }


def test_elementwise_follows_operand_and_keeps_broadcast_dims_replicated():
    (eqn,) = eqns_of(jnp.tanh, X)
    strategies = eqn_strategies(eqn, mesh(2, 4))
    assert {s.output_specs[0] for s in strategies} >= {(None, None), ("data", None), (None, "model")}
    assert all(s.input_specs == s.output_specs for s in strategies)
    # Memory-bound: no compute of its own; the strategy graph charges what fusion writes.
    assert all(s.compute_cost == 0 for s in strategies)

    eqn = first_eqn(lambda a, b: a - b, X, jnp.ones((64, 1)), primitive="sub")
    for s in eqn_strategies(eqn, mesh(2, 4)):
        assert s.input_specs[0] == s.output_specs[0] and s.input_specs[1] == (s.output_specs[0][0], None)


def test_reduction_over_sharded_dim_is_priced():
    (eqn,) = eqns_of(lambda a: jnp.sum(a, axis=1), X)
    s = by_name(eqn_strategies(eqn, mesh(1, 8)))
    kept = s["split[d0@model]"]
    assert kept.output_specs == (("model",),) and kept.communication_cost == 0
    reduced = s["split[d1@model]+allreduce"]
    assert reduced.output_specs == ((None,),)
    assert reduced.communication_cost == pytest.approx(all_reduce_cost(64 * 4, 8, **link("model")))
    assert reduced.latency_cost == pytest.approx(2 * 7 * LAT["model"]) and kept.latency_cost == 0


def test_reshape_transpose_and_broadcast_map_dims():
    (eqn,) = eqns_of(lambda a: a.reshape(64, 4, 8), X)
    pairs = {(s.input_specs[0], s.output_specs[0]) for s in eqn_strategies(eqn, mesh(2, 4))}
    assert (("data", None), ("data", None, None)) in pairs
    assert ((None, "model"), (None, "model", None)) in pairs  # the major dim of a split group
    (eqn,) = eqns_of(lambda a: a.reshape(64 * 32), X)
    pairs = {(s.input_specs[0], s.output_specs[0]) for s in eqn_strategies(eqn, mesh(1, 8))}
    assert (("model", None), ("model",)) in pairs and all(i[1] is None for i, _ in pairs)

    (eqn,) = eqns_of(lambda a: a.T, X)
    assert all(s.output_specs[0] == s.input_specs[0][::-1] for s in eqn_strategies(eqn, mesh(2, 4)))

    (eqn,) = eqns_of(lambda a: lax.broadcast_in_dim(a, (64, 32), (0,)), jnp.ones(64))
    pairs = {(s.input_specs[0], s.output_specs[0]) for s in eqn_strategies(eqn, mesh(1, 8))}
    assert (("model",), ("model", None)) in pairs and ((None,), (None, "model")) in pairs


def test_pooling_splits_the_dims_its_windows_leave_alone():
    # A 3x3 stride-2 max pool over NHWC: the batch and the channels may be split, the pooled
    # height and width not; its gradient (select_and_scatter_add) splits its operands alike.
    def pool(x):
        return lax.reduce_window(
            x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (0, 1), (0, 1), (0, 0))
        )

    x = jnp.ones((16, 8, 8, 4))
    (fwd,) = [e for e in eqns_of(pool, x) if e.primitive.name == "reduce_window_max"]
    bwd = [
        e
        for e in eqns_of(lambda x: jax.grad(lambda x: pool(x).sum())(x), x)
        if "select_and" in e.primitive.name
    ]
    assert bwd
    for eqn in (fwd, *bwd):
        strategies = by_name(eqn_strategies(eqn, mesh(8, 4)))
        assert {"replicated", "split[d0@data]", "split[d3@model]"} <= set(strategies), sorted(strategies)
        for s in strategies.values():
            split = {d for spec in (*s.input_specs, *s.output_specs) for d, a in enumerate(spec) if a}
            assert not split & {1, 2}, s
        batch = strategies["split[d0@data]"]
        assert all(spec[:1] == ("data",) for spec in (*batch.input_specs, *batch.output_specs) if spec)
        assert batch.memory_bytes < strategies["replicated"].memory_bytes


def test_embedding_gather_vocab_split_all_reduces():
    table, ids = jnp.ones((1024, 64)), jnp.ones((16, 8), jnp.int32)
    eqn = first_eqn(lambda t, i: t[i], table, ids, primitive="gather")
    s = by_name(eqn_strategies(eqn, mesh(2, 4)))
    vocab = s["vocab[model]"]
    assert vocab.input_specs[0] == ("model", None) and vocab.output_specs == ((None, None, None),)
    assert vocab.communication_cost == pytest.approx(all_reduce_cost(16 * 8 * 64 * 4, 4, **link("model")))
    assert vocab.memory_bytes == pytest.approx(1024 * 64 * 4 / 4 + 16 * 8 * 64 * 4)
    ind = s["indices[data]"]
    assert ind.input_specs == ((None, None), ("data", None, None)) and ind.output_specs == (
        ("data", None, None),
    )
    assert ind.communication_cost == 0
    both = s["indices[data]+vocab[model]"]
    assert both.communication_cost == pytest.approx(all_reduce_cost(16 * 8 * 64 * 4 / 2, 4, **link("model")))

    grad = jax.grad(lambda t, i: jnp.sum(t[i]))
    eqn = first_eqn(grad, table, ids, primitive="scatter-add")
    s = by_name(eqn_strategies(eqn, mesh(1, 8)))
    assert s["rows[model]"].output_specs == (("model", None),) and s["rows[model]"].communication_cost == 0
    assert s["batch_allreduce[model]"].communication_cost == pytest.approx(
        all_reduce_cost(1024 * 64 * 4, 8, **link("model"))
    )


def test_dynamic_slice_lookup_and_fallback():
    table = jnp.ones((1024, 64))
    eqn = first_eqn(lambda t: lax.dynamic_slice(t, (3, 0), (1, 64)), table, primitive="dynamic_slice")
    s = by_name(eqn_strategies(eqn, mesh(1, 8)))
    assert s["split[d1@model]"].input_specs[0] == (None, "model")
    assert s["vocab[model]"].input_specs[0] == ("model", None) and s["vocab[model]"].communication_cost > 0
    eqn = first_eqn(lambda a: lax.approx_max_k(a, 4), X, primitive="approx_top_k")  # no rule: replicated
    (only,) = eqn_strategies(eqn, mesh(2, 4))
    assert only.name == "replicated" and only.input_specs == ((None, None),)


@pytest.mark.parametrize(
    "fn, primitive, along",
    [
        (lambda a: jnp.concatenate([a, 2 * a], axis=1), "concatenate", 1),
        (lambda a: jnp.stack([a, 2 * a], axis=1), "stack", 1),  # the results' new dim 1
        (lambda a: jnp.unstack(a.reshape(64, 2, 16), axis=1), "unstack", 1),  # the operand's dim 1
        (lambda a: jnp.split(a, [8], axis=1), "split", 1),
        (lambda a: lax.sort(a, dimension=1), "sort", 1),
        (lambda a: lax.top_k(a, 4), "top_k", 1),
        (lambda a: jnp.concatenate([a, 2 * a], axis=0), "concatenate", 0),
    ],
)
def test_equations_along_one_dim_keep_splits_of_the_others(fn, primitive, along):
    """A join, part or order along one dim leaves every other dim's split in place, on every
    operand and result alike; the dim it works along stays whole. Before these rules such
    equations ran replicated, and a data-parallel mixture of experts all-gathered its top-2
    routing (jnp.stack) every layer."""
    eqn = first_eqn(fn, X, primitive=primitive)
    s = by_name(eqn_strategies(eqn, mesh(2, 4)))
    assert "replicated" in s and len(s) > 1
    rank = max(len(v.aval.shape) for v in (*eqn.invars, *eqn.outvars))
    batch = 0 if along else 1  # the one other dim of X
    split = next(v for k, v in s.items() if k != "replicated" and "data" in str(v.output_specs))
    for spec in (*split.input_specs, *split.output_specs):
        full = len(spec) == rank
        if full:
            assert spec[along] is None
        assert "data" in entry_axes(spec[batch if full or batch < along else batch - 1])
    assert all(v.communication_cost == 0 for v in s.values())


def mlp_loss(w1, w2, x, y):
    h = jnp.tanh(x @ w1)
    return jnp.mean((h @ w2 - y) ** 2)


def mlp_jaxpr(batch, d, hidden):
    args = (jnp.ones((d, hidden)), jnp.ones((hidden, d)), jnp.ones((batch, d)), jnp.ones((batch, d)))
    return jax.make_jaxpr(mlp_loss)(*args)


def test_build_graph_of_mlp_is_consistent():
    closed = mlp_jaxpr(64, 32, 32)
    for m in (mesh(2, 4), mesh(1, 8)):
        nodes, edges, var_specs = build_graph(closed, m)
        eqns = closed.jaxpr.eqns
        assert len(nodes) == len(closed.jaxpr.invars) + len(eqns)
        assert [n.name for n in nodes[4:]] == [f"eqn{j}:{e.primitive.name}" for j, e in enumerate(eqns)]
        assert all(1 <= len(n.strategies) <= 16 for n in nodes[4:])
        for e in edges:
            assert e.src < e.dst and e.cost.shape == (
                len(nodes[e.src].strategies),
                len(nodes[e.dst].strategies),
            )
            assert np.isfinite(e.cost).all() and (e.cost >= 0).all()
        consumers = sum(1 for e in eqns for v in e.invars if not isinstance(v, jcore.Literal))
        assert len(edges) == consumers  # every operand of this MLP comes from a distinct producer
        assert set(var_specs) == {*closed.jaxpr.invars, *(v for e in eqns for v in e.outvars)}
        x = closed.jaxpr.invars[2]
        assert ("data" if m.size("data") > 1 else "model", None) in var_specs[x]
        # same input twice gives the same graph (deterministic order and costs)
        again, again_edges, _ = build_graph(closed, m)
        assert again == nodes and len(again_edges) == len(edges)
        assert all(np.array_equal(a.cost, b.cost) for a, b in zip(edges, again_edges, strict=True))


def dot_names(closed, nodes, choices):
    eqns = closed.jaxpr.eqns
    offset = len(nodes) - len(eqns)
    return [
        nodes[offset + j].strategies[choices[offset + j]].name
        for j, e in enumerate(eqns)
        if e.primitive.name == "dot_general"
    ]


def test_solver_picks_data_parallel_for_large_batch():
    closed = mlp_jaxpr(4096, 256, 256)
    nodes, edges, _ = build_graph(closed, mesh(8, 1))
    assert dot_names(closed, nodes, sharding_ilp.solve(nodes, edges).choices) == ["batch[data]"] * 2
    # About 4.5 MB per device when x and y are split too; replicating either adds 3.5 MB.
    solution = sharding_ilp.solve(nodes, edges, memory_budget=6e6)
    assert dot_names(closed, nodes, solution.choices) == ["batch[data]"] * 2
    specs = specs_of(solution.choices, nodes, closed)
    w1, _, x, y = closed.jaxpr.invars
    assert specs[x] == specs[y] == ("data", None) and specs[w1] == (None, None)
    assert specs[closed.jaxpr.eqns[1].outvars[0]] == ("data", None)


def test_solver_picks_megatron_for_large_weights():
    # A batch of 2 cannot be split over 8 devices.
    closed = mlp_jaxpr(2, 1024, 4096)
    nodes, edges, _ = build_graph(closed, mesh(1, 8))
    first, second = dot_names(closed, nodes, sharding_ilp.solve(nodes, edges).choices)
    assert first == "column[model]" and second.startswith("row_")
    # A batch of 8 could be, but 16 MB weights do not fit replicated in a 12 MB budget.
    closed = mlp_jaxpr(8, 1024, 4096)
    nodes, edges, _ = build_graph(closed, mesh(1, 8))
    solution = sharding_ilp.solve(nodes, edges, memory_budget=12e6)
    first, second = dot_names(closed, nodes, solution.choices)
    assert first == "column[model]" and second.startswith("row_")
    specs = specs_of(solution.choices, nodes, closed)
    w1, w2 = closed.jaxpr.invars[:2]
    assert specs[w1] == (None, "model") and specs[w2] == ("model", None)
    assert specs[closed.jaxpr.eqns[1].outvars[0]] == (None, "model")  # tanh stays split in between


def test_specs_of_rejects_mismatched_nodes():
    closed = mlp_jaxpr(64, 32, 32)
    nodes, _, _ = build_graph(closed, mesh(2, 4))
    with pytest.raises(ValueError, match="choices"):
        specs_of((0,) * (len(nodes) - 1), nodes[:-1], closed)
    specs = specs_of((0,) * len(nodes), nodes, closed)
    assert all(all(a is None for a in spec) for spec in specs.values())


def test_softmax_and_layer_norm_price_reductions_over_a_split_dim():
    def layer_norm(x):
        mu = jnp.mean(x, axis=-1, keepdims=True)
        return (x - mu) * lax.rsqrt(jnp.mean((x - mu) ** 2, axis=-1, keepdims=True) + 1e-5)

    for fn in (jax.nn.softmax, layer_norm):
        closed = jax.make_jaxpr(fn)(X)
        nodes, _, _ = build_graph(closed, mesh(1, 8))
        reductions = [n for n in nodes if n.name.split(":")[-1] in ("reduce_max", "reduce_sum")]
        assert reductions
        for node in reductions:
            split = by_name(node.strategies)["split[d1@model]+allreduce"]
            assert split.communication_cost == pytest.approx(all_reduce_cost(64 * 4, 8, **link("model")))


def test_input_nodes_offer_every_even_split():
    closed = jax.make_jaxpr(jnp.tanh)(jnp.ones((64, 6)))
    nodes, edges, _ = build_graph(closed, mesh(2, 4))
    inputs = by_name(nodes[0].strategies)
    assert set(inputs) == {
        "replicated",
        "split[d0@data]",
        "split[d1@data]",
        "split[d0@model]",
        "split[d0@data.model]",
    }
    assert inputs["split[d0@model]"].memory_bytes == 64 * 6 * 4 / 4
    assert all(s.compute_cost == s.communication_cost == 0 for s in inputs.values())
    (edge,) = edges
    assert edge.cost.shape == (5, len(nodes[1].strategies))


def transformer_loss(params, ids, labels):
    x = params["embed"][ids]
    mu = jnp.mean(x, -1, keepdims=True)
    x = (x - mu) * lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5)
    q, k, v = (jnp.einsum("bsd,dhe->bshe", x, params[n]) for n in "qkv")
    att = jax.nn.softmax(jnp.einsum("bqhe,bkhe->bhqk", q, k) / 4.0, axis=-1)
    x = x + jnp.einsum("bhqk,bkhe,hed->bqd", att, v, params["o"])
    x = x + jax.nn.gelu(x @ params["w1"]) @ params["w2"]
    logp = jax.nn.log_softmax(x @ params["embed"].T)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def test_every_strategy_of_a_transformer_step_is_well_formed():
    d, h, e, vocab = 32, 4, 8, 64
    shapes = {"embed": (vocab, d), "q": (d, h, e), "k": (d, h, e), "v": (d, h, e), "o": (h, e, d)}
    params = {n: jnp.ones(s) for n, s in {**shapes, "w1": (d, 4 * d), "w2": (4 * d, d)}.items()}
    ids = jnp.zeros((8, 16), jnp.int32)
    closed = jax.make_jaxpr(jax.value_and_grad(transformer_loss))(params, ids, ids)
    m = mesh(2, 4)
    nodes, edges, var_specs = build_graph(closed, m)
    atoms = [[v] for v in [*closed.jaxpr.constvars, *closed.jaxpr.invars]]
    atoms += [list(e.outvars) for e in closed.jaxpr.eqns]
    for node, outvars in zip(nodes, atoms, strict=True):
        # Replicated, each of the two axes on each dim, data on dim 0 with model on another
        # (dim-moving ops: the layouts of their input and of their output).
        eqn_vars = (
            outvars
            if node.name.startswith("input")
            else [*outvars, *closed.jaxpr.eqns[int(node.name[3:].split(":")[0])].invars]
        )
        rank = max(len(getattr(v.aval, "shape", ())) for v in eqn_vars)
        assert len(node.strategies) <= 2 * (1 + 3 * rank), node.name
        for s in node.strategies:
            eqn_specs = [(v, spec) for v, spec in zip(outvars, s.output_specs, strict=True)]
            if not node.name.startswith("input"):
                eqn = closed.jaxpr.eqns[int(node.name[3:].split(":")[0])]
                eqn_specs += list(zip(eqn.invars, s.input_specs, strict=True))
            for v, spec in eqn_specs:
                shape = v.aval.shape
                assert len(spec) == len(shape), (node.name, s.name)
                named = [a for a in spec if a is not None]
                assert len(named) == len(set(named)), (node.name, s.name)
                assert all(a is None or n % m.size(a) == 0 for n, a in zip(shape, spec, strict=True))
    names = {n.name.split(":")[-1]: n for n in nodes}
    assert {"gather", "scatter-add", "dot_general", "reduce_max"} <= set(names)
    assert any(s.name == "vocab[model]" for s in names["gather"].strategies)
    for e in edges:
        assert np.isfinite(e.cost).all() and e.cost.shape == (
            len(nodes[e.src].strategies),
            len(nodes[e.dst].strategies),
        )
    solution = sharding_ilp.solve(nodes, edges)
    specs = specs_of(solution.choices, nodes, closed)
    assert set(specs) == set(var_specs)


def test_a_batched_matmul_can_split_its_lhs_rows():
    """A mixture of experts' per-expert matmul ``egcm,emh->egch`` batches over the experts; its
    data-parallel layout splits the tokens' groups (lhs's leading free dim) and keeps the
    experts' weights whole, as XLA would propagate a batch split, with no collective."""
    tokens, weights = jnp.ones((4, 8, 16, 32)), jnp.ones((4, 32, 64))
    eqn = first_eqn(lambda t, w: jnp.einsum("egcm,emh->egch", t, w), tokens, weights, primitive="dot_general")
    s = by_name(eqn_strategies(eqn, mesh(2, 4)))
    rows = s["rows[data]"]
    assert rows.input_specs == ((None, "data", None, None), (None, None, None))
    assert rows.output_specs == ((None, "data", None, None),) and rows.communication_cost == 0
    assert s["batch[data]"].input_specs[1] == ("data", None, None)  # expert parallel: weights split
    assert "rows[data]+column[model]" in s
