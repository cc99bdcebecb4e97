"""Random draws in the batch's shape made before the loss function (a diffusion step's noise and
noise levels, augmentations): with several microbatches each makes its rows of the whole batch's
draw, so the step equals ``jax.jit``'s."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equality import TOLERANCES, assert_same_as_jit

import autopar

BATCH, WIDTH = 16, 8


def _model(p, x):
    return jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]) @ p["w3"]


def _flip(x, y, key):
    return x * jnp.where(jax.random.bernoulli(key, 0.5, (x.shape[0], 1)), 1.0, -1.0), y


def _per_example_keys(x, y, key):
    keys = jax.random.split(key, x.shape[0])
    return x + 0.1 * jax.vmap(lambda k: jax.random.normal(k, x.shape[1:]))(keys), y


def _diffusion(x, y, key):
    k_level, k_noise = jax.random.split(key)
    level = jax.random.uniform(k_level, (x.shape[0], 1))
    return jnp.sqrt(1 - level) * x + jnp.sqrt(level) * jax.random.normal(k_noise, x.shape), y


def _two_runs(x, y, key):
    # One draw for two views of the batch, reshaped inside the loss function: two runs of them.
    return x, (y, jax.random.normal(key, (2 * x.shape[0], x.shape[1])))


def _label_noise(x, y, key):
    # Read at the last stage, where the loss is.
    return x, y + 0.1 * jax.random.normal(key, y.shape)


def _mixup_weights(x, y, key):
    # Mixup's weight per example, a beta draw whose alpha is broadcast to the batch's shape, the
    # partner made from the example itself (its features reversed).
    lam = jax.random.beta(key, 0.4, 0.4, (x.shape[0], 1))
    return lam * x + (1 - lam) * (x[:, ::-1] * 0.5), y


DRAWS = {
    "flip": _flip,
    "mixup-beta": _mixup_weights,
    "per-example-keys": _per_example_keys,
    "diffusion": _diffusion,
    "two-runs": _two_runs,
    "label-noise": _label_noise,
}


def _loss(p, x, y, dropout_key=None):
    if isinstance(y, tuple):  # noise for two views, drawn as one
        y, noise = y
        views = noise.reshape(2, *x.shape)
        x = x + 0.1 * views[0] - 0.05 * views[1] ** 2
    h = _model(p, x)
    if dropout_key is not None:
        h = h * jax.random.bernoulli(dropout_key, 0.8, h.shape) / 0.8
    return jnp.mean((h - y) ** 2)


def _step(draw, dropout=False, metric=False):
    def step(state, batch):
        p, key = state
        key, sub, drop = jax.random.split(key, 3)
        x, y = draw(batch["x"], batch["y"], sub)
        loss, grads = autopar.value_and_grad(_loss)(p, x, y, drop if dropout else None)
        new = (jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), key)
        if metric:  # read after the gradient: at the whole batch, as jax.jit draws it
            return new, loss, jnp.mean(x**2)
        return new, loss

    return step


def _state(make_key=jax.random.key):
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = {"w1": (WIDTH, 16), "w2": (16, 16), "w3": (16, 1)}
    p = {k: jax.random.normal(key, shape) * 0.3 for key, (k, shape) in zip(keys, shapes.items(), strict=True)}
    return p, make_key(5)


def _batches(n=3):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(BATCH, WIDTH)).astype(np.float32),
            "y": rng.normal(size=(BATCH, 1)).astype(np.float32),
        }
        for _ in range(n)
    ]


@pytest.mark.parametrize("name", DRAWS)
def test_draws_before_the_loss_function_equal_jit_over_microbatches_and_stages(name):
    state, batches = _state(), _batches()
    par = assert_same_as_jit(
        _step(DRAWS[name]), state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=4
    )
    modes = {
        op.mode for t in par.executable(state, batches[0]).program.tasks for op in t.ops if op.kind == "acc"
    }
    assert "index" in modes and "fold" not in modes


@pytest.mark.parametrize(
    ("dropout", "metric", "make_key"),
    [(True, False, jax.random.key), (False, True, jax.random.PRNGKey), (False, False, jax.random.key)],
    ids=["with-dropout-in-the-loss", "read-after-the-gradient", "rbg"],
)
def test_draws_before_the_loss_function_with_others_equal_jit(dropout, metric, make_key):
    if make_key is jax.random.key and not dropout:
        make_key = lambda seed: jax.random.key(seed, impl="rbg")  # noqa: E731
    state, batches = _state(make_key), _batches(2)
    step = _step(_diffusion, dropout=dropout, metric=metric)
    par = autopar.autoparallel(step, num_stages=2, num_microbatches=4)
    ref = jax.jit(step)
    s_par, s_ref = state, state
    for batch in batches:
        out_par, out_ref = par(s_par, batch), ref(s_ref, batch)
        for a, b in zip(jax.tree.leaves(out_par[1:]), jax.tree.leaves(out_ref[1:]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCES["sgd"])
        s_par, s_ref = out_par[0], out_ref[0]
    for a, b in zip(jax.tree.leaves(s_par[0]), jax.tree.leaves(s_ref[0]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCES["sgd"])
    ops = [op for t in par.executable(state, batches[0]).program.tasks for op in t.ops if op.kind == "acc"]
    assert [op.mode for op in ops].count("index") == 1  # one index for the draws before and inside


def test_a_draw_before_the_loss_function_mixed_along_the_batch_is_an_error():
    def mixed(x, y, key):
        noise = jax.random.normal(key, x.shape)
        return x + 0.1 * jnp.roll(noise, 1, axis=0), y

    with pytest.raises(
        ValueError, match=r"code before the gradient combines examples \(at .*test_early_draws"
    ):
        autopar.autoparallel(_step(mixed), num_stages=2, num_microbatches=4)(_state(), _batches(1)[0])


def test_a_draw_before_the_loss_function_that_grows_in_two_dims_is_an_error_naming_the_fixes():
    def pairs(x, y, key):
        weights = jax.random.uniform(key, (x.shape[0], x.shape[0]))  # one per pair of examples
        return x + 0.1 * jnp.diagonal(weights)[:, None], y

    with pytest.raises(
        ValueError, match=r"draws random values in the batch's shape .*two dims.*pass them in the batch"
    ):
        autopar.autoparallel(_step(pairs), num_stages=2, num_microbatches=4)(_state(), _batches(1)[0])


@pytest.mark.parametrize("inside", [False, True], ids=["drawn-before", "drawn-inside"])
def test_a_draw_meeting_the_batch_tiled_before_the_loss_function_is_made_in_its_runs(inside):
    """``jnp.tile`` before the loss function lays the batch's rows out as two runs of the
    examples: a draw of their shape that meets them is made in two runs too."""

    def loss_fn(p, x, y, noise):
        if inside:
            noise = jax.random.normal(noise, x.shape)
        return jnp.mean((_model(p, x + 0.1 * noise) - y) ** 2)

    def step(state, batch):
        p, key = state
        key, sub = jax.random.split(key)
        x, y = jnp.tile(batch["x"], (2, 1)), jnp.tile(batch["y"], (2, 1))
        noise = sub if inside else jax.random.normal(sub, x.shape)
        loss, grads = autopar.value_and_grad(loss_fn)(p, x, y, noise)
        return (jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), key), loss

    assert_same_as_jit(step, _state(), _batches(2), TOLERANCES["sgd"], num_stages=2, num_microbatches=4)
