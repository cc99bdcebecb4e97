"""Per-stage sharding plans from the ILP, checked on the plan, on the compiled HLO and numerically."""

import dataclasses
import re

import jax
import numpy as np
import optax
import pytest
from equality import OPTIMIZERS, TOLERANCES, assert_same_as_jit, classifier_step
from jax.sharding import NamedSharding, PartitionSpec

import autopar
from autopar._src import cluster as cluster_mod
from autopar._src import clustering, intra_op, layout_costs, planner, profile, stage_values, transfers
from autopar._src.program import Transfer
from models import train
from models.mlp import MLPConfig

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _mlp(config, batch_size, opt="adamw"):
    step, state = train.setup("mlp", "linen", config, OPTIMIZERS[opt]())
    batches = [train.make_batch("mlp", config, batch_size, seed=i) for i in range(3)]
    return step, state, batches


def _hlo(exe):
    """Compiled HLO text of every task."""
    return "\n".join(fn.lower(*exe.abstract_inputs(i)).compile().as_text() for i, fn in enumerate(exe.fns))


def _collectives(hlo, op_name=None):
    """``(kind, result shape)`` of every collective, optionally of one source op only."""
    found = []
    for line in hlo.splitlines():
        # The result is one array, or a tuple of them when XLA combined several collectives.
        m = re.search(r"= (\([^)]*\)|[a-z0-9]+\[[0-9,]*\]\S*) (" + "|".join(COLLECTIVES) + r")\(", line)
        if m and (op_name is None or re.search(r'op_name="[^"]*' + re.escape(op_name), line)):
            found.append((m.group(2), m.group(1)))
    return found


def _leaf_specs(exe, state):
    """Pytree path -> the ILP's spec of every state leaf (stage 0)."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    specs = exe.shardings[0].specs
    return {p: specs.get(v) for p, v in zip(paths, exe.step.arg_vars, strict=False)}


def _dots(exe):
    return [op for op in intra_op.stage_ops(exe.program, 0)[0] if op.eqn.primitive.name == "dot_general"]


def test_large_batch_small_weights_is_data_parallel():
    config = MLPConfig(features=(64,), in_features=64, num_classes=16)
    step, state, batches = _mlp(config, 16384)
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["adamw"], num_stages=1, num_microbatches=1, mesh_shape=(8,)
    )
    exe = par.executable(state, batches[0])
    chosen = exe.shardings[0]
    assert chosen.status == "optimal"
    x_var = exe.step.arg_vars[len(jax.tree.leaves(state)) + list(batches[0]).index("x")]
    assert chosen.specs[x_var] == ("data", None)
    for op in _dots(exe):
        (out,) = op.outs
        if op.eqn.outvars[0].aval.shape[0] == 16384:  # activations: split over the batch
            assert chosen.specs[out][0] == "data", chosen.strategies[out]
            assert chosen.strategies[out] == "batch[data]"
        else:  # weight gradients: the batch is contracted, then summed over devices
            assert chosen.strategies[out].startswith("row_"), chosen.strategies[out]
    # No activation is ever communicated: every collective is weight- or loss-sized.
    found = _collectives(_hlo(exe))
    assert found
    assert not [c for c in found if "16384" in c[1]], found


def test_small_batch_large_weights_is_megatron():
    config = MLPConfig(features=(4096,), in_features=1024, num_classes=1024)
    step, state, batches = _mlp(config, 8)
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["adamw"], num_stages=1, num_microbatches=1, mesh_shape=(1, 8)
    )
    exe = par.executable(state, batches[0])
    specs = _leaf_specs(exe, state)
    assert specs[".params['dense_0']['kernel']"] == (None, "model")  # column split
    assert specs[".params['head']['kernel']"] == ("model", None)  # row split
    strategies = [exe.shardings[0].strategies[op.outs[0]] for op in _dots(exe)]
    assert strategies[0] == "column[model]"
    assert strategies[1] in ("row_allreduce[model]", "row_reducescatter[model]")
    hlo = _hlo(exe)
    # The block's forward communicates once: the partial sums of the row-split matmul.
    forward = [c for c in _collectives(hlo, "MLP/head/dot_general")]
    assert [kind for kind, _ in forward] == ["all-reduce"], forward
    # ... and the weights are never gathered.
    assert not [c for c in _collectives(hlo) if re.search(r"\[(1024,4096|4096,1024)\]", c[1])]


def _gpt_on_one_stage(**overrides):
    """A tiny GPT's step on one stage of 8 devices as (1, 8): equal to ``jax.jit`` over three
    steps; its executable and the stage's sharding."""
    config = train.tiny_config("gpt", **overrides)
    step, state = train.setup("gpt", "linen", config, OPTIMIZERS["sgd"]())
    batches = [train.make_batch("gpt", config, 2, seed=i) for i in range(3)]
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["sgd"], num_stages=1, num_microbatches=1, mesh_shape=(1, 8)
    )
    exe = par.executable(state, batches[0])
    return exe, exe.shardings[0]


def test_attention_splits_heads():
    exe, chosen = _gpt_on_one_stage(hidden=256, num_heads=8, num_layers=1)
    by_source = {}
    for op in _dots(exe):
        name = str(op.eqn.source_info.name_stack)
        by_source.setdefault(name, chosen.strategies[op.outs[0]])
    for proj in ("query", "key", "value"):
        assert by_source[f"GPT/block_0/attn/{proj}"] == "column[model]"
    attention = [s for n, s in by_source.items() if "->" in n and "transpose" not in n]
    assert len(attention) == 2 and all(s == "heads[model]" for s in attention), by_source
    assert by_source["GPT/block_0/attn/out"].startswith("row_")
    hlo = _hlo(exe)
    # Heads stay local: the score and context matmuls communicate nothing.
    assert not _collectives(hlo, "bqhd,bkhd->bhqk")
    assert not _collectives(hlo, "bhqk,bkhd->bqhd")
    assert [k for k, _ in _collectives(hlo, "GPT/block_0/attn/out/dot_general")] == ["all-reduce"]


def _tight_cluster(step, state, batch, fraction):
    """A cluster whose devices leave the ILP ``fraction`` of the state's bytes for the state."""
    total = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))
    base = cluster_mod.preset("cpu")
    exe = autopar.autoparallel(step, num_stages=1, mesh_shape=(8,), cluster=base).executable(state, batch)
    parts = planner.planned_peak(profile.layer_profile(exe.step, exe.batch_leaf_ids), exe.plan, 0)
    # The ILP gets the device memory less the planner's headroom and the memory model's
    # transients, for the state, the gradient sums and the stashes.
    memory = int(
        (fraction * total + parts.stashes + parts.gradient_sums + parts.rest) / (1 - planner.MEMORY_HEADROOM)
    )
    return dataclasses.replace(base, device=dataclasses.replace(base.device, memory_bytes=memory))


def test_tight_memory_shards_optimizer_state():
    config = MLPConfig(features=(256,), in_features=64, num_classes=16)
    step, state, batches = _mlp(config, 8)
    ample = autopar.autoparallel(
        step, num_stages=1, mesh_shape=(8,), cluster=_tight_cluster(step, state, batches[0], 100)
    )
    ample_specs = _leaf_specs(ample.executable(state, batches[0]), state)
    head = ["['head']['kernel']", "['head']['bias']"]
    opt_state = [f".opt_state[0].{m}{p}" for m in ("mu", "nu") for p in head]
    assert all(set(ample_specs[k]) == {None} for k in opt_state), ample_specs
    par = assert_same_as_jit(
        step,
        state,
        batches,
        TOLERANCES["adamw"],
        num_stages=1,
        num_microbatches=1,
        mesh_shape=(8,),
        cluster=_tight_cluster(step, state, batches[0], 0.25),
    )
    exe = par.executable(state, batches[0])
    specs = _leaf_specs(exe, state)
    kernel_moments = [f".opt_state[0].{m}['head']['kernel']" for m in ("mu", "nu")]
    assert all("data" in specs[k] for k in kernel_moments), specs
    # Per device, the state now fits the budget the ILP was given.
    budget = 0.25 * sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))
    leaves = jax.tree.leaves(state)
    per_device = sum(
        np.asarray(x).nbytes / np.prod([8 if a else 1 for a in (specs[p] or ())])
        for p, x in zip(specs, leaves, strict=False)
    )
    assert per_device <= budget
    # The tight plan communicates what its split layout needs, and never gathers the head's
    # kernel (or its moments) whole: they stay split in memory.
    tight = _collectives(_hlo(exe))
    assert tight and not [c for c in tight if c[0] == "all-gather" and re.match(r"f32\[256,16\]", c[1])]
    # The arrays a step returns carry that layout.
    new_state, _ = par(state, batches[0])
    mu = new_state.opt_state[0].mu["head"]["kernel"]
    assert mu.sharding.spec != PartitionSpec() and mu.sharding.shard_shape(mu.shape) != mu.shape


def test_sharding_data_keeps_batch_split_and_replicas():
    config = MLPConfig(features=(256,), in_features=64, num_classes=16)
    step, state, batches = _mlp(config, 8)
    par = autopar.autoparallel(step, num_stages=1, sharding="data")
    exe = par.executable(state, batches[0])
    (chosen,) = exe.shardings
    batch = {exe.step.arg_vars[i] for i in exe.batch_leaf_ids}
    state_vars = [v for v in exe.step.arg_vars if v not in batch]
    assert state_vars and all(not any(exe.sharding((v, None), 0).spec) for v in state_vars)
    split = [tuple(exe.sharding((v, 0), 0).spec) for v in batch]
    assert split and all(s[0] == "data" and not any(s[1:]) for s in split), split


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(sharding="zero"), "sharding='zero'"),
        (dict(num_stages=2, mesh_shape=(2, 2, 1)), "mesh_shape must be"),
        (dict(mesh_shape=(2, 4)), "needs an int num_stages"),
        (dict(num_stages=1, mesh_shape=(2, 4), sharding="data"), "never uses"),
    ],
)
def test_bad_sharding_options(bad, match):
    with pytest.raises(ValueError, match=match):
        autopar.autoparallel(lambda s, b: s, **bad)


def test_mesh_shape_must_hold_the_stage():
    config = MLPConfig(features=(64,), in_features=64, num_classes=16)
    step, state, batches = _mlp(config, 8)
    par = autopar.autoparallel(step, num_stages=2, mesh_shape=(2, 4))
    with pytest.raises(
        ValueError, match=r"mesh_shape=\(2, 4\) holds 8 devices but each of the 2 stages has 4"
    ):
        par(state, batches[0])


# -- transfers between stages ----------------------------------------------------------------


def _recorded_puts(monkeypatch):
    """Every ``jax.device_put`` of an array from one set of devices to another."""
    calls = []
    real = jax.device_put

    def put(x, device=None, *args, **kwargs):
        src = getattr(x, "sharding", None)
        if isinstance(src, NamedSharding) and isinstance(device, NamedSharding):
            if src.device_set != device.device_set:
                calls.append((src, device, tuple(x.shape)))
        return real(x, device, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", put)
    return calls


def _check_puts(calls):
    assert calls
    for src, dst, shape in calls:
        a, b = transfers.blocks(src, shape), transfers.blocks(dst, shape)
        if len(a) == len(b):
            assert a == b, (src, dst)
        else:  # meshes of different sizes: each destination block is one the source holds
            assert set(b) <= set(a), (src, dst)


def test_transfers_copy_identical_blocks(monkeypatch):
    config = train.tiny_config("gpt", tie_embeddings=True)
    step, state = train.setup("gpt", "linen", config, OPTIMIZERS["sgd"]())
    batches = [train.make_batch("gpt", config, 8, seed=i) for i in range(3)]
    calls = _recorded_puts(monkeypatch)
    par = assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=4, num_microbatches=4)
    exe = par.executable(state, batches[0])
    meshes = [set(m.devices.flat) for m in exe.meshes]
    assert all(not (a & b) for i, a in enumerate(meshes) for b in meshes[i + 1 :])
    assert exe.routes
    for route in exe.routes.values():
        assert route.send.device_set == route.src.device_set
        assert route.recv.device_set == route.dst.device_set
    _check_puts(calls)


def test_transfers_between_meshes_of_different_shapes(monkeypatch):
    config = train.tiny_config("gpt")
    step, state = train.setup("gpt", "linen", config, OPTIMIZERS["sgd"]())
    batches = [train.make_batch("gpt", config, 8, seed=i) for i in range(3)]
    base = autopar.autoparallel(step, num_stages=2, num_microbatches=2).plan(state, batches[0])
    first, second = base.stages
    plan = dataclasses.replace(
        base,
        stages=(
            dataclasses.replace(
                first, device_ids=(0, 1, 2, 3), mesh_shape=(2, 2), axis_names=("data", "model")
            ),
            dataclasses.replace(second, device_ids=(4, 5), mesh_shape=(2,), axis_names=("data",)),
        ),
    )
    calls = _recorded_puts(monkeypatch)
    six = jax.devices()[:6]
    par = assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], plan=plan, devices=six)
    exe = par.executable(state, batches[0])
    assert [m.devices.shape for m in exe.meshes] == [(2, 2), (2,)]
    _check_puts(calls)


def test_route_choices():
    devices = np.array(jax.devices())
    a = jax.sharding.Mesh(devices[:4].reshape(2, 2), ("data", "model"))
    b = jax.sharding.Mesh(devices[4:].reshape(2, 2), ("data", "model"))
    split, whole = PartitionSpec("data", "model"), PartitionSpec()
    shape = (8, 8)
    # Same layout on both sides: a plain copy.
    r = transfers.plan_route(NamedSharding(a, split), NamedSharding(b, split), shape, 4)
    assert not r.reshard_before and not r.reshard_after
    # Split source, replicated destination: send the small blocks, gather on arrival.
    r = transfers.plan_route(NamedSharding(a, split), NamedSharding(b, whole), shape, 4)
    assert not r.reshard_before and r.reshard_after
    # Replicated source, split destination: slice first, send the small blocks.
    r = transfers.plan_route(NamedSharding(a, whole), NamedSharding(b, split), shape, 4)
    assert r.reshard_before and not r.reshard_after
    for src, dst in [(split, whole), (whole, split)]:
        r = transfers.plan_route(NamedSharding(a, src), NamedSharding(b, dst), shape, 4)
        assert transfers.same_blocks(r.send, r.recv, shape)
        x = jax.device_put(np.arange(64.0).reshape(shape), NamedSharding(a, src))
        y = transfers.Resharder().move(x, r)
        assert y.sharding.is_equivalent_to(NamedSharding(b, dst), 2)
        np.testing.assert_array_equal(np.asarray(y), np.arange(64.0).reshape(shape))


# -- the stage DP priced by the ILP --------------------------------------------------------


def test_stage_dp_prices_layers_with_the_ilp():
    from autopar._src import cluster as cm
    from autopar._src import layer_sharding, planner, profile

    config = train.tiny_config("gpt", num_layers=4)
    step, state = train.setup("gpt", "linen", config, OPTIMIZERS["sgd"]())
    batch = train.make_batch("gpt", config, 8)
    exe = autopar.autoparallel(step, num_stages=4, num_microbatches=1, devices=jax.devices()[:4]).executable(
        state, batch
    )
    spec = cluster_mod.preset("cpu")
    submeshes = cm.submesh_shapes(spec)
    logical = tuple(cm.logical_shapes(m) for m in submeshes)
    layer_sharding._CACHE.clear()
    table = layer_sharding.layer_latency(exe.step, spec, submeshes, logical)
    assert table.shape[:2] == (4, len(submeshes))
    # The two middle layers are the same transformer block: solved once per mesh, equal seconds.
    assert np.array_equal(table[1], table[2])
    solved_meshes = sum(len(q) for q in logical)
    assert len(layer_sharding._CACHE) < table.shape[0] * solved_meshes
    assert np.isfinite(table[:, 0, 0]).all() and (table[:, 0, 0] > 0).all()
    # A stage's latency is the sum of its layers', plus its copies and dispatch.
    prof = profile.layer_profile(exe.step, exe.batch_leaf_ids)
    costs = planner.stage_costs(prof, spec, num_microbatches=1, sharded=table)
    k, q = len(submeshes) - 1, 1
    send = costs.latency[1, 3, k, q] - table[1:4, k, q].sum()
    one = costs.latency[3, 3, k, q] - table[3, k, q]
    assert send == pytest.approx(one, rel=1e-9) and send > 0


def test_dry_run_with_sharding_costs(monkeypatch):
    # One clustering: test_planning prices several under the sharding ILP.
    monkeypatch.setattr(clustering, "BYTES_FACTORS", (clustering.BYTES_FACTOR,))
    monkeypatch.setattr(clustering, "UNBALANCED_FACTORS", ())
    config = train.tiny_config("gpt", num_layers=4)
    step, state = train.setup("gpt", "linen", config, OPTIMIZERS["sgd"]())
    batch = train.make_batch("gpt", config, 16)
    abstract = jax.eval_shape(lambda: (state, batch))
    cluster = cluster_mod.parse_cluster("1x4xA100")
    analytic = autopar.plan_step(step, *abstract, cluster=cluster, num_microbatches=2)
    priced = autopar.plan_step(step, *abstract, cluster=cluster, num_microbatches=2, sharding_costs=True)
    # A different cost model on the same layers.
    assert len(priced.cuts) == len(analytic.cuts)
    assert priced.predicted_step_time > 0
    assert priced.predicted_step_time != analytic.predicted_step_time
    assert sum(len(st.device_ids) for st in priced.stages) <= 4


@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_memory_row_counts_held_values_and_gradient_sums_apart(num_microbatches):
    config = MLPConfig(features=(64, 64), in_features=32, num_classes=8)
    step, state, batches = _mlp(config, 16, "sgd")
    par = autopar.autoparallel(step, num_stages=2, num_microbatches=num_microbatches, mesh_shape=(4,))
    exe = par.executable(state, batches[0])
    program = exe.program
    for stage in range(2):
        _, alias, _ = intra_op.stage_ops(program, stage)
        held = stage_values.held_copies(program, stage, alias)
        summed = stage_values.summed(program, stage, alias)
        # A running sum is never a microbatch's value.
        assert not set(held) & summed
        # Every running sum is a gradient of the stage (kernels among them) when there are
        # several microbatches; with one, the gradients are the step's outputs.
        kernels = [v for v in summed if len(v.aval.shape) == 2]
        assert (len(kernels) >= 1) == (num_microbatches > 1), summed
        # Every microbatch's slice of the batch is placed at the start of the step.
        batch = {k[0] for k, stages in program.input_stages.items() if stage in stages and k[1] == 0}
        assert batch and {held[v] for v in batch} == {num_microbatches}
        # What a forward keeps for a backward of the stage (another task, or inside the task
        # that joins them: the last stage's), one copy per microbatch in flight under 1F1B: 2
        # on the first stage, 1 on the last.
        tasks = [t for t in program.tasks if t.stage == stage]
        kept = {
            stage_values.alias_root(alias, k[0])
            for f in tasks
            if f.label.startswith("F")
            for b in tasks
            if b.label.startswith("B")
            for k in set(f.out_keys) & set(b.in_keys)
        } | {stage_values.alias_root(alias, k[0]) for t in tasks for k in t.kept}
        assert all(held[v] == planner.in_flight(exe.plan, stage) for v in kept), kept
        assert bool(kept) == (stage == 1)


def test_received_activations_the_backward_reads_again_are_held_per_microbatch_in_flight():
    # Tiny MoE on 3 stages: a middle stage's backward reads some activations it received for
    # its forward, which it holds like its own stashes.
    config = train.tiny_config("moe")
    step, state = train.setup("moe", "linen", config, optax.sgd(0.1))
    batch = train.make_batch("moe", config, 16)
    par = autopar.autoparallel(
        step, num_stages=3, num_microbatches=4, mesh_shape=(2,), devices=jax.devices()[:6]
    )
    exe = par.executable(state, batch)
    program, stage = exe.program, 1
    ops, alias, _ = intra_op.stage_ops(program, stage)
    read_twice = {
        stage_values.alias_root(alias, ins.key[0])
        for ins in program.instrs
        if isinstance(ins, Transfer)
        and ins.dst == stage
        and sum(ins.key in t.in_keys for t in program.tasks if t.stage == stage) > 1
    }
    held = stage_values.held_copies(program, stage, alias)
    # At least one per microbatch in flight (2 here); one more while the next microbatch's
    # arrives, sent as soon as it is made, before a backward frees the oldest.
    assert read_twice and min(held[v] for v in read_twice) >= planner.in_flight(exe.plan, stage) == 2
    # Without a budget the layouts do not depend on the memory row; with the held values it
    # grows by their copies beyond the one an input counts, and by the gradient sums.
    mesh = exe.shardings[stage].mesh
    bare, full = (intra_op.solve_stage(program, stage, mesh, count_held=c) for c in (False, True))
    assert bare.specs == full.specs
    made = {v for op in ops for v in op.outs if v is not None}
    extra = {v: n - (v not in made) for v, n in held.items()}
    extra.update((v, 1) for v in stage_values.summed(program, stage, alias))
    expected = sum(n * layout_costs.share_bytes(v, full.specs[v], mesh) for v, n in extra.items() if n > 0)
    assert expected > 0
    np.testing.assert_allclose(full.memory_bytes - bare.memory_bytes, expected, rtol=1e-9)


def test_a_data_parallel_mixture_of_experts_routes_and_dispatches_on_its_own_groups():
    """Laid out by the ILP around data parallelism's inputs, the MoE step keeps each device's
    routing groups local, as pjit data parallelism does: its top-2 routing (``jnp.stack``) and
    its per-expert matmuls (batched over the experts, split over the groups) need no
    collective, and the step's only ones reduce the gradients. Before the rules for both, the
    plan all-gathered 7 values and ran 2 all-to-alls per step (42 ms against pjit's 27)."""
    config = train.tiny_config("moe")
    step, state = train.setup("moe", "linen", config, OPTIMIZERS["adamw"]())
    batches = [train.make_batch("moe", config, 32, seed=i) for i in range(2)]
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["adamw"], sharding="data", num_stages=1, num_microbatches=1
    )
    kinds = {kind for kind, _ in _collectives(_hlo(par.executable(state, batches[0])))}
    assert kinds == {"all-reduce"}, kinds


@pytest.mark.parametrize("state_first", [True, False])
def test_the_new_state_is_tied_to_the_old_whichever_output_holds_it(state_first):
    """``step -> (loss, state)`` carries its state as ``step -> (state, loss)`` does: each new
    parameter and optimizer leaf is the next step's input, so the search keeps it where that
    step reads it, and the step returns it there."""
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.adam(0.1))
    batches = [train.make_batch("mlp", config, 16, seed=i) for i in range(2)]
    step = classifier_step("x", "y")

    def swapped(state, batch):
        return step(state, batch)[::-1]

    fn = step if state_first else swapped
    par = autopar.autoparallel(fn, num_stages=2, num_microbatches=2, mesh_shape=(2, 2))
    exe = par.executable(state, batches[0])
    carried = intra_op.carried_state(exe.step)
    assert len(carried) == len(jax.tree.leaves(state))
    out = par(state, batches[0])
    new_state = out[0] if state_first else out[1]
    (targets, _) = par.input_shardings(state, batches[1])
    for leaf, target in zip(jax.tree.leaves(new_state), jax.tree.leaves(targets), strict=True):
        assert leaf.sharding == target
