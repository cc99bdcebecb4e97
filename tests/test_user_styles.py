"""Models written the way users write them, not the way ``models/`` does.

- A rematerialised ``nn.scan`` stack of blocks with a nested-``jit`` attention, a ``custom_jvp``
  activation, and a top-1 mixture of experts that gathers each token's expert weights by index
  (its weight gradient a scatter-add) and sows a load-balancing value; a convolution stem with
  BatchNorm on a side input; dropout keyed from the state; an optax chain with clipping and a
  schedule.
- A decoder with ``jax.nn.dot_product_attention``, multi-axis ``DenseGeneral``, RMSNorm, a gated
  MLP and an embedding tied to the output (``Embed.attend``); a step that scales the loss and
  keeps the scale in its state, skips non-finite updates (``optax.apply_if_finite``), decays a
  masked subset of the weights, and keeps an exponential moving average of the parameters.
- A dropless mixture of experts in MaxText's style: tokens sorted by expert, counted with
  ``bincount`` and multiplied by their experts' weights with ``lax.ragged_dot``; and a student
  distilled from a frozen one, its forward inside the loss function under ``stop_gradient``.
- An NNX step written for ``nnx.jit``: it updates the model, its optimizer and its metrics in
  place and returns the loss; and one that trains only the ``nnx.LoRA`` adapters of frozen
  layers (``nnx.DiffState(0, nnx.LoRAParam)``).
- Sharpness-aware minimization: a gradient at weights moved along another gradient.
- An NNX model: convolutions with BatchNorm and dropout in an ``nnx.List``, multi-head
  attention over the pixels, a forward-call counter in an ``nnx.Variable``; a functional step
  over the split model and its ``nnx.Optimizer``.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from equality import TOLERANCES, as_numpy, assert_same_as_jit, classifier_step, nnx_classifier
from flax import nnx
from flax.training import train_state

import autopar
from autopar._src import intra_op

D, VOCAB, TOKENS, EXPERTS = 32, 64, 16, 4


@jax.custom_jvp
def mish(x):
    return x * jnp.tanh(jax.nn.softplus(x))


@mish.defjvp
def _mish_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    th = jnp.tanh(jax.nn.softplus(x))
    return mish(x), dx * (th + x * (1 - th**2) * jax.nn.sigmoid(x))


@functools.partial(jax.jit, static_argnames="heads")
def causal_attention(q, k, v, heads):
    b, t, d = q.shape

    def split(z):
        return z.reshape(b, t, heads, d // heads)

    w = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / jnp.sqrt(d // heads)
    w = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), w, -1e9), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", w, split(v)).reshape(b, t, d)


class GatheredExperts(nn.Module):
    @nn.compact
    def __call__(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        probs = jax.nn.softmax(nn.Dense(EXPERTS, use_bias=False)(tokens))
        expert = jnp.argmax(probs, -1)
        gate = jnp.take_along_axis(probs, expert[:, None], axis=1)[:, 0]
        w_in = self.param("w_in", nn.initializers.normal(0.02), (EXPERTS, D, 2 * D))
        w_out = self.param("w_out", nn.initializers.normal(0.02), (EXPERTS, 2 * D, D))
        h = mish(jnp.einsum("nd,ndf->nf", tokens, w_in[expert]))
        out = jnp.einsum("nf,nfd->nd", h, w_out[expert]) * gate[:, None]
        load = jnp.zeros(EXPERTS).at[expert].add(1.0) / tokens.shape[0]
        self.sow("intermediates", "balance", EXPERTS * jnp.sum(load * probs.mean(0)))
        return out.reshape(x.shape)


class Block(nn.Module):
    deterministic: bool

    @nn.compact
    def __call__(self, x, _):
        q, k, v = jnp.split(nn.Dense(3 * D)(nn.LayerNorm()(x)), 3, axis=-1)
        h = nn.Dense(D)(causal_attention(q, k, v, heads=2))
        x = x + nn.Dropout(0.1, deterministic=self.deterministic)(h)
        return x + GatheredExperts()(nn.LayerNorm()(x)), None


class Net(nn.Module):
    per_microbatch_exact: bool  # no BatchNorm or sown aux: equal to jit with microbatches

    @nn.compact
    def __call__(self, ids, image):
        y = nn.Conv(8, (3, 3), use_bias=False)(image)
        y = nn.LayerNorm()(y) if self.per_microbatch_exact else nn.BatchNorm(use_running_average=False)(y)
        x = nn.Embed(VOCAB, D)(ids) + nn.Dense(D)(jax.nn.relu(y).mean((1, 2)))[:, None, :]
        stack = nn.scan(
            nn.remat(Block),
            variable_axes={"params": 0, "intermediates": 0},
            split_rngs={"params": True, "dropout": True},
            length=4,
        )
        x, _ = stack(deterministic=False)(x, None)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class State(train_state.TrainState):
    batch_stats: dict
    key: jax.Array


def _setup(exact: bool):
    net = Net(per_microbatch_exact=exact)
    variables = net.init(
        {"params": jax.random.key(0), "dropout": jax.random.key(1)},
        jnp.zeros((8, TOKENS), jnp.int32),
        jnp.zeros((8, 8, 8, 3)),
    )
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10), eps=1e-5)
    )
    state = State.create(
        apply_fn=net.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables.get("batch_stats", {}),
        key=jax.random.key(2),
    )

    def step(state, batch):
        key, dropout_key = jax.random.split(state.key)

        def loss_fn(params):
            logits, updated = net.apply(
                {"params": params, "batch_stats": state.batch_stats},
                batch["ids"],
                batch["image"],
                rngs={"dropout": dropout_key},
                mutable=["batch_stats", "intermediates"],
            )
            nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["labels"][..., None], -1).mean()
            if exact:
                return nll, updated.get("batch_stats", state.batch_stats)
            balance = jnp.mean(jax.tree.leaves(updated["intermediates"])[0])
            return nll * (1 + 0.01 * jax.lax.stop_gradient(balance)), updated["batch_stats"]

        (loss, batch_stats), grads = autopar.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads).replace(batch_stats=batch_stats, key=key), loss

    rng = np.random.default_rng(0)
    batches = [
        {
            "ids": rng.integers(0, VOCAB, (8, TOKENS)).astype(np.int32),
            "image": rng.normal(size=(8, 8, 8, 3)).astype(np.float32),
            "labels": rng.integers(0, VOCAB, (8, TOKENS)).astype(np.int32),
        }
        for _ in range(3)
    ]
    return step, state, batches


def test_batchnorm_dropout_and_gathered_experts_in_a_scanned_remat_stack_equal_jit_over_stages():
    step, state, batches = _setup(exact=False)
    par = assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], num_stages=2, num_microbatches=1)
    assert len(par.plan(state, batches[0]).stages) == 2


def test_dropout_and_gathered_experts_in_a_scanned_remat_stack_equal_jit_over_microbatches():
    # Each microbatch's dropout masks, drawn inside the rematerialised scan's body, are its rows
    # of the whole batch's.
    step, state, batches = _setup(exact=True)
    par = assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], num_stages=2, num_microbatches=4)
    plan = par.plan(state, batches[0])
    assert len(plan.stages) == 2 and plan.num_microbatches == 4


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(VOCAB, D)
        x = embed(ids)
        for _ in range(4):
            qkv = nn.DenseGeneral((3, 2, D // 2))(nn.RMSNorm()(x))
            a = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
            x = x + nn.DenseGeneral(D, axis=(-2, -1))(a)
            h = nn.RMSNorm()(x)
            x = x + nn.Dense(D)(jax.nn.silu(nn.Dense(2 * D)(h)) * nn.Dense(2 * D)(h))
        return embed.attend(nn.RMSNorm()(x))


def test_a_tied_decoder_with_loss_scaling_skipped_updates_masked_decay_and_an_average_equals_jit():
    net = Decoder()
    params = net.init(jax.random.key(0), jnp.zeros((8, TOKENS), jnp.int32))["params"]
    decayed = jax.tree.map(lambda p: p.ndim > 1, params)
    tx = optax.apply_if_finite(
        optax.chain(optax.clip_by_global_norm(1.0), optax.add_decayed_weights(1e-2, decayed), optax.sgd(0.1)),
        3,
    )
    state = {"params": params, "opt": tx.init(params), "average": params, "scale": jnp.float32(2.0**10)}

    def step(state, batch):
        def loss_fn(params):
            labels = optax.smooth_labels(jax.nn.one_hot(batch["labels"], VOCAB), 0.1)
            logits = net.apply({"params": params}, batch["ids"])
            return optax.softmax_cross_entropy(logits, labels).mean() * state["scale"]

        scaled, grads = autopar.value_and_grad(loss_fn)(state["params"])
        grads = jax.tree.map(lambda g: g / state["scale"], grads)
        finite = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        average = jax.tree.map(lambda a, p: 0.9 * a + 0.1 * p, state["average"], params)
        scale = jnp.where(finite, jnp.minimum(2 * state["scale"], 2.0**15), state["scale"] / 2)
        return {"params": params, "opt": opt, "average": average, "scale": scale}, scaled / state["scale"]

    rng = np.random.default_rng(1)
    batches = [
        {name: rng.integers(0, VOCAB, (8, TOKENS)).astype(np.int32) for name in ("ids", "labels")}
        for _ in range(3)
    ]
    par = assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=4, num_microbatches=4)
    assert len(par.plan(state, batches[0]).stages) == 4


class ConvNorm(nnx.Module):
    def __init__(self, cin: int, cout: int, rngs: nnx.Rngs, exact: bool):
        self.conv = nnx.Conv(cin, cout, (3, 3), use_bias=False, rngs=rngs)
        self.norm = nnx.LayerNorm(cout, rngs=rngs) if exact else nnx.BatchNorm(cout, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x):
        return self.drop(nnx.gelu(self.norm(self.conv(x))))


class PixelAttention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, exact: bool):
        self.stem = nnx.List([ConvNorm(3, 16, rngs, exact), ConvNorm(16, 16, rngs, exact)])
        # Without biases: a key bias has no gradient (softmax ignores a shift), so Adam would
        # turn rounding noise into updates.
        self.attention = nnx.MultiHeadAttention(
            num_heads=2, in_features=16, qkv_features=16, use_bias=False, decode=False, rngs=rngs
        )
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, 10, rngs=rngs)
        self.calls = nnx.Variable(jnp.int32(0))

    def __call__(self, x):
        for block in self.stem:
            x = block(x)
        tokens = x.reshape(x.shape[0], -1, x.shape[-1])
        tokens = tokens + self.attention(self.norm(tokens), deterministic=True)
        self.calls[...] += 1
        return self.head(tokens.mean(1))


@pytest.mark.parametrize(("exact", "num_microbatches"), [(False, 1), (True, 4)])
def test_an_nnx_model_with_batchnorm_dropout_and_a_counter_equals_jit(exact, num_microbatches):
    step, state = nnx_classifier(PixelAttention(nnx.Rngs(0, dropout=1), exact), optax.adamw(1e-2, eps=1e-5))
    rng = np.random.default_rng(2)
    batches = [
        {"x": rng.normal(size=(8, 8, 8, 3)).astype(np.float32), "y": rng.integers(0, 10, 8).astype(np.int32)}
        for _ in range(3)
    ]
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["adamw"], num_stages=2, num_microbatches=num_microbatches
    )
    assert len(par.plan(state, batches[0]).stages) == 2


class DroplessExperts(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        probs = jax.nn.softmax(nn.Dense(EXPERTS, use_bias=False)(tokens))
        expert = jnp.argmax(probs, -1)
        order = jnp.argsort(expert)
        sizes = jnp.bincount(expert, length=EXPERTS).astype(jnp.int32)
        w_in = self.param("w_in", nn.initializers.normal(0.02), (EXPERTS, x.shape[-1], self.hidden))
        w_out = self.param("w_out", nn.initializers.normal(0.02), (EXPERTS, self.hidden, x.shape[-1]))
        h = jax.nn.gelu(jax.lax.ragged_dot(tokens[order], w_in, sizes))
        out = jnp.zeros_like(tokens).at[order].set(jax.lax.ragged_dot(h, w_out, sizes))
        return (out * jnp.take_along_axis(probs, expert[:, None], 1)).reshape(x.shape)


class DroplessLM(nn.Module):
    hidden: int
    layers: int

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, D)(ids)
        for _ in range(self.layers):
            x = x + DroplessExperts(self.hidden)(nn.LayerNorm()(x))
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def _dropless(hidden: int, layers: int, batch: int):
    net = DroplessLM(hidden, layers)
    params = net.init(jax.random.key(0), jnp.zeros((batch, TOKENS), jnp.int32))["params"]
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.sgd(0.1))
    step = classifier_step("ids", "labels")
    rng = np.random.default_rng(3)
    batches = [
        {name: rng.integers(0, VOCAB, (batch, TOKENS)).astype(np.int32) for name in ("ids", "labels")}
        for _ in range(3)
    ]
    return step, state, batches


def test_a_dropless_mixture_of_experts_equals_jit_over_stages_and_microbatches():
    """The experts' group sizes are counts over the microbatch's tokens, but they place rows
    rather than scale them: the loss is still a mean (it was once refused as "proportional to
    the batch size to the power 16")."""
    step, state, batches = _dropless(hidden=2 * D, layers=4, batch=8)
    par = assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=2)
    assert len(par.plan(state, batches[0]).stages) == 2


class Distilled(train_state.TrainState):
    teacher: dict


def _distillation(teacher_inside: bool):
    """A dense student fitted to the labels and to a frozen dropless teacher's logits (at
    temperature 2). The teacher's group sizes count tokens of the batch alone (its router is not
    trained): each microbatch's own still places its own sorted rows."""
    teacher, student = (
        DroplessLM(2 * D, 2),
        nn.Sequential([nn.Embed(VOCAB, D), nn.Dense(D), nn.gelu, nn.Dense(VOCAB)]),
    )
    ids = jnp.zeros((8, TOKENS), jnp.int32)
    state = Distilled.create(
        apply_fn=student.apply,
        params=student.init(jax.random.key(0), ids)["params"],
        tx=optax.adamw(1e-2, eps=1e-5),
        teacher=teacher.init(jax.random.key(1), ids)["params"],
    )

    def step(state, batch):
        def teacher_logits():
            return teacher.apply({"params": state.teacher}, batch["ids"])

        ahead = None if teacher_inside else teacher_logits()

        def loss_fn(p):
            target = jax.lax.stop_gradient(teacher_logits()) if teacher_inside else ahead
            logits = student.apply({"params": p}, batch["ids"])
            soft = optax.kl_divergence(jax.nn.log_softmax(logits / 2), jax.nn.softmax(target / 2))
            return (
                4 * soft.mean()
                + optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
            )

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    rng = np.random.default_rng(4)
    batches = [
        {name: rng.integers(0, VOCAB, (8, TOKENS)).astype(np.int32) for name in ("ids", "labels")}
        for _ in range(3)
    ]
    return step, state, batches


def test_a_student_distilled_from_a_frozen_dropless_teacher_inside_the_loss_equals_jit():
    step, state, batches = _distillation(teacher_inside=True)
    assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], num_stages=2, num_microbatches=2)


def test_a_frozen_dropless_teacher_before_the_gradient_is_an_error_naming_the_loss_function():
    """Before the gradient its sort by expert is not followed back to the batch's order."""
    step, state, batches = _distillation(teacher_inside=False)
    with pytest.raises(
        ValueError, match=r"(?s)combines examples.*sort.*inside the loss function under jax.lax"
    ):
        autopar.autoparallel(step, num_stages=2, num_microbatches=2)(state, batches[0])


def test_a_dropless_mixture_of_experts_splits_its_experts_weights_as_megatron_does():
    """On one (1, 8) stage, with a small batch and wide experts, the ILP lays the grouped
    matmuls out as Megatron's MLP: the first splits its experts' columns, the second their rows
    (partial sums, all-reduced); the ragged rows stay whole. Replicated, every device would
    multiply every token by every weight."""
    step, state, batches = _dropless(hidden=1024, layers=1, batch=2)
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["sgd"], num_stages=1, num_microbatches=1, mesh_shape=(1, 8)
    )
    exe = par.executable(state, batches[0])
    chosen = exe.shardings[0]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    specs = {p: chosen.specs.get(v) for p, v in zip(paths, exe.step.arg_vars, strict=False)}
    assert specs[".params['DroplessExperts_0']['w_in']"] == (None, None, "model")
    assert specs[".params['DroplessExperts_0']['w_out']"] == (None, "model", None)
    ops = [
        op for op in intra_op.stage_ops(exe.program, 0)[0] if op.eqn.primitive.name == "ragged_dot_general"
    ]
    assert len(ops) == 6  # forward, and the gradients of the rows and of the weights
    assert all(chosen.strategies[op.outs[0]] != "replicated" for op in ops)


class _Generator(nn.Module):
    @nn.compact
    def __call__(self, z):
        return nn.Dense(4)(jnp.tanh(nn.Dense(D)(z)))


class Regressor(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = jnp.tanh(nn.Dense(D)(x))
        return nn.Dense(1)(x)[:, 0]


@pytest.mark.parametrize("first", ["autopar", "jax", "jax-sum"])
def test_sharpness_aware_minimization_pipelines_its_second_gradient(first):
    """SAM's step takes two gradients, the second at weights moved along the first. autopar
    pipelines one: two are an error naming the way out, which is to take the first with
    ``jax.grad``; it then runs outside the pipeline, once per step on the whole batch, and every
    microbatch differentiates at the moved weights: equal to ``jax.jit``. Moved by a step
    proportional to the gradient of a sum over the examples (a figure each microbatch would take
    its share of), it is an error with microbatches."""
    net = Regressor()
    params = net.init(jax.random.key(0), jnp.ones((8, 4)))["params"]

    def mse(params, batch):
        return jnp.mean((net.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    def total(params, batch):
        return jnp.sum((net.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    def step(params, batch):
        ascent = {"autopar": autopar.grad(mse), "jax": jax.grad(mse), "jax-sum": jax.grad(total)}[first](
            params, batch
        )
        scale = 0.05 / jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(ascent)))
        if first == "jax-sum":  # not normalised: the moved weights scale with the batch
            scale = 1e-3
        moved = jax.tree.map(lambda p, g: p + scale * g, params, ascent)
        loss, grads = autopar.value_and_grad(lambda p: mse(p, batch))(moved)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    rng = np.random.default_rng(4)
    batches = [
        {"x": rng.normal(size=(16, 4)).astype(np.float32), "y": rng.normal(size=16).astype(np.float32)}
        for _ in range(3)
    ]
    if first == "autopar":
        with pytest.raises(ValueError, match=r"2 times.*sharpness-aware.*jax\.grad"):
            autopar.autoparallel(step, num_stages=2)(params, batches[0])
        return
    if first == "jax-sum":
        with pytest.raises(ValueError, match=r"code before the gradient combines examples.*sharpness-aware"):
            autopar.autoparallel(step, num_stages=2, num_microbatches=4)(params, batches[0])
        return
    par = assert_same_as_jit(step, params, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=4)
    assert len(par.plan(params, batches[0]).stages) == 2


@pytest.mark.parametrize("initialise", ["cond", "where"])
def test_a_data_dependent_initialisation_of_differentiated_weights_equals_jit_over_microbatches(initialise):
    """Glow's actnorm sets its bias and log-scale from the first batch's mean and deviation
    (under a ``cond`` on an initialised flag, or a ``jnp.where``) before they are differentiated:
    made once per step from the whole batch, as ``jax.jit`` makes them."""

    def step(state, batch):
        x = batch["x"]

        def ddi(p):
            return {"b": -x.mean(0), "logs": -jnp.log(x.std(0)), "w": p["w"]}

        if initialise == "cond":
            p = jax.lax.cond(state["init"], lambda p: p, ddi, state["p"])
        else:
            p = jax.tree.map(lambda a, b: jnp.where(state["init"], a, b), state["p"], ddi(state["p"]))

        def loss_fn(p):
            return jnp.mean(jnp.tanh(((x + p["b"]) * jnp.exp(p["logs"])) @ p["w"]) ** 2)

        loss, g = autopar.value_and_grad(loss_fn)(p)
        return {"p": jax.tree.map(lambda a, b: a - 0.1 * b, p, g), "init": jnp.array(True)}, loss

    state = {
        "p": {"b": jnp.zeros(4), "logs": jnp.zeros(4), "w": jnp.ones((4, 2)) * 0.5},
        "init": jnp.array(False),
    }
    batches = [{"x": jax.random.normal(jax.random.key(i), (16, 4)) * 3 + 1} for i in range(3)]
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=1, num_microbatches=4)


def test_a_gradient_taken_with_jax_grad_before_the_pipelined_one_equals_jit_over_microbatches():
    """A GAN's discriminator step by ``jax.grad`` on the batch and the parameters alone, before the
    generator's pipelined gradient reads the new discriminator: made once per step at the whole
    batch, its mean's ``1 / n`` included (the discriminator returned is ``jax.jit``'s, not
    stepped by the sum of the microbatches' gradients)."""

    def step(state, batch):
        x, z = batch["x"], batch["z"]

        def d_loss(d):
            real, fake = x @ d["w"] + d["b"], (z @ state["g"]) @ d["w"] + d["b"]
            return jnp.mean(jax.nn.softplus(-real)) + jnp.mean(jax.nn.softplus(fake))

        d_new = jax.tree.map(lambda p, g: p - 0.1 * g, state["d"], jax.grad(d_loss)(state["d"]))
        loss, g = autopar.value_and_grad(
            lambda w: jnp.mean(jax.nn.softplus(-((z @ w) @ d_new["w"] + d_new["b"])))
        )(state["g"])
        return {"g": state["g"] - 0.1 * g, "d": d_new}, loss

    keys = jax.random.split(jax.random.key(0), 5)
    state = {
        "g": jax.random.normal(keys[0], (4, 8)),
        "d": {"w": jax.random.normal(keys[1], (8, 1)), "b": jnp.zeros((1,))},
    }
    batches = [
        {"x": jax.random.normal(k, (16, 8)), "z": jax.random.normal(jax.random.fold_in(k, 1), (16, 4))}
        for k in keys[2:]
    ]
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=1, num_microbatches=4)


def test_a_discriminator_step_by_jax_grad_with_its_metrics_returned_equals_jit_over_stages():
    """A Flax GAN: the discriminator's Adam step by ``jax.grad`` before the generator's pipelined
    gradient, its loss and mean scores returned as metrics. What only the step's outputs read
    runs again at the whole batch (not per microbatch); the new discriminator weights, made from
    the batch and the state alone, are made once per step, on the stage that reads them."""
    gen, disc = _Generator(), Regressor()
    keys = jax.random.split(jax.random.key(0), 8)
    g = gen.init(keys[0], jnp.ones((1, 2)))["params"]
    d = disc.init(keys[1], jnp.ones((1, 4)))["params"]
    tx = optax.adam(1e-2)
    state = {"g": g, "d": d, "opt": tx.init(d)}

    def step(state, batch):
        def d_loss(d):
            real = disc.apply({"params": d}, batch["x"])
            fake = disc.apply({"params": d}, gen.apply({"params": state["g"]}, batch["z"]))
            loss = jnp.mean(jax.nn.softplus(-real)) + jnp.mean(jax.nn.softplus(fake))
            return loss, (jax.nn.sigmoid(real).mean(), jax.nn.sigmoid(fake).mean())

        (d_loss_value, (d_real, d_fake)), grads = jax.value_and_grad(d_loss, has_aux=True)(state["d"])
        updates, opt = tx.update(grads, state["opt"], state["d"])
        d_new = optax.apply_updates(state["d"], updates)

        def g_loss(g):
            return jnp.mean(
                jax.nn.softplus(-disc.apply({"params": d_new}, gen.apply({"params": g}, batch["z"])))
            )

        loss, grads = autopar.value_and_grad(g_loss)(state["g"])
        new = {"g": jax.tree.map(lambda p, q: p - 0.1 * q, state["g"], grads), "d": d_new, "opt": opt}
        return new, (loss, {"d_loss": d_loss_value, "d_real": d_real, "d_fake": d_fake})

    batches = [
        {"x": jax.random.normal(k, (16, 4)) + 1.0, "z": jax.random.normal(jax.random.fold_in(k, 1), (16, 2))}
        for k in keys[2:5]
    ]
    par = autopar.autoparallel(step, num_stages=2, num_microbatches=4)
    mine = theirs = state
    for batch in batches:
        (mine, out), (theirs, expected) = par(mine, batch), jax.jit(step)(theirs, batch)
        for a, b in zip(jax.tree.leaves((mine, out)), jax.tree.leaves((theirs, expected)), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCES["adamw"])


def test_a_running_mean_of_the_batch_kept_in_the_state_equals_jit_over_stages():
    """PopArt's running moments of the returns: the state's mean moved by the batch's before the
    gradient, read by the last stage's loss beside inputs standardised by their batch mean on the
    first. Made once per step from the whole batch after the state's share on its stage."""

    def step(state, batch):
        ret = batch["ret"]
        mu = 0.9 * state["mu"] + 0.1 * ret.mean()
        nu = 0.9 * state["nu"] + 0.1 * (ret**2).mean()
        sigma = jnp.sqrt(jnp.maximum(nu - mu**2, 1e-4))

        def loss_fn(p):
            x = (batch["obs"] - batch["obs"].mean(0)) / (batch["obs"].std(0) + 1e-6)
            v = (jnp.tanh(x @ p["w1"]) @ p["w2"])[:, 0]
            return jnp.mean((v - (ret - mu) / sigma) ** 2)

        loss, grads = autopar.value_and_grad(loss_fn)({"w1": state["w1"], "w2": state["w2"]})
        new = {k: state[k] - 0.05 * grads[k] for k in grads}
        return {**new, "mu": mu, "nu": nu}, loss

    keys = jax.random.split(jax.random.key(0), 6)
    state = {
        "w1": jax.random.normal(keys[0], (6, 32)) * 0.3,
        "w2": jax.random.normal(keys[1], (32, 1)) * 0.3,
        "mu": jnp.float32(0.0),
        "nu": jnp.float32(1.0),
    }
    batches = [
        {
            "obs": 2 + jax.random.normal(k, (16, 6)),
            "ret": 5 + 3 * jax.random.normal(jax.random.fold_in(k, 1), (16,)),
        }
        for k in keys[2:5]
    ]
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=4)


def test_lbfgs_evaluating_the_loss_again_in_its_update_equals_jit_over_microbatches():
    """``optax.lbfgs``'s line search calls the loss function again, on the batch, after the
    gradient: that runs once per step at the whole batch, while the gradient is pipelined."""
    net = Regressor()
    params = net.init(jax.random.key(0), jnp.ones((8, 4)))["params"]
    opt = optax.lbfgs()

    def mse(params, batch):
        return jnp.mean((net.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    def step(params, opt_state, batch):
        loss, grads = autopar.value_and_grad(mse)(params, batch)
        updates, opt_state = opt.update(
            grads, opt_state, params, value=loss, grad=grads, value_fn=lambda p: mse(p, batch)
        )
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(4)
    batches = [
        {"x": rng.normal(size=(16, 4)).astype(np.float32), "y": rng.normal(size=16).astype(np.float32)}
        for _ in range(3)
    ]
    par = autopar.autoparallel(step, num_stages=2, num_microbatches=4, batch_argnums=2)
    mine = theirs = (params, opt.init(params))
    for batch in batches:
        *mine, loss = par(*mine, batch)
        *theirs, loss_ref = jax.jit(step)(*theirs, batch)
        np.testing.assert_allclose(np.asarray(loss), np.asarray(loss_ref), **TOLERANCES["sgd"])
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["sgd"])
    plan = par.plan(*mine, batches[0])
    assert len(plan.stages) == 2 and plan.num_microbatches == 4


class GraphNet(nnx.Module):
    """With ``exact``: no BatchNorm, so equal to ``nnx.jit`` with microbatches."""

    def __init__(self, rngs: nnx.Rngs, exact: bool):
        # No bias before BatchNorm: its gradient is rounding noise, which Adam would amplify.
        self.l1 = nnx.Linear(8, 32, use_bias=False, rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs) if exact else nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(32, 32, rngs=rngs)
        self.l3 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        h = self.drop(nnx.relu(self.norm(self.l1(x))))
        return self.l3(nnx.relu(self.l2(h)))


def nnx_train_step(model, optimizer, metrics, batch):
    def loss_fn(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits

    (loss, logits), grads = autopar.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    metrics.update(loss=loss, logits=logits, labels=batch["y"])
    return loss


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_an_nnx_step_that_updates_its_objects_in_place_equals_nnx_jit(num_microbatches):
    """As under ``nnx.jit``, the model's parameters, BatchNorm statistics and dropout RNG, the
    optimizer and the metrics passed to the step are updated in place."""

    def objects():
        model = GraphNet(nnx.Rngs(0, dropout=1), exact=num_microbatches > 1)
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2, eps=1e-5), wrt=nnx.Param)
        # Accuracy reads the per-example logits after the gradient: at the whole batch.
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
        return model, optimizer, metrics

    rng = np.random.default_rng(5)
    batches = [
        {"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.integers(0, 10, 8).astype(np.int32)}
        for _ in range(3)
    ]
    par = autopar.autoparallel(
        nnx_train_step, num_stages=2, num_microbatches=num_microbatches, batch_argnums=3
    )
    mine, theirs = objects(), objects()
    start = jax.tree.map(np.asarray, nnx.state(mine[0], nnx.Param))
    for batch in batches:
        loss = par(*mine, batch)
        loss_ref = nnx.jit(nnx_train_step)(*theirs, batch)
        np.testing.assert_allclose(np.asarray(loss), np.asarray(loss_ref), **TOLERANCES["adamw"])
    for a, b in zip(jax.tree.leaves(nnx.state(mine)), jax.tree.leaves(nnx.state(theirs)), strict=True):
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["adamw"])
    # The metrics' totals and counts are made after the gradient beside the loss, on one stage,
    # so they compute eagerly as they are.
    for name, value in theirs[2].compute().items():
        np.testing.assert_allclose(mine[2].compute()[name], value, **TOLERANCES["adamw"])
    moved = [
        not np.allclose(a, b)
        for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(nnx.state(mine[0], nnx.Param)), strict=True)
    ]
    assert all(moved)
    assert len(par.plan(*mine, batches[0]).stages) == 2
    # Where the step takes the model: as an nnx.State. Each parameter is already there, where
    # the step left it (a scalar one stage makes and another reads, such as the dropout RNG's
    # count, moves each step).
    shardings = par.input_shardings(*mine, batches[0])
    assert isinstance(shardings[0], nnx.State)
    if num_microbatches > 1:  # split into microbatches, not placed whole
        assert shardings[3] == {"x": None, "y": None}
    params = jax.tree.leaves(nnx.state(mine[0], nnx.Param))
    targets = jax.tree.leaves(nnx.filter_state(shardings[0], nnx.Param))
    assert len(params) == len(targets) == 7
    for param, target in zip(params, targets, strict=True):
        assert param.sharding == target


class LoRAMLP(nnx.Module):
    """Frozen ``nnx.Linear`` kernels, each behind rank-2 ``nnx.LoRA`` adapters."""

    def __init__(self, rngs: nnx.Rngs):
        sizes = (8, 32, 32, 10)
        self.layers = nnx.List(
            nnx.LoRA(a, 2, b, base_module=nnx.Linear(a, b, rngs=rngs), rngs=rngs)
            for a, b in zip(sizes, sizes[1:], strict=False)
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.gelu(layer(x))
        return self.layers[-1](x)


def lora_train_step(model, optimizer, batch):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    loss, grads = autopar.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    optimizer.update(model, grads)
    return loss


def test_an_nnx_step_training_only_lora_adapters_by_a_diff_state_equals_nnx_jit():
    """As ``nnx.value_and_grad``: only the ``nnx.LoRAParam`` state is differentiated and updated;
    the frozen kernels come back as they were."""

    def objects():
        model = LoRAMLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-2, eps=1e-5), wrt=nnx.LoRAParam)

    rng = np.random.default_rng(6)
    batches = [
        {"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.integers(0, 10, 8).astype(np.int32)}
        for _ in range(3)
    ]
    par = autopar.autoparallel(lora_train_step, num_stages=2, num_microbatches=2, batch_argnums=2)
    mine, theirs = objects(), objects()
    kernels = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # a LoRAParam is an nnx.Param too
    frozen = jax.tree.map(np.asarray, nnx.state(mine[0], kernels))
    adapters = jax.tree.map(np.asarray, nnx.state(mine[0], nnx.LoRAParam))
    for batch in batches:
        loss = par(*mine, batch)
        np.testing.assert_allclose(loss, nnx.jit(lora_train_step)(*theirs, batch), **TOLERANCES["adamw"])
    for a, b in zip(jax.tree.leaves(nnx.state(mine)), jax.tree.leaves(nnx.state(theirs)), strict=True):
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["adamw"])
    assert len(jax.tree.leaves(frozen)) == 6
    for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(nnx.state(mine[0], kernels)), strict=True):
        np.testing.assert_array_equal(a, b)
    trained = jax.tree.leaves(nnx.state(mine[0], nnx.LoRAParam))
    assert all(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(adapters), trained, strict=True))
    assert len(par.plan(*mine, batches[0]).stages) == 2


def test_an_nnx_object_named_as_the_batch_is_an_error():
    model, batch = (
        GraphNet(nnx.Rngs(0), exact=True),
        {"x": np.ones((8, 8), np.float32), "y": np.zeros(8, np.int32)},
    )
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    par = autopar.autoparallel(nnx_train_step, num_stages=2, batch_argnums=0)
    with pytest.raises(ValueError, match=r"batch_argnums=\(0,\) names argument 0, an NNX object"):
        par(model, optimizer, metrics, batch)


def test_an_nnx_object_inside_another_argument_is_an_error():
    """Flattened as a pytree, an object inside a dict would not be updated: no silent no-op."""
    model = GraphNet(nnx.Rngs(0), exact=True)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    batch = {"x": np.ones((8, 8), np.float32), "y": np.zeros(8, np.int32)}

    def step(objects, batch):
        return nnx_train_step(objects["model"], objects["optimizer"], objects["metrics"], batch)

    par = autopar.autoparallel(step, num_stages=2)
    objects = {"model": model, "optimizer": optimizer, "metrics": metrics}
    with pytest.raises(ValueError, match=r"NNX object \(\w+\) at \[0\]\['\w+'\], inside another argument"):
        par(objects, batch)
