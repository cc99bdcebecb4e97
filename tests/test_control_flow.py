"""Steps with ``cond`` and ``while_loop``: in the model, in the optimizer (``optax.MultiSteps``)
and in the update, against ``jax.jit``; and how a once-per-step ``cond`` is split per stage."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from equality import OPTIMIZERS, TOLERANCES, assert_same_as_jit
from flax.training import train_state

import autopar
from autopar._src import compat, cond_split, strategies, trace
from autopar._src.expansion import expand_calls
from autopar._src.layout_costs import MeshSpec
from autopar._src.program import Transfer
from autopar._src.strategy_graph import GraphOp, Inner, Tie
from models import train


def _conds(jaxpr):
    return [e for e in jaxpr.eqns if e.primitive.name == "cond"]


def test_independent_results_of_a_cond_become_one_cond_each():
    def f(pred, a, b):
        def apply(a, b):
            s = jnp.float32(2.0) * 3.0  # scalar work, repeated in each group
            return a * s, jnp.tanh(b) * s

        return jax.lax.cond(pred, apply, lambda a, b: (a, b + 1.0), a, b)

    args = (True, jnp.arange(6.0).reshape(2, 3), jnp.ones((4,)))
    (eqn,) = _conds(jax.make_jaxpr(f)(*args).jaxpr)
    assert cond_split.output_groups([b for b, _ in compat.cond_branches(eqn)]) == [[0], [1]]
    step = trace.trace_step(f, args, trace.TraceOptions(num_layers=None))
    split = _conds(step.jaxpr)
    assert len(split) == 2
    # Each cond reads the index and only its own array.
    assert [[v.aval.shape for v in e.invars[1:]] for e in split] == [[(2, 3)], [(4,)]]
    for pred in (True, False):
        got = compat.eval_jaxpr(step.jaxpr, [v for _, v in step.const_bindings], pred, *args[1:])
        want = f(pred, *args[1:])
        for x, y in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_results_sharing_array_work_or_effects_keep_one_cond():
    def shared(pred, a, b):
        def scale(a, b):  # a global norm reads both arrays: one group
            n = jnp.sqrt(jnp.sum(a**2) + jnp.sum(b**2))
            return a / n, b / n

        return jax.lax.cond(pred, scale, lambda a, b: (a, b), a, b)

    def effect(pred, a, b):
        def show(a, b):
            jax.debug.print("{}", a.sum())
            return a, b

        return jax.lax.cond(pred, show, lambda a, b: (a, b), a, b)

    args = (True, jnp.ones((2, 3)), jnp.ones((4,)))
    for f in (shared, effect):
        (eqn,) = _conds(jax.make_jaxpr(f)(*args).jaxpr)
        assert cond_split.split_cond(eqn, [None] * len(eqn.invars)) is None
        assert len(_conds(trace.trace_step(f, args, trace.TraceOptions(num_layers=None)).jaxpr)) == 1


def test_an_elementwise_cond_may_take_any_layout_of_its_operands():
    mesh = MeshSpec(
        axis_names=("data", "model"),
        axis_sizes=(2, 4),
        bandwidth=(1e11, 2e11),
        latency=(2e-6, 1e-6),
        peak_flops=1e12,
        memory_bandwidth=1e12,
    )

    def moments(pred, m, g):  # one parameter's share of a MultiSteps-style update
        def apply(m, g):
            return 0.9 * m + 0.1 * g, jnp.zeros_like(g)

        return jax.lax.cond(pred, apply, lambda m, g: (m, g + m), m, g)

    def normalised(pred, m, g):
        return jax.lax.cond(pred, lambda m, g: (m / jnp.sum(m), g), lambda m, g: (m, g), m, g)

    args = (True, jnp.ones((8, 16)), jnp.ones((8, 16)))
    (eqn,) = _conds(jax.make_jaxpr(moments)(*args).jaxpr)
    specs = {s.output_specs for s in strategies.eqn_strategies(eqn, mesh)}
    assert ((None, None), (None, None)) in specs
    assert (("data", "model"), ("data", "model")) in specs
    for s in strategies.eqn_strategies(eqn, mesh):  # the index stays whole; operands follow
        assert s.input_specs[0] == () and s.input_specs[1:] == s.output_specs
    # A branch that reduces is not elementwise: the cond runs replicated.
    (eqn,) = _conds(jax.make_jaxpr(normalised)(*args).jaxpr)
    assert [s.name for s in strategies.eqn_strategies(eqn, mesh)] == ["replicated"]


def test_multisteps_accumulation_matches_jit_and_updates_stay_on_their_stages():
    # Wide enough that the ILP splits the weights, and their state, over "model" (below).
    config = dataclasses.replace(train.tiny_config("gpt"), hidden=256)
    tx = optax.MultiSteps(OPTIMIZERS["adamw"](), every_k_schedule=2)
    step, state = train.setup("gpt", "linen", config, tx)
    # Three steps: accumulate, apply the accumulated update, accumulate.
    batches = [train.make_batch("gpt", config, 16, seed=i) for i in range(3)]
    # Each stage's 4 devices as 2 x 2.
    options = dict(num_stages=2, num_microbatches=2, mesh_shape=(2, 2))
    par = assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], **options)
    exe = par.executable(state, batches[0])
    cond_ops = [
        (t.stage, op)
        for t in exe.program.tasks
        for op in t.ops
        if op.kind == "eqn" and op.eqn.primitive.name == "cond"
    ]
    assert {stage for stage, _ in cond_ops} == {0, 1}
    # The per-parameter updates follow the state's layouts instead of gathering it ...
    assert any(any(axis is not None for axis in exe.spec(op.outs[0], stage)) for stage, op in cond_ops)
    # ... and no array they read or write moves between stages.
    moved = {ins.key for ins in exe.program.instrs if isinstance(ins, Transfer)}
    arrays = {
        k for _, op in cond_ops for k in (*op.ins, *op.outs) if isinstance(k, tuple) and k[0].aval.shape
    }
    assert arrays and not arrays & moved


class _Gated(nn.Module):
    @nn.compact
    def __call__(self, x):
        gate = self.param("gate", lambda key: jnp.ones(()))
        h = jax.lax.cond(gate > 0, jax.nn.gelu, jnp.tanh, nn.Dense(32)(x))
        h = jax.lax.cond(gate < 0, lambda a: a * gate, lambda a: a - gate, nn.Dense(32)(h))
        return nn.Dense(10)(nn.relu(nn.Dense(64)(h)))


class _Branchy(nn.Module):  # a cond whose branches hold matmuls
    width: int = 64

    @nn.compact
    def __call__(self, x):
        gate = self.param("gate", lambda key: jnp.ones(()))
        w = self.param("w", nn.initializers.lecun_normal(), (32, self.width))
        v = self.param("v", nn.initializers.lecun_normal(), (32, self.width))
        h = nn.Dense(32)(x)
        h = jax.lax.cond(gate > 0, lambda a: jax.nn.gelu(a @ w), lambda a: jnp.tanh(a @ v), h)
        return nn.Dense(10)(h)


def test_cond_branches_expand_into_their_equations_tied_to_the_results():
    def f(pred, a, w):
        return jax.lax.cond(pred, lambda a, w: jnp.tanh(a @ w), lambda a, w: (a * 2.0) @ w, a, w)

    (eqn,) = _conds(jax.make_jaxpr(f)(True, jnp.ones((8, 4)), jnp.ones((4, 6))).jaxpr)
    alias, ties = {}, []
    ops = expand_calls(GraphOp(eqn, ("p", "a", "w"), ("out",)), alias, ties)
    branches = [b for b, _ in compat.cond_branches(eqn)]
    assert [op.eqn for op in ops] == [e for b in branches for e in b.eqns]
    assert {n for op in ops for n in op.ins if n in ("a", "w")} == {"a", "w"}  # the operands, not the index
    assert alias["out"] == ops[1].outs[0] and ties == [
        Tie(out=ops[-1].outs[0], into=ops[1].outs[0], weight=1)
    ]


def test_cond_branches_are_laid_out_inside_and_match_jit():
    # Large enough that splitting the branches' work pays for its collectives (a tiny cond is
    # cheapest replicated).
    model = _Branchy(width=256)
    params = model.init(jax.random.key(1), jnp.ones((256, 16)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    options = dict(num_stages=1, num_microbatches=2, mesh_shape=(2, 4))
    batches = _batches(rows=256)
    par = assert_same_as_jit(_mlp_step(), state, batches, TOLERANCES["sgd"], **options)
    exe = par.executable(state, batches[0])
    # The forward's cond and its backward's (the transposed branches) are laid out inside.
    conds = {
        id(op.eqn)
        for t in exe.program.tasks
        for op in t.ops
        if op.kind == "eqn" and op.eqn.primitive.name == "cond"
    }
    inside = [
        spec for k, spec in exe.shardings[0].specs.items() if isinstance(k, Inner) and set(k.path) & conds
    ]
    assert any(axis is not None for spec in inside for axis in spec)


def _mlp_step(post=lambda grads: grads):
    def step(state, batch):
        def loss_fn(p):
            logits = state.apply_fn({"params": p}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=post(grads)), loss

    return step


def _batches(n=3, rows=16):
    keys = jax.random.split(jax.random.key(7), n)
    return [
        {"x": jax.random.normal(k, (rows, 16)), "y": (jnp.arange(rows) + i) % 10} for i, k in enumerate(keys)
    ]


@pytest.mark.parametrize("sharding", ["data", "auto"])
def test_cond_in_the_model_matches_jit(sharding):
    model = _Gated()
    params = model.init(jax.random.key(1), jnp.ones((16, 16)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    options = dict(num_stages=2, num_microbatches=2, sharding=sharding)
    assert_same_as_jit(_mlp_step(), state, _batches(), TOLERANCES["sgd"], **options)


def test_while_loop_in_the_update_matches_jit():
    def halve_until_small(grads):  # a data-dependent trip count
        def body(carry):
            g = jax.tree.map(lambda x: x / 2, carry[0])
            return g, optax.tree.norm(g)

        return jax.lax.while_loop(lambda c: c[1] > 0.05, body, (grads, optax.tree.norm(grads)))[0]

    model = _Gated()
    params = model.init(jax.random.key(1), jnp.ones((16, 16)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.5))
    step = _mlp_step(halve_until_small)
    # The loop runs: the first gradient's norm is above the threshold.
    grads = jax.grad(lambda p: step(state.replace(params=p), _batches(1)[0])[1])(params)
    assert optax.tree.norm(grads) > 0.1
    par = assert_same_as_jit(step, state, _batches(), TOLERANCES["sgd"], num_stages=2, num_microbatches=2)
    # The loop body is laid out inside: the ILP chose a layout for each of its values (here
    # all replicated, as the data-parallel stages hold the gradients whole) and the driver
    # pinned them in the re-traced body.
    exe = par.executable(state, _batches(1)[0])
    [(stage, loop)] = {
        (t.stage, op.eqn)
        for t in exe.program.tasks
        for op in t.ops
        if op.kind == "eqn" and op.eqn.primitive.name == "while"
    }
    chosen = exe.shardings[stage]
    inside = [k for k in chosen.specs if isinstance(k, Inner) and id(loop) in k.path]
    assert inside and all(k in chosen.pinned for k in inside)


def test_while_body_expands_into_its_equations_with_carries_tied():
    def f(a, w):
        return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (a, 0))

    (eqn,) = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((4, 4))).jaxpr.eqns
    alias, ties = {}, []
    body, skip = compat.while_body(eqn)
    assert skip == 0  # no predicate constants: the operands are the body's (w) and the carries
    ops = expand_calls(GraphOp(eqn, ("w", "a", "i"), ("out", "n")), alias, ties)
    assert [op.eqn for op in ops] == list(body.eqns)
    assert {t.into for t in ties} == {"a", "i"} and alias["out"] == ops[1].outs[0]


def test_a_layer_stack_whose_body_calls_back_to_python_equals_jit():
    """An equation without outputs (``jax.debug.callback``) inside a scan body, whose values
    run pinned: bound as it is."""
    seen = []

    def step(ws, batch):
        def loss_fn(ws):
            def body(x, w):
                jax.debug.callback(lambda a: seen.append(float(a)), x[0, 0])
                return jnp.tanh(x @ w), None

            x, _ = jax.lax.scan(body, batch["x"], ws["stack"])
            return jnp.mean((x @ ws["head"] - batch["y"]) ** 2)

        loss, grads = autopar.value_and_grad(loss_fn)(ws)
        return jax.tree.map(lambda w, g: w - 0.1 * g, ws, grads), loss

    keys = jax.random.split(jax.random.key(0), 2)
    ws = {"stack": jax.random.normal(keys[0], (3, 8, 8)) * 0.3, "head": jax.random.normal(keys[1], (8, 1))}
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.normal(size=(16, 1)).astype(np.float32)}
        for _ in range(2)
    ]
    assert_same_as_jit(
        step, ws, batches, TOLERANCES["sgd"], num_stages=1, num_microbatches=1, mesh_shape=(2, 4)
    )
    assert seen  # the callback ran


class _RecurrentLM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(16, 16)(ids)
        for i in range(2):
            x = nn.RNN(nn.OptimizedLSTMCell(16), name=f"lstm{i}")(x)
        return nn.Dense(16)(x)


def test_multisteps_on_one_stage_with_many_parameters_laid_out_anew_between_steps_equals_jit():
    """The parameters and the accumulated gradients come back from a step in the per-parameter
    updates' layouts and are laid out anew for the next step, by one all-gather each. On the CPU
    (jaxlib 0.10) such relayouts dispatched one behind another could wait forever for a device
    that ran them in another order (the process aborted); each now finishes before the next."""
    model = _RecurrentLM()
    rng = np.random.default_rng(0)
    batches = [{"ids": jnp.asarray(rng.integers(1, 16, (8, 10)))} for _ in range(3)]
    tx = optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), OPTIMIZERS["adamw"]()), every_k_schedule=2
    )
    params = model.init(jax.random.key(0), batches[0]["ids"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step(state, batch):
        x, y = batch["ids"][:, :-1], batch["ids"][:, 1:]

        def loss_fn(p):
            logits = state.apply_fn({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], num_stages=1, num_microbatches=1)
