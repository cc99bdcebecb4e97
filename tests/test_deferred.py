"""Gradient all-reduces deferred to the last microbatch: equal to ``jax.jit``, and the compiled
per-microbatch tasks issue no weight-gradient collective."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equality import OPTIMIZERS, TOLERANCES, assert_same_as_jit, classifier_step
from flax.training import train_state

import autopar
from autopar._src import compat, deferred, layer_sharding, partial_chains, sharding_ilp
from autopar._src.program import Transfer
from autopar._src.strategy_graph import GraphOp
from models import train
from models.mlp import MLPConfig

COLLECTIVE = re.compile(r"= (\([^)]*\)|[a-z0-9]+\[[0-9,]*\]\S*) (all-reduce|reduce-scatter|all-gather)\(")


def _task_collectives(exe):
    """Per task: ``(repeated, [(kind, result shape)])`` of its compiled HLO."""
    found = []
    for i, (task, fn) in enumerate(zip(exe.program.tasks, exe.fns, strict=True)):
        hlo = fn.lower(*exe.abstract_inputs(i)).compile().as_text()
        found.append((task.repeated, [(m[2], m[1]) for m in COLLECTIVE.finditer(hlo)]))
    return found


def _weight_shaped(collectives, shapes):
    """The collectives with a result (or a combined result's part) of one of ``shapes``."""
    return [c for c in collectives if set(re.findall(r"\[[0-9,]*\]", c[1])) & set(shapes)]


@pytest.mark.parametrize(
    "mesh_shape, config, batch, weights",
    [
        # Data parallel: every weight gradient contracts the batch split over all 8 devices.
        # Per device: the activations have 512 rows; the gradients are whole.
        (
            (8,),
            MLPConfig(features=(64,), in_features=64, num_classes=16),
            16384,
            ("[64,64]", "[64,16]", "[16,64]"),
        ),
        # Data x tensor parallel: the gradients of the split weights are split over "model"
        # and summed over "data". Per device: the activations have 192 or 384 rows, the
        # kernels' gradients are 256 x 256 blocks (reduced per microbatch, XLA all-reduces
        # the whole 256 x 1024 kernel gradient before it slices the block).
        (
            (2, 4),
            MLPConfig(features=(1024,), in_features=256, num_classes=256),
            1536,
            ("[256,256]", "[256,1024]", "[1024,256]"),
        ),
    ],
)
def test_weight_gradients_are_reduced_once_per_step(mesh_shape, config, batch, weights):
    step, state = train.setup("mlp", "linen", config, OPTIMIZERS["adamw"]())
    batches = [train.make_batch("mlp", config, batch, seed=i) for i in range(3)]
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["adamw"], num_stages=1, num_microbatches=4, mesh_shape=mesh_shape
    )
    exe = par.executable(state, batches[0])
    sums = exe.deferred[0]
    assert sums.accumulators, exe.shardings[0].partial_sums
    tasks = _task_collectives(exe)
    per_microbatch = [c for repeated, cs in tasks if repeated for c in cs]
    once = [c for repeated, cs in tasks if not repeated for c in cs]
    # The gradients' all-reduces left the microbatches' tasks for the step's last task.
    assert not _weight_shaped(per_microbatch, weights), per_microbatch
    assert [c for c in once if c[0] == "all-reduce"], once
    # Run without deferring, the same plan reduces them in every microbatch's backward.
    eager = _task_collectives(dataclasses.replace(exe, defer_reductions=False))
    assert _weight_shaped([c for repeated, cs in eager if repeated for c in cs], weights)


@pytest.mark.parametrize("num_stages", [1, 2])
def test_data_sharding_reduces_gradients_once_per_step(num_stages):
    # sharding="data": the batch split, the parameters and optimizer state replicated, and the
    # weight gradients' all-reduces left for the step's last task as with the ILP's layouts.
    config = MLPConfig(features=(64, 64), in_features=64, num_classes=16)
    step, state = train.setup("mlp", "linen", config, OPTIMIZERS["adamw"]())
    batches = [train.make_batch("mlp", config, 4096, seed=i) for i in range(3)]
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["adamw"], num_stages=num_stages, num_microbatches=4, sharding="data"
    )
    exe = par.executable(state, batches[0])
    assert len(exe.shardings) == num_stages
    paths = dict(zip(exe.step.arg_vars, exe.step.input_paths(), strict=True))
    for stage, chosen in enumerate(exe.shardings):
        kernels = [v for v in chosen.specs if paths.get(v, "").endswith("['kernel']")]
        assert kernels and all(not any(chosen.specs[v]) for v in kernels), chosen.specs
        assert exe.deferred[stage].accumulators, chosen.partial_sums
    tasks = _task_collectives(exe)
    per_microbatch = [c for repeated, cs in tasks if repeated for c in cs]
    assert not _weight_shaped(per_microbatch, ("[64,64]", "[64,16]")), per_microbatch
    eager = _task_collectives(dataclasses.replace(exe, defer_reductions=False))
    assert _weight_shaped([c for repeated, cs in eager if repeated for c in cs], ("[64,64]", "[64,16]"))


def test_one_microbatch_defers_nothing():
    config = MLPConfig(features=(64,), in_features=64, num_classes=16)
    step, state = train.setup("mlp", "linen", config, OPTIMIZERS["sgd"]())
    batches = [train.make_batch("mlp", config, 16384, seed=i) for i in range(2)]
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["sgd"], num_stages=1, num_microbatches=1, mesh_shape=(8,)
    )
    exe = par.executable(state, batches[0])
    assert exe.shardings[0].partial_sums  # the layout leaves partial sums ...
    assert exe.deferred[0] is deferred.NONE  # ... but with one microbatch there is nothing to defer


def test_reduced_axes():
    names = ("data", "model")
    # Weight gradient of a column-split layer: the batch (contracted) over data.
    assert deferred.reduced_axes([("data", None), ("data", "model")], (None, "model"), names) == ("data",)
    # Batch split over both axes and contracted: partial sums over both, major first.
    assert deferred.reduced_axes([(("data", "model"), None)], (None,), names) == ("data", "model")
    # Nothing contracted is split: no partial sums.
    assert deferred.reduced_axes([("data", None), (None, "model")], ("data", "model"), names) == ()


@pytest.mark.parametrize(
    "scatter, partial",
    [
        # An embedding's gradient: each device's rows scattered into its own zeros, then summed.
        (lambda table, idx, rows: jnp.zeros_like(table).at[idx].add(rows), True),
        # Into a table every device holds: summing the devices' results would add it n times.
        (lambda table, idx, rows: table.at[idx].add(rows), False),
        (lambda table, idx, rows: jnp.ones_like(table).at[idx].add(rows), False),
    ],
)
def test_a_scatter_add_sums_partials_only_into_zeros(scatter, partial):
    table, idx, rows = jnp.ones((16, 4)), jnp.arange(8) % 16, jnp.ones((8, 4))
    eqns = jax.make_jaxpr(scatter)(table, idx, rows).jaxpr.eqns
    made = {v: (e, e.invars, k) for e in eqns for k, v in enumerate(e.outvars)}
    (add,) = [e for e in eqns if e.primitive.name in partial_chains.SCATTER_ADD]
    assert partial_chains.sums_partials(add, add.invars, made) is partial


def test_a_chain_passes_through_a_scatter_into_zeros_to_the_batch_sum():
    """A position embedding's gradient sums the batch, drops a unit dim and scatters into
    zeros. For pricing, the scatter is a root (its updates split over the rows it scatters) and
    a link to the batch sum; the driver takes the root its layouts make partial sums."""

    def grad(table, x):
        return jax.grad(lambda t: jnp.sum(jnp.tanh(x + t[jnp.arange(x.shape[1])][None])))(table)

    jaxpr = jax.make_jaxpr(grad)(jnp.ones((16, 4)), jnp.ones((8, 16, 4))).jaxpr
    ops = [
        GraphOp(e, tuple(None if compat.is_literal(v) else v for v in e.invars), tuple(e.outvars))
        for e in jaxpr.eqns
    ]
    made = {v: e.primitive.name for e in jaxpr.eqns for v in e.outvars}
    (total,) = jaxpr.outvars

    def find(through):
        return partial_chains.graph_chains(ops, [total], through_scatters=through)

    (scattered,) = find(False)
    (summed,) = find(True)
    assert made[scattered.root] in partial_chains.SCATTER_ADD
    assert made[summed.root] == "reduce_sum" and summed.root.aval.shape[0] == 16  # the batch sum
    assert scattered.root in summed.links
    assert partial_chains.every_chain(find) == [scattered, summed]


def test_gradients_split_over_a_summed_axis_are_not_deferred():
    """A gradient laid out split over the axis its partial sums are over would need its whole
    block per device to stay stacked: it is reduce-scattered each microbatch instead."""
    config = MLPConfig(features=(64,), in_features=64, num_classes=16)
    step, state = train.setup("mlp", "linen", config, OPTIMIZERS["sgd"]())
    batch = train.make_batch("mlp", config, 16384, seed=0)
    exe = autopar.autoparallel(step, num_stages=1, num_microbatches=4, mesh_shape=(8,)).executable(
        state, batch
    )
    chosen, kept = exe.shardings[0], exe.deferred[0]
    assert kept.accumulators
    total = next(iter(kept.accumulators))
    specs = dict(chosen.specs)
    specs[total] = ("data",) + tuple(specs[total])[1:]  # the gradient's first dim split over data
    again = deferred.deferred_sums(exe.program.tasks, 0, chosen.partial_sums, specs)
    assert total not in again.accumulators
    assert set(again.accumulators) == set(kept.accumulators) - {total}


def _shared_gradient_step(params, batch):
    def loss_fn(p, b):
        y = jnp.tanh(b["x"] @ (p["a"] + p["b"]))  # one gradient value for "a" and "b"
        return jnp.mean((jnp.tanh(y @ p["c"]) - b["y"]) ** 2)

    loss, grads = autopar.value_and_grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def test_a_gradient_shared_by_two_sums_is_deferred_for_both_or_neither():
    keys = jax.random.split(jax.random.key(0), 5)
    params = {k: 0.3 * jax.random.normal(r, (128, 128)) for k, r in zip("abc", keys, strict=False)}
    batch = {"x": jax.random.normal(keys[3], (1024, 128)), "y": jax.random.normal(keys[4], (1024, 128))}
    par = autopar.autoparallel(_shared_gradient_step, num_stages=1, num_microbatches=4, mesh_shape=(8,))
    exe = par.executable(params, batch)
    chosen, kept = exe.shardings[0], exe.deferred[0]
    chains = partial_chains.gradient_chains(exe.program.tasks, 0, chosen.partial_sums.__contains__)
    roots = {}
    for c in chains:  # one chain per microbatch's task
        roots.setdefault(c.root, set()).add(c.total)
    [(a_total, b_total)] = [tuple(t) for t in roots.values() if len(t) == 2]
    assert {a_total, b_total} <= set(kept.accumulators)
    # One of the two sums split over the summed axis: the shared value is not stacked for either.
    specs = dict(chosen.specs)
    specs[a_total] = ("data",) + tuple(specs[a_total])[1:]
    again = deferred.deferred_sums(exe.program.tasks, 0, chosen.partial_sums, specs)
    assert a_total not in again.accumulators and b_total not in again.accumulators
    assert set(again.accumulators) == set(kept.accumulators) - {a_total, b_total}
    mixed = dataclasses.replace(exe, shardings=[dataclasses.replace(chosen, specs=specs)])
    out = jax.tree.unflatten(mixed.step.out_tree, mixed(jax.tree.leaves((params, batch))))
    ref = jax.jit(_shared_gradient_step)(params, batch)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCES["sgd"])


class _ConvNet(nn.Module):
    """Convolutions without BatchNorm: every microbatch count computes the same gradient."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(32, (3, 3), name="conv_1")(x))
        x = nn.relu(nn.Conv(32, (3, 3), name="conv_2")(x))
        return nn.Dense(10, name="head")(x.mean(axis=(1, 2)))


_classifier_step = classifier_step("inputs", "labels")


def _classifier(model, optimizer, input_shape, classes, num_batches):
    """``(state, batches)`` of ``model`` classifying random inputs (rows of ``input_shape[1:]``)."""
    sample = jax.random.normal(jax.random.key(0), (4, *input_shape[1:]))
    params = model.init(jax.random.key(1), sample)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=OPTIMIZERS[optimizer]())
    batches = [
        {
            "inputs": jax.random.normal(jax.random.key(10 + i), input_shape),
            "labels": jax.random.randint(jax.random.key(20 + i), input_shape[:1], 0, classes),
        }
        for i in range(num_batches)
    ]
    return state, batches


def test_convolution_gradients_are_reduced_once_per_step():
    state, batches = _classifier(_ConvNet(), "sgd", (512, 16, 16, 3), 10, 2)
    par = assert_same_as_jit(
        _classifier_step, state, batches, TOLERANCES["sgd"], num_stages=1, num_microbatches=4, mesh_shape=(8,)
    )
    exe = par.executable(state, batches[0])
    roots = {v.aval.shape for v, s in exe.deferred[0].values.items() if s.operand_specs is not None}
    assert (3, 3, 32, 32) in roots  # conv_2's kernel gradient, a convolution over the batch
    kernels = ("[3,3,3,32]", "[3,3,32,32]", "[32,10]")
    per_microbatch = [c for repeated, cs in _task_collectives(exe) if repeated for c in cs]
    assert not _weight_shaped(per_microbatch, kernels), per_microbatch
    eager = _task_collectives(dataclasses.replace(exe, defer_reductions=False))
    assert _weight_shaped([c for repeated, cs in eager if repeated for c in cs], kernels)


class _Block(nn.Module):
    # A smooth activation: with relu, a pre-activation within 1e-7 of zero (one in this data
    # under jax 0.12) can land on either side in a sharded matmul's summation order, flip one
    # element of the backward's mask and move a weight's Adam update by 5e-4.
    @nn.compact
    def __call__(self, x, _=None):
        return nn.gelu(nn.Dense(64)(x)), None


class _WrappedNet(nn.Module):
    """Blocks as rematerialised calls, nested ``jit`` calls, one ``nn.scan`` or ``nn.cond``s."""

    wrap: str

    @nn.compact
    def __call__(self, x):
        if self.wrap == "scan":
            x = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()(
                x, None
            )[0]
        elif self.wrap == "cond":
            for _ in range(2):
                x = nn.cond(x.mean() > -1.0, lambda m, y: m(y)[0], lambda m, y: m(-y)[0], _Block(), x)
        else:
            block = nn.remat(_Block) if self.wrap == "remat" else nn.jit(_Block)
            for _ in range(2):
                x = block()(x)[0]
        return nn.Dense(16)(x)


@pytest.mark.parametrize(
    "wrap, kernels, deferred_inside",
    [
        ("remat", "[64,64]", True),
        ("jit", "[64,64]", True),
        ("scan", "[2,64,64]", True),
        ("cond", "[64,64]", False),
    ],
)
def test_gradients_made_inside_calls(wrap, kernels, deferred_inside):
    """A rematerialised block's weight gradients are made inside its backward call, a scanned
    stack's inside its backward scan: they leave the call as stacked partial sums (a scan's
    after its iterations' dim) and are reduced once per step. Inside a ``cond`` they are
    reduced every microbatch. The stage DP's costs (``layer_sharding``) find the same
    gradients as the driver."""
    state, batches = _classifier(_WrappedNet(wrap), "adamw", (4096, 64), 16, 3)
    par = assert_same_as_jit(
        _classifier_step,
        state,
        batches,
        TOLERANCES["adamw"],
        num_stages=1,
        num_microbatches=4,
        mesh_shape=(8,),
    )
    exe = par.executable(state, batches[0])
    kept = {str(list(v.aval.shape)).replace(" ", "") for v in exe.deferred[0].accumulators}
    assert (kernels in kept) == deferred_inside, kept
    chains = partial_chains.gradient_chains(exe.program.tasks, 0, lambda v: True)  # for any layout
    problems = layer_sharding.LayerProblems(exe.step)
    priced = [
        c for ops in problems.ops for c in partial_chains.graph_chains(ops, problems.carried, problems.loops)
    ]
    assert (
        len(priced) == len({c.total for c in chains}) >= len(exe.deferred[0].accumulators)
    )  # one per microbatch
    per_microbatch = [c for repeated, cs in _task_collectives(exe) if repeated for c in cs]
    if deferred_inside:  # no kernel gradient is reduced in a microbatch's task
        assert not _weight_shaped(per_microbatch, (kernels,)), per_microbatch


# Scanned blocks' mechanics are covered by test_gradients_made_inside_calls[scan] too.
@pytest.mark.parametrize(
    "blocks", [{"remat": True}, pytest.param({"scan_layers": True}, marks=pytest.mark.slow)]
)
def test_gpt_defers_its_block_gradients(blocks):
    """GPT blocks as large GPTs are trained, rematerialised or scanned: every gradient is
    reduced once per step, the token embedding's (a scatter-add of each device's rows into
    zeros) and the position embedding's (a sum over the batch scattered into zeros) too."""
    config = train.tiny_config("gpt", **blocks)
    per_microbatch, eager, batch = _defers_every_gradient("gpt", config)
    mlp = ("[64,256]", "[256,64]") if "remat" in blocks else ("[2,64,256]", "[2,256,64]")
    vocab = f"[{config.vocab_size},{config.hidden}]"
    positions = f"[{batch['tokens'].shape[1]},{config.hidden}]"  # the batch sum, as scattered
    assert not _weight_shaped(per_microbatch, (*mlp, vocab, positions)), per_microbatch
    assert _weight_shaped(eager, (vocab,)), eager
    assert _weight_shaped(eager, (positions,)), eager


def test_bert_defers_its_tied_embedding_gradient():
    """BERT's masked-LM head decodes with the token embedding: its gradient adds the head's
    matmul (a batch contraction) to the lookup's scatter into zeros, two partial sums, so it is
    reduced once per step like every other gradient; the parameters stay those of jax.jit."""
    config = train.tiny_config("bert")
    per_microbatch, eager, _ = _defers_every_gradient("bert", config)
    vocab = f"[{config.vocab_size},{config.hidden}]"
    assert not _weight_shaped(per_microbatch, (vocab,)), per_microbatch
    assert _weight_shaped(eager, (vocab,)), eager


def _defers_every_gradient(kind, config):
    """One stage of ``kind`` on 8 devices, 4 microbatches, 3 adamw steps equal to jax.jit's, with
    every gradient kept as partial sums. Returns the collectives of the tasks that run each
    microbatch, deferred and with deferral off, and the first batch."""
    step, state = train.setup(kind, "linen", config, OPTIMIZERS["adamw"]())
    batches = [train.make_batch(kind, config, 64, seed=i) for i in range(3)]
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["adamw"], num_stages=1, num_microbatches=4, mesh_shape=(8,)
    )
    exe = par.executable(state, batches[0])
    assert len(exe.deferred[0].accumulators) == len(jax.tree.leaves(state.params))
    found = [
        [c for repeated, cs in _task_collectives(e) if repeated for c in cs]
        for e in (exe, dataclasses.replace(exe, defer_reductions=False))
    ]
    return found[0], found[1], batches[0]


def test_a_tied_gradient_is_deferred_whole_or_not_at_all():
    """The two uses of a tied weight make one gradient from two partial sums: where the layouts
    leave only one of them partial, neither is kept stacked (the sum of a stacked and a reduced
    value has no per-device meaning)."""
    config = train.tiny_config("bert")
    step, state = train.setup("bert", "linen", config, OPTIMIZERS["sgd"]())
    exe = autopar.autoparallel(step, num_stages=1, num_microbatches=4, mesh_shape=(8,)).executable(
        state, train.make_batch("bert", config, 64, seed=0)
    )
    chosen, kept = exe.shardings[0], exe.deferred[0]
    chains = partial_chains.gradient_chains(exe.program.tasks, 0, chosen.partial_sums.__contains__)
    tied = [c for c in chains if c.total.aval.shape == (config.vocab_size, config.hidden)]
    roots = {c.root for c in tied}
    assert len(roots) == 2 and len({c.total for c in tied}) == 1  # a matmul and a scatter
    (total,) = {c.total for c in tied}
    assert total in kept.accumulators and roots <= set(kept.values)
    for root in roots:
        partial = {k: v for k, v in chosen.partial_sums.items() if k != root}
        # ... or partial over another axis than the other one (a 2-D mesh's "model").
        other = {**chosen.partial_sums, root: (chosen.partial_sums[root][0], ("model",))}
        for sums in (partial, other):
            again = deferred.deferred_sums(exe.program.tasks, 0, sums, chosen.specs)
            assert total not in again.accumulators and not roots & set(again.values)
            assert set(again.accumulators) == set(kept.accumulators) - {total}


def test_a_gradient_that_adds_a_whole_value_to_partial_sums_is_not_deferred():
    """``w @ w.T`` makes ``w``'s gradient from a partial sum over the data axis and from a value
    made whole: kept stacked, the stacked dim's sum would count the whole one once per device."""

    def loss_fn(p, x, y):
        w = p["w2"]
        h = jnp.tanh(jnp.tanh(x @ p["w1"]) @ (w + 0.01 * (w @ w.T)))
        return jnp.mean((h @ p["w3"] - y) ** 2)

    def step(p, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(p, batch["x"], batch["y"])
        return jax.tree.map(lambda a, g: a - 0.5 * g, p, grads), loss

    keys = jax.random.split(jax.random.key(0), 5)
    p = {"w1": jax.random.normal(keys[0], (8, 16)) * 0.3, "w2": jax.random.normal(keys[1], (16, 16)) * 0.3}
    p["w3"] = jax.random.normal(keys[2], (16, 1)) * 0.3
    batches = [
        {"x": jax.random.normal(keys[3 + i], (16, 8)), "y": jax.random.normal(keys[4 - i], (16, 1))}
        for i in range(2)
    ]
    par = assert_same_as_jit(step, p, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=2)
    kept = par.executable(p, batches[0]).deferred[0]
    assert not any(v.aval.shape == (16, 16) for v in kept.accumulators)


def test_a_weight_tied_across_stages_is_summed_per_stage_and_added_once_per_step():
    """A GPT whose logits decode with the token embedding, on two stages: the embedding's
    gradient adds the last stage's matmul to the first stage's scatter. Each stage keeps its
    own running sum, as partial sums, and the two are added once per step: nothing vocab-sized
    crosses stages or is all-reduced in a microbatch's task. Equal to jax.jit over 3 steps."""
    config = train.tiny_config("gpt", tie_embeddings=True)
    step, state = train.setup("gpt", "linen", config, OPTIMIZERS["adamw"]())
    batches = [train.make_batch("gpt", config, 64, seed=i) for i in range(3)]
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["adamw"], num_stages=2, num_microbatches=4, mesh_shape=(4,)
    )
    exe = par.executable(state, batches[0])
    vocab = (config.vocab_size, config.hidden)
    sent = [i for i in exe.program.instrs if isinstance(i, Transfer) and i.key[0].aval.shape == vocab]
    assert [(i.key[1], i.src, i.dst) for i in sent] == [(None, 1, 0)], sent  # the last stage's mean
    for stage in (0, 1):
        assert vocab in {v.aval.shape for v in exe.deferred[stage].accumulators}, stage
    shape = f"[{config.vocab_size},{config.hidden}]"
    found = [
        [c for repeated, cs in _task_collectives(e) if repeated for c in cs]
        for e in (exe, dataclasses.replace(exe, defer_reductions=False))
    ]
    assert not _weight_shaped(found[0], (shape,)), found[0]
    assert _weight_shaped(found[1], (shape,)), found[1]
    # The stage DP's costs price the logits' part as a gradient too, reduced once per step.
    problems = layer_sharding.LayerProblems(exe.step)
    last = partial_chains.graph_chains(problems.ops[-1], problems.carried, problems.loops)
    assert vocab in {c.total.aval.shape for c in last}


class _SharedBlock(nn.Module):
    """One dense layer applied four times (ALBERT-style sharing), then a head."""

    @nn.compact
    def __call__(self, x):
        shared = nn.Dense(64, name="shared")
        for _ in range(4):
            x = jnp.tanh(shared(x))
        return nn.Dense(16, name="head")(x)


def test_a_weight_shared_by_several_layers_of_each_stage_keeps_one_running_sum_per_stage():
    """Two applications of a shared layer in each of two data-parallel stages (ALBERT-style
    sharing): each stage adds its applications' gradients into one running sum of its own, kept
    as partial sums, and the two are added once per step. Equal to jax.jit."""
    state, batches = _classifier(_SharedBlock(), "adamw", (256, 64), 16, 3)
    par = assert_same_as_jit(
        _classifier_step,
        state,
        batches,
        TOLERANCES["adamw"],
        num_stages=2,
        num_microbatches=4,
        sharding="data",
    )
    exe = par.executable(state, batches[0])
    kernel = (64, 64)
    sums = [
        (t.stage, op)
        for t in exe.program.tasks
        if t.repeated
        for op in t.ops
        if op.kind == "acc" and op.mode == "add" and op.out[0].aval.shape == kernel
    ]
    # One op per stage and microbatch: the running sum plus the stage's two applications.
    assert sorted(s for s, _ in sums) == [0] * 4 + [1] * 4 and {len(op.ins) for _, op in sums} == {3}
    assert len({op.out[0] for _, op in sums}) == 2
    for stage in (0, 1):
        assert kernel in {v.aval.shape for v in exe.deferred[stage].accumulators}, stage
    per_microbatch = [c for repeated, cs in _task_collectives(exe) if repeated for c in cs]
    assert not _weight_shaped(per_microbatch, ("[64,64]",)), per_microbatch


def _strategy(comm, latency, summed):
    spec = ("data", None) if summed else (None, None)
    return sharding_ilp.Strategy(
        name="summed" if summed else "kept",
        compute_cost=0.0,
        communication_cost=comm,
        latency_cost=latency,
        memory_bytes=0.0,
        output_specs=((None, None),),
        input_specs=(spec, spec),
    )


@pytest.mark.parametrize(
    "runs, in_scan, want",
    [
        (1, False, 3.0),  # at the task's top level: XLA combines it with the other gradients'
        (1, True, 5.0),  # each scan iteration reduces its own slice: its own latency
        (4, False, 0.75),  # deferred: the bytes once per step, the latency shared
        (4, True, 0.75),  # the scan's stacked sums wait for the last microbatch too
    ],
)
def test_gradient_collectives_share_one_latency(runs, in_scan, want):
    """``priced_once`` takes a gradient's ring latency off wherever its collective runs with the
    others (the combined collective pays it once for all), and divides what is left by the
    microbatches its sum waits for."""
    root, total = object(), object()
    node = sharding_ilp.Node(name="root", strategies=(_strategy(5.0, 2.0, True), _strategy(0.0, 0.0, False)))
    chain = partial_chains.Chain(root, [], total, {total: 1 if in_scan else 0})
    (priced,), edges = deferred.priced_once([node], [], {root: (0, 0)}, [chain], {root: runs}, ("data",))
    summed, kept = priced.strategies
    assert summed.communication_cost == pytest.approx(want) and kept.communication_cost == 0
    assert edges == ()


def test_whole_batch_chains_are_the_one_microbatch_gradients():
    """With one microbatch there is no running sum: the chains that price the gradients end
    at the region's outputs, and the driver, which reads chains without them, defers nothing."""
    config = MLPConfig(features=(64,), in_features=64, num_classes=16)
    step, state = train.setup("mlp", "linen", config, OPTIMIZERS["sgd"]())
    batch = train.make_batch("mlp", config, 1024, seed=0)
    exe = autopar.autoparallel(step, num_stages=1, num_microbatches=1, mesh_shape=(8,)).executable(
        state, batch
    )
    assert not partial_chains.gradient_chains(exe.program.tasks, 0, lambda v: True)
    chains = partial_chains.gradient_chains(exe.program.tasks, 0, lambda v: True, whole_batch=True)
    shapes = sorted(c.total.aval.shape for c in chains)  # the region outputs: the gradients
    assert shapes == sorted(np.shape(p) for p in jax.tree.leaves(state.params))  # kernels and biases


def test_a_flat_mesh_keeps_a_small_gpt_data_parallel():
    """Priced one all-reduce per gradient, each with its own latency, data parallelism's 37
    gradients cost a tiny GPT more than splitting its weights over the 8 devices, and the ILP
    chose the split: 12 all-gathers, 6 all-reduces and an all-to-all per step, which ran 1.6x
    slower. XLA combines the gradients' all-reduces into one, and priced so the ILP keeps
    every parameter whole and the step's collectives to the gradients' all-reduce."""
    config = train.tiny_config("gpt")
    step, state = train.setup("gpt", "linen", config, OPTIMIZERS["sgd"]())
    batch = train.make_batch("gpt", config, 32)
    exe = autopar.autoparallel(step, num_stages=1, num_microbatches=1, mesh_shape=(8,)).executable(
        state, batch
    )
    specs = exe.shardings[0].specs
    batch_ids = set(exe.batch_leaf_ids)
    params = [v for i, v in enumerate(exe.step.arg_vars) if i not in batch_ids and v in specs]
    assert len(params) >= len(jax.tree.leaves(state.params))
    assert all(all(a is None for a in specs[v]) for v in params), [specs[v] for v in params]
    (task,) = _task_collectives(exe)
    assert {kind for kind, _ in task[1]} == {"all-reduce"}, task
