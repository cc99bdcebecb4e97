"""PRNG keys with microbatches: each microbatch draws its own per-example values (dropout
masks) from ``fold_in(key, j)``; keys drawn once per step are left alone."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from equality import TOLERANCES, as_numpy, assert_same_as_jit

import autopar
from models import train

BATCH = 16


def _plain_dropout(x, key):
    return x * jax.random.bernoulli(key, 0.5, x.shape) * 2


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
@pytest.mark.parametrize(
    "dropout",
    [
        lambda x, key: nn.Dropout(0.5, deterministic=False).apply({}, x, rngs={"dropout": key}),
        jax.checkpoint(_plain_dropout),  # the key is read inside a rematerialised block
    ],
)
def test_each_microbatch_draws_its_own_dropout_mask(make_key, dropout):
    # The key is split once per step; each microbatch folds in its index, so no two
    # microbatches share a mask (all rows of x are equal: equal masks give equal rows).
    def step(w, batch, key):
        def loss_fn(w):
            h = dropout(batch["x"] * w, key)
            return jnp.mean(h**2), (h, key, jax.random.split(key)[0])

        (loss, (h, same_key, next_key)), grad = autopar.value_and_grad(loss_fn, has_aux=True)(w)
        return w - 0.1 * grad, h, same_key, next_key

    w, batch, key = jnp.ones(()), {"x": jnp.ones((BATCH, 32))}, make_key(1)
    rows = []
    for nmb in (1, 4):
        par = autopar.autoparallel(step, num_stages=1, num_microbatches=nmb, batch_argnums=1)
        out = par(w, batch, key)
        np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(par(w, batch, key)[1]))  # deterministic
        np.testing.assert_array_equal(as_numpy(out[2]), as_numpy(key))  # returned as it came, not folded
        # A key derived inside the loss function is the first microbatch's, from the key unfolded.
        np.testing.assert_array_equal(as_numpy(out[3]), as_numpy(jax.jit(step)(w, batch, key)[3]))
        rows.append(np.asarray(out[1]).reshape(nmb, BATCH // nmb, 32)[:, 0])
    np.testing.assert_array_equal(rows[0][0], np.asarray(jax.jit(step)(w, batch, key)[1])[0])  # one: as jit
    masks = rows[1] != 0
    assert all(not np.array_equal(masks[a], masks[b]) for a in range(4) for b in range(a))


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_an_array_of_keys_is_folded_key_by_key(make_key):
    # One key per layer of a stack (nnx.split_rngs + nnx.vmap keeps them so), drawn in a scan
    # (raw keys are wrapped inside the scan's body).
    def step(w, batch, keys):
        def loss_fn(w):
            def layer(h, key):
                return _plain_dropout(h * w, key), None

            h, _ = jax.lax.scan(layer, batch["x"], keys)
            return jnp.mean(h**2), h

        (loss, h), grad = autopar.value_and_grad(loss_fn, has_aux=True)(w)
        return w - 0.1 * grad, h

    w, batch, keys = jnp.ones(()), {"x": jnp.ones((BATCH, 32))}, jax.random.split(make_key(0), 3)
    out = autopar.autoparallel(step, num_stages=1, num_microbatches=2, batch_argnums=1)(w, batch, keys)
    halves = np.asarray(out[1]).reshape(2, BATCH // 2, 32)[:, 0] != 0
    assert not np.array_equal(halves[0], halves[1])


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return nn.Dropout(0.5, deterministic=False)(nn.Dense(16)(h)), None


class _Lifted(nn.Module):
    lift: str

    @nn.compact
    def __call__(self, x):
        lifted = {"params": True, "dropout": True}  # flax clones the key, then splits it per layer
        if self.lift == "scan":
            return nn.scan(_Block, variable_axes={"params": 0}, split_rngs=lifted, length=2)()(x, None)[0]
        stack = nn.vmap(
            _Block, variable_axes={"params": 0}, split_rngs=lifted, in_axes=(None, None), axis_size=2
        )
        return stack()(x, None)[0].mean(axis=0)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
@pytest.mark.parametrize("lift", ["scan", "vmap"])
def test_keys_split_by_lifted_layer_stacks_are_folded(lift, make_key):
    # Microbatch j's loss and gradients are those of a whole-batch step on its slice with the
    # key fold_in(key, j) (the key itself for j = 0); the step averages them.
    model = _Lifted(lift)
    x = jax.random.normal(jax.random.key(2), (BATCH, 16))
    params = model.init(jax.random.key(0), x)["params"]

    def loss_fn(p, x, key):
        h = model.apply({"params": p}, x, rngs={"dropout": key})
        return jnp.mean(h**2), h

    def step(params, batch, key):
        (loss, h), grad = autopar.value_and_grad(loss_fn, has_aux=True)(params, batch["x"], key)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grad), loss, h

    key = make_key(1)
    keys = [key, jax.random.fold_in(key, 1)]
    parts = [
        jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, half, k)
        for half, k in zip(jnp.split(x, 2), keys, strict=True)
    ]
    grad = jax.tree.map(lambda a, b: (a + b) / 2, parts[0][1], parts[1][1])
    expected = (
        jax.tree.map(lambda p, g: p - 0.1 * g, params, grad),
        (parts[0][0][0] + parts[1][0][0]) / 2,
        jnp.concatenate([parts[0][0][1], parts[1][0][1]]),
    )
    par = autopar.autoparallel(step, num_stages=1, num_microbatches=2, batch_argnums=1)
    out = par(params, {"x": x}, key)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCES["sgd"]),
        out,
        expected,
    )


def test_a_key_drawn_once_per_step_is_not_folded():
    # Weight noise has the same shape for any batch: one draw per step, as under jit, so its
    # key is left alone and the step equals jit's with microbatches too.
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))

    def step(state_and_key, batch):
        state, key = state_and_key
        key, sub = jax.random.split(key)

        def loss_fn(p):
            noisy = jax.tree.map(lambda w: w + 0.01 * jax.random.normal(sub, w.shape), p)
            logits = state.apply_fn({"params": noisy}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return (state.apply_gradients(grads=grads), key), loss

    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]
    state = (state, jax.random.key(0))
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=4)


def test_nested_jits_dropout_and_rng_like_hugging_face():
    # Each block and the whole loss under jit; dropout keyed by an RNG carried in the
    # state and split outside the gradient (once per step).
    config = train.tiny_config("gpt", dropout_rate=0.1)
    model = train.GPT(config)
    tokens = train.make_batch("gpt", config, BATCH)["tokens"]
    params = model.init(jax.random.key(0), tokens)["params"]
    tx = optax.adamw(1e-2, eps=1e-5)
    state = (params, tx.init(params), jax.random.key(1))

    @jax.jit
    def loss_fn(p, tokens, key):
        logits = model.apply({"params": p}, tokens, deterministic=False, rngs={"dropout": key})
        return train.next_token_loss(logits, tokens)

    def step(state, batch):
        params, opt_state, key = state
        key, sub = jax.random.split(key)
        loss, grads = autopar.value_and_grad(loss_fn)(params, batch["tokens"], sub)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), loss

    batches = [train.make_batch("gpt", config, BATCH, seed=i) for i in range(3)]
    # One microbatch: the dropout masks are drawn for the same shape, so they match.
    assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], num_stages=2, num_microbatches=1)


@pytest.mark.parametrize("placed", [False, True])
def test_a_typed_key_read_on_every_stage_moves_between_them(placed):
    # The loss reads the state's key in every layer, so each step moves the new key from the
    # stage that splits it to the others (and, placed on all 8 devices, to both at the start).
    config = train.tiny_config("gpt", dropout_rate=0.1)
    model = train.GPT(config)
    batches = [train.make_batch("gpt", config, BATCH, seed=i) for i in range(3)]
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    tx = optax.adamw(1e-2, eps=1e-5)
    state = (params, tx.init(params), jax.random.key(1))
    if placed:
        everywhere = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
        state = jax.device_put(state, jax.sharding.NamedSharding(everywhere, jax.sharding.PartitionSpec()))

    def step(state, batch):
        params, opt_state, key = state

        def loss_fn(p):
            logits = model.apply({"params": p}, batch["tokens"], deterministic=False, rngs={"dropout": key})
            return train.next_token_loss(logits, batch["tokens"])

        loss, grads = autopar.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, jax.random.split(key)[0]), loss

    # One microbatch: the dropout masks are drawn for the same shape, so they match.
    assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], num_stages=2, num_microbatches=1)
