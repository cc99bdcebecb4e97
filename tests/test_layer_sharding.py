"""Per-layer ILP prices: gradient ties, once-per-step gradient reductions, pinned and bounded layouts."""

import jax
import numpy as np
import pytest
from equality import OPTIMIZERS, TOLERANCES, as_numpy
from jax.sharding import Mesh, PartitionSpec

import autopar
from autopar._src import cluster as cluster_mod
from autopar._src import layer_sharding, partial_chains, planning, trace
from autopar._src.intra_op import logical_mesh
from autopar._src.layout_costs import shape_of
from models import train


def _traced(kind, batch_size, opt="sgd", **overrides):
    config = train.tiny_config(kind, **overrides)
    step, state = train.setup(kind, "linen", config, OPTIMIZERS[opt]())
    batch = train.make_batch(kind, config, batch_size)
    num_state = len(jax.tree.leaves(state))
    batch_ids = tuple(range(num_state, num_state + len(jax.tree.leaves(batch))))
    traced = planning.trace_at(
        step, (state, batch), batch_ids, batch_size, trace.TraceOptions(num_layers=None)
    )
    return traced, state, batch


def _megatron(state, batch):
    specs = autopar.rule_specs(autopar.megatron_rules(), (state, batch))
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return {i: tuple(s) for i, s in enumerate(leaves)}


def test_gradient_tail_ends_at_the_weight_gradient_reductions():
    traced, state, _ = _traced("mlp", 48, features=(32, 32))
    problems = layer_sharding.LayerProblems(traced)
    params = list(problems.carried.values())
    assert len(params) == len(jax.tree.leaves(state.params))
    param_sizes = {int(np.prod(shape_of(p))) for p in params}
    tails = 0
    for ops in problems.ops:
        tail = layer_sharding.gradient_tail(ops, list(problems.carried))
        made_here = {n for op in ops for n in op.outs if n is not None}
        grads_here = [g for g in problems.carried if g in made_here]
        # Every gradient made in the layer is made by a tail op, and every tail op makes a
        # parameter-sized value: nothing with the batch dim is spread over the step.
        assert {j for j, op in enumerate(ops) for n in op.outs if n in grads_here} <= tail
        for j in tail:
            assert {int(np.prod(shape_of(v))) for v in ops[j].eqn.outvars} <= param_sizes
            assert all(48 not in shape_of(v) for v in ops[j].eqn.outvars)
        # The walk stops at the reductions: each weight gradient comes from a dot over the batch.
        dots = [ops[j] for j in tail if ops[j].eqn.primitive.name == "dot_general"]
        assert all(any(48 in shape_of(v) for v in op.eqn.invars) for op in dots)
        tails += len(dots)
    kernels = [p for p in params if len(shape_of(p)) == 2]
    assert tails == len(kernels)


def test_every_mlp_gradient_is_made_as_partial_sums():
    traced, _, _ = _traced("mlp", 48, features=(32, 32))
    problems = layer_sharding.LayerProblems(traced)
    roots = {}
    for ops in problems.ops:
        made = {n: op.eqn.primitive.name for op in ops for n in op.outs if n is not None}
        for root, links, grad, _ in partial_chains.graph_chains(ops, problems.carried):
            assert (links[-1] if links else root) == grad
            roots[grad] = made[root]
    # Kernels from the batch-contracting matmul, biases from the sum over the batch.
    assert set(roots) == set(problems.carried)
    kernels = {g for g, p in problems.carried.items() if len(shape_of(p)) == 2}
    assert {roots[g] for g in kernels} == {"dot_general"}
    assert {roots[g] for g in set(roots) - kernels} == {"reduce_sum"}


def test_gradient_reductions_are_spread_over_microbatches():
    # Large weights, a small batch: the gradient all-reduce dominates a data-parallel layer.
    traced, _, _ = _traced("mlp", 4096, features=(512, 512), in_features=512)
    spec = cluster_mod.preset("cpu")
    one, four, four_megatron = (
        layer_sharding.layer_latency(traced, spec, [(1, 8)], [[(8, 1)]], microbatches=b, gradients=g)[:, 0, 0]
        for b, g in ((1, "autopar"), (4, "autopar"), (4, "megatron"))
    )
    # (A layer may avoid the reduction altogether: e.g. its weight split by columns.)
    assert (four <= one).all() and four.sum() < one.sum()
    # Megatron's accounting also spreads reduce-scatters and the resharding into the
    # parameters' layouts; here the driver defers every reduction the layouts need.
    assert (four_megatron <= four * (1 + 1e-9)).all()
    np.testing.assert_allclose(four_megatron.sum(), four.sum(), rtol=0.05)
    # No more than the reduction saved: 3/4 of one all-reduce of every gradient.
    mesh = logical_mesh(spec, (8, 1), layer_sharding.AXES)
    grad_bytes = 4 * sum(int(np.prod(shape_of(g))) for g in layer_sharding.LayerProblems(traced).carried)
    ring = 2 * 7 / 8 * grad_bytes / mesh.bandwidth[0] + 2 * 7 * mesh.latency[0]
    assert (one - four).sum() <= 0.75 * ring * (1 + 1e-6)


def test_megatron_layouts_pin_the_region_inputs_on_dims_they_divide():
    traced, state, batch = _traced("gpt", 8, "adamw")
    spec = cluster_mod.preset("cpu")
    layouts = _megatron(state, batch)
    problems = layer_sharding.LayerProblems(traced)
    mesh = logical_mesh(spec, (2, 4), layer_sharding.AXES)
    pinned = problems.fixed(layouts, mesh)
    kernels = [r for r, i in problems.region_arg.items() if "model" in (layouts.get(i) or ())]
    assert kernels and all(r in pinned for r in kernels)
    # On a 3-way model axis a pin keeps the axis only on dims 3 divides.
    three = logical_mesh(spec, (1, 3), layer_sharding.AXES)
    dropped = 0
    for r, got in problems.fixed(layouts, three).items():
        for d, (want, kept) in enumerate(zip(layouts[problems.region_arg[r]], got, strict=False)):
            size = {"data": 1, "model": 3}.get(want, 0)
            assert kept == (want if size and shape_of(r)[d] % size == 0 else None)
            dropped += want == "model" and kept is None
    assert dropped > 0


def test_pinned_layouts_and_the_memory_bound_of_the_free_layouts():
    # Row-split kernels must be gathered (or make every matmul all-reduce a [4096, 512]
    # activation); with the same bytes per device the free layouts avoid some of that.
    traced, _, _ = _traced("mlp", 4096, features=(512, 512), in_features=512)
    spec = cluster_mod.preset("cpu")
    problems = layer_sharding.LayerProblems(traced)
    kernels = {i: ("model", None) for r, i in problems.region_arg.items()
               if r in problems.carried.values() and len(shape_of(r)) == 2}  # fmt: skip
    assert len(kernels) == 3
    where = (spec, [(1, 8)], [[(1, 8)]])
    layer_sharding._CACHE.clear()
    fixed = layer_sharding.layer_latency(traced, *where, fixed=kernels)[:, 0, 0]
    lean = layer_sharding.layer_latency(traced, *where, memory_like=kernels)[:, 0, 0]
    assert (lean <= fixed).all()  # the pinned layouts are one answer of the bounded problem
    assert lean.sum() < fixed.sum()
    # The bounded answers keep each layer's inputs within the pinned layouts' bytes per device.
    mesh = logical_mesh(spec, (1, 8), layer_sharding.AXES)
    pinned = problems.fixed(kernels, mesh)
    for layer in range(len(problems.ops)):
        key = layer_sharding.cache_key(problems, layer, pinned, mesh, 1, "autopar")
        (seconds, memory), bounded = layer_sharding._CACHE[key], layer_sharding._CACHE[(key, "memory_like")]
        assert bounded[1] <= memory * (1 + 1e-6) and bounded[0] <= seconds
    with pytest.raises(ValueError, match="not both"):
        layer_sharding.layer_latency(traced, *where, fixed=kernels, memory_like=kernels)


@pytest.mark.parametrize("kind", [pytest.param("wresnet", marks=pytest.mark.slow), "moe"])  # wresnet: ~45 s
def test_megatron_rules_split_wide_resnet_and_experts_and_run_like_jit(kind):
    config = train.tiny_config(kind)
    step, state = train.setup(kind, "linen", config, OPTIMIZERS["sgd"]())
    batches = [train.make_batch(kind, config, 8, seed=i) for i in range(2)]
    paths = {
        jax.tree_util.keystr(p): s
        for p, s in jax.tree_util.tree_flatten_with_path(
            autopar.rule_specs(autopar.megatron_rules(), (state, batches[0]))[0],
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )[0]
    }
    split = {p: s for p, s in paths.items() if "model" in tuple(s)}
    wanted = ("conv_2", "conv_3") if kind == "wresnet" else ("w_in", "w_out", "query", "fc_in")
    assert all(any(w in p for p in split) for w in wanted)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    manual = autopar.Manual.from_rules(mesh, autopar.megatron_rules(), (state, batches[0]))
    sharded = jax.jit(step, in_shardings=manual.in_shardings, out_shardings=(manual.in_shardings[0], None))
    ref = jax.jit(step)
    s_man, s_ref = state, state
    for batch in batches:
        s_man, loss_man = sharded(s_man, batch)
        s_ref, loss_ref = ref(s_ref, batch)
        np.testing.assert_allclose(np.asarray(loss_man), np.asarray(loss_ref), **TOLERANCES["sgd"])
    for a, b in zip(jax.tree.leaves(s_man), jax.tree.leaves(s_ref), strict=True):
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["sgd"])


@pytest.mark.parametrize("kind", [pytest.param("wresnet", marks=pytest.mark.slow), "moe"])  # wresnet ~20 s
def test_no_layout_beats_one_device_over_the_device_count(kind):
    # The plan-quality bound (benchmarks/_plan_ilp.step_bound) rests on this: a layer on n
    # devices, free or pinned, costs at least its one-device cost over n.
    traced, state, batch = _traced(kind, 8)
    spec = cluster_mod.preset("cpu")
    one = layer_sharding.layer_latency(traced, spec, [(1, 1)], [[(1, 1)]])[:, 0, 0]
    assert (one > 0).all()
    meshes = [(8, 1), (2, 4)]
    free = layer_sharding.layer_latency(traced, spec, [(1, 8)], [meshes])[:, 0, :]
    pinned = layer_sharding.layer_latency(traced, spec, [(1, 8)], [meshes], fixed=_megatron(state, batch))
    assert np.isfinite(free).all()
    assert (free >= one[:, None] / 8 * (1 - 1e-9)).all()
    assert (pinned[:, 0, :] >= free * (1 - 1e-9)).all()
