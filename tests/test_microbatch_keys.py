"""PRNG keys with microbatches where a draw cannot be made as ``jax.jit`` makes it
(:mod:`autopar._src.microbatch_keys`): each microbatch draws its own values from
``fold_in(key, j)``; keys drawn once per step are left alone. Draws that follow the batch are
``jax.jit``'s (``test_microbatch_draws``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from equality import TOLERANCES, as_numpy, assert_same_as_jit, dropout_step
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import autopar
from models import train

BATCH = 16


def _shard_dropout(x, key):
    # Drawn per shard inside a shard_map, which autopar runs as it is: no microbatch can draw
    # jax.jit's rows there (and every shard draws the same mask, as under jax.jit).
    mesh = Mesh(np.array(jax.devices()), ("all",))

    def shard(x, key):
        return x * jax.random.bernoulli(key, 0.5, x.shape) * 2

    return jax.shard_map(shard, mesh=mesh, in_specs=(P("all"), P()), out_specs=P("all"))(x, key)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
@pytest.mark.parametrize("dropout", [_shard_dropout, jax.checkpoint(_shard_dropout)], ids=["plain", "remat"])
def test_each_microbatch_draws_its_own_mask_from_the_key_folded_with_its_index(make_key, dropout):
    step = dropout_step(dropout)

    w, batch, key = jnp.ones(()), {"x": jax.random.normal(jax.random.key(3), (4 * BATCH, 32))}, make_key(1)
    par = autopar.autoparallel(step, num_stages=1, num_microbatches=4, batch_argnums=1)
    out = par(w, batch, key)
    rows = BATCH
    keys = [key, *(jax.random.fold_in(key, j) for j in range(1, 4))]
    expected = [jax.jit(dropout)(batch["x"][j * rows : (j + 1) * rows], k) for j, k in enumerate(keys)]
    np.testing.assert_array_equal(np.asarray(out[1]), np.concatenate(expected))
    np.testing.assert_array_equal(as_numpy(out[2]), as_numpy(key))  # returned as it came, not folded
    # A key derived inside the loss function is the first microbatch's, from the key unfolded.
    np.testing.assert_array_equal(as_numpy(out[3]), as_numpy(jax.jit(step)(w, batch, key)[3]))
    modes = {op.mode for t in par.executable(w, batch, key).program.tasks for op in t.ops if op.kind == "acc"}
    assert "fold" in modes and "index" not in modes


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_an_array_of_keys_is_folded_key_by_key(make_key):
    # One key per layer of a stack (nnx.split_rngs + nnx.vmap keeps them so), drawn in a scan
    # (raw keys are wrapped inside the scan's body).
    def step(w, batch, keys):
        def loss_fn(w):
            def layer(h, key):
                return _shard_dropout(h * w, key), None

            h, _ = jax.lax.scan(layer, batch["x"], keys)
            return jnp.mean(h**2), h

        (loss, h), grad = autopar.value_and_grad(loss_fn, has_aux=True)(w)
        return w - 0.1 * grad, h

    w, batch, keys = jnp.ones(()), {"x": jnp.ones((2 * BATCH, 32))}, jax.random.split(make_key(0), 3)
    out = autopar.autoparallel(step, num_stages=1, num_microbatches=2, batch_argnums=1)(w, batch, keys)
    folded = jax.vmap(jax.random.fold_in, (0, None))(
        jax.random.wrap_key_data(keys) if keys.ndim == 2 else keys, 1
    )
    folded = jax.random.key_data(folded) if keys.ndim == 2 else folded

    def second_half(x):
        return jax.lax.scan(lambda h, k: (_shard_dropout(h, k), None), x, folded)[0]

    np.testing.assert_array_equal(
        np.asarray(out[1])[BATCH:], np.asarray(jax.jit(second_half)(batch["x"][BATCH:]))
    )


def test_gamma_variates_per_example_of_a_prng_not_counter_based_are_drawn_from_folded_keys():
    # jax.random.gamma splits its key per element inside its primitive; with rbg keys no
    # microbatch can split as the whole batch's draw does: microbatch j draws from
    # fold_in(key, j), not all microbatches the first one's variates.
    def step(w, batch, key):
        def loss_fn(w):
            variates = jax.random.gamma(key, batch["a"])
            return jnp.mean(w * variates), variates

        (loss, variates), grad = autopar.value_and_grad(loss_fn, has_aux=True)(w)
        return w - 0.1 * grad, variates

    w, batch, key = jnp.ones(()), {"a": jnp.linspace(1.0, 3.0, BATCH)}, jax.random.key(1, impl="rbg")
    out = autopar.autoparallel(step, num_stages=1, num_microbatches=4, batch_argnums=1)(w, batch, key)
    rows = BATCH // 4
    keys = [key, *(jax.random.fold_in(key, j) for j in range(1, 4))]
    expected = [jax.random.gamma(k, batch["a"][j * rows : (j + 1) * rows]) for j, k in enumerate(keys)]
    np.testing.assert_allclose(np.asarray(out[1]), np.concatenate(expected), rtol=1e-6)


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
