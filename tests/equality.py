"""The central check: autopar's step gives the same results as single-device jax.jit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import autopar

TOLERANCES = {"sgd": dict(rtol=1e-5, atol=1e-6), "adamw": dict(rtol=1e-4, atol=1e-5)}
# Adam maps a gradient element that cancels to ~0 (|g| ~ 1e-8 while typical
# gradients are ~1e-2) to an update of g / (|g| + eps): with the default eps=1e-8 the
# float32 summation-order noise of such an element (~1e-9 between a full batch and a
# mean of microbatch means) becomes a 1e-4 change of the parameter. eps=1e-5 keeps
# that noise far below the tolerance while every well-conditioned element is compared
# exactly as before.
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adamw": lambda: optax.adamw(1e-2, eps=1e-5)}


def as_numpy(x):
    """``x`` as a NumPy array (PRNG keys as their key data)."""
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def assert_same_as_jit(step, state, batches, tol, **options):
    """Runs ``len(batches)`` steps both ways; asserts losses and states agree."""
    par = autopar.autoparallel(step, **options)
    ref = jax.jit(step)
    s_par, s_ref = state, state
    for batch in batches:
        s_par, loss_par = par(s_par, batch)
        s_ref, loss_ref = ref(s_ref, batch)
        np.testing.assert_allclose(np.asarray(loss_par), np.asarray(loss_ref), **tol)
    leaves_par, tree_par = jax.tree.flatten(s_par)
    leaves_ref, tree_ref = jax.tree.flatten(s_ref)
    assert tree_par == tree_ref
    for a, b in zip(leaves_par, leaves_ref, strict=True):
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), **tol)
    # Training moved the parameters: the comparison is not between two untouched states.
    moved = [
        not np.allclose(as_numpy(a), as_numpy(b))
        for a, b in zip(jax.tree.leaves(state), leaves_par, strict=True)
    ]
    assert any(moved)
    return par


def nnx_classifier(model, tx):
    """``(step, state)``: a functional train step of an NNX classifier (``batch["x"]`` to logits of
    the integer labels ``batch["y"]``) and its ``nnx.Optimizer`` over the split state."""
    graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(batch["x"]), batch["y"]).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return step, state


def classifier_step(inputs: str, labels: str):
    """A ``TrainState`` step minimising the mean cross-entropy of ``state.apply_fn`` on
    ``batch[inputs]`` against the integer labels ``batch[labels]``."""

    def step(state, batch):
        def loss_fn(p):
            logits = state.apply_fn({"params": p}, batch[inputs])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[labels]).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step


def dropout_step(dropout):
    """A step of a scalar weight ``w`` through ``dropout(batch["x"] * w, key)``: the new ``w``,
    the dropped activations, the key the loss read and a key it split from it."""

    def step(w, batch, key):
        def loss_fn(w):
            h = dropout(batch["x"] * w, key)
            return jnp.mean(h**2), (h, key, jax.random.split(key)[0])

        (loss, (h, same_key, next_key)), grad = autopar.value_and_grad(loss_fn, has_aux=True)(w)
        return w - 0.1 * grad, h, same_key, next_key

    return step
