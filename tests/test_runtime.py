"""End to end: autopar's pipelined step equals single-device jax.jit."""

import itertools

import jax
import numpy as np
import optax
import pytest

import autopar
from models import train

TOLERANCES = {"sgd": dict(rtol=1e-5, atol=1e-6), "adamw": dict(rtol=1e-4, atol=1e-5)}
# Adam maps a gradient element that cancels to ~0 (|g| ~ 1e-8 while typical
# gradients are ~1e-2) to an update of g / (|g| + eps): with the default eps=1e-8 the
# float32 summation-order noise of such an element (~1e-9 between a full batch and a
# mean of microbatch means) becomes a 1e-4 change of the parameter. eps=1e-5 keeps
# that noise far below the tolerance while every well-conditioned element is compared
# exactly as before.
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adamw": lambda: optax.adamw(1e-2, eps=1e-5)}
BATCH = 16


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
    moved = [not np.allclose(as_numpy(a), as_numpy(b)) for a, b in
             zip(jax.tree.leaves(state), leaves_par, strict=True)]
    assert any(moved)
    return par


def _case(kind, api, num_stages, num_mb, sched, opt):
    config = train.tiny_config(kind)
    step, state = train.setup(kind, api, config, OPTIMIZERS[opt]())
    batches = [train.make_batch(kind, config, BATCH, seed=i) for i in range(3)]
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES[opt],
        num_stages=num_stages, num_microbatches=num_mb, schedule=sched,
    )
    plan = par.plan(state, batches[0])
    assert plan.num_stages == num_stages and plan.num_microbatches == num_mb
    ids = [d for st in plan.stages for d in st.device_ids]
    assert sorted(ids) == list(range(8))


ALL = list(itertools.product(
    ["mlp", "gpt"], ["linen", "nnx"], [1, 2, 4], [1, 4], ["gpipe", "1f1b"], ["sgd", "adamw"]
))
# A covering subset runs by default: every value of every axis, and every pair of
# (stages, microbatches, schedule), on both models and both APIs.
DEFAULT = [
    ("mlp", "linen", 1, 1, "1f1b", "sgd"),
    ("mlp", "nnx", 2, 4, "gpipe", "adamw"),
    ("mlp", "linen", 4, 4, "1f1b", "adamw"),
    ("mlp", "nnx", 4, 1, "gpipe", "sgd"),
    ("gpt", "linen", 2, 4, "1f1b", "sgd"),
    ("gpt", "nnx", 2, 1, "1f1b", "adamw"),
    ("gpt", "linen", 4, 4, "gpipe", "adamw"),
    ("gpt", "nnx", 4, 4, "1f1b", "sgd"),
    ("gpt", "linen", 1, 4, "gpipe", "adamw"),
    ("gpt", "nnx", 1, 4, "1f1b", "adamw"),
]


@pytest.mark.parametrize("kind,api,num_stages,num_mb,sched,opt", DEFAULT)
def test_equals_jit(kind, api, num_stages, num_mb, sched, opt):
    _case(kind, api, num_stages, num_mb, sched, opt)


@pytest.mark.slow
@pytest.mark.parametrize("kind,api,num_stages,num_mb,sched,opt", [c for c in ALL if c not in DEFAULT])
def test_equals_jit_full_matrix(kind, api, num_stages, num_mb, sched, opt):
    _case(kind, api, num_stages, num_mb, sched, opt)
