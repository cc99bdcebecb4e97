"""NNX layer stacks written the NNX way: blocks created by ``nnx.vmap`` under
``nnx.split_rngs`` and run by ``nnx.scan`` over ``nnx.remat``, trained with an ``nnx.Optimizer``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from equality import TOLERANCES, assert_same_as_jit
from flax import nnx

import autopar

LAYERS, BATCH, MICROBATCHES = 4, 16, 4


class _Block(nnx.Module):
    def __init__(self, dropout: float, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.lin = nnx.Linear(16, 16, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jax.nn.gelu(self.lin(self.norm(x))))


class _Stack(nnx.Module):
    def __init__(self, dropout: float, rngs: nnx.Rngs):
        self.inp = nnx.Linear(8, 16, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return _Block(dropout, rngs)

        self.blocks = blocks(rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def run(x, block):
            return block(x)

        return self.out(run(self.inp(x), self.blocks))


def _setup(dropout: float):
    model = _Stack(dropout, nnx.Rngs(0, dropout=1))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)))

    def step(state, batch):
        model, opt = nnx.merge(graphdef, state)
        loss, grads = autopar.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss

    rng = np.random.RandomState(0)
    batches = [
        {
            "x": jnp.asarray(rng.randn(BATCH, 8), jnp.float32),
            "y": jnp.asarray(rng.randn(BATCH, 4), jnp.float32),
        }
        for _ in range(3)
    ]
    return graphdef, state, step, batches


@pytest.mark.parametrize(
    "options",
    [
        {"num_stages": 2, "num_microbatches": 1},
        {"num_stages": 2, "num_microbatches": MICROBATCHES},
        {"num_stages": 1, "num_microbatches": 1, "mesh_shape": (2, 4)},
    ],
    ids=["2-stages", "microbatches", "2x4-mesh"],
)
def test_an_nnx_scanned_stack_trains_as_under_jit(options):
    _, state, step, batches = _setup(dropout=0.0)
    assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], **options)


def test_an_nnx_scanned_stack_with_dropout_draws_per_microbatch_masks():
    # One microbatch: jax.jit's masks. Several: microbatch j's masks are those of every layer's
    # key folded with j (layer by layer), microbatch 0's unfolded.
    graphdef, state, step, batches = _setup(dropout=0.3)
    assert_same_as_jit(step, state, batches[:2], TOLERANCES["adamw"], num_stages=2, num_microbatches=1)
    new_state, loss = autopar.autoparallel(step, num_stages=2, num_microbatches=MICROBATCHES)(
        state, batches[0]
    )
    losses = []
    rows = BATCH // MICROBATCHES
    for j in range(MICROBATCHES):
        model, _ = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # its own variables
        if j:
            keys = nnx.state(model, nnx.RngKey)
            nnx.update(model, jax.tree.map(jax.vmap(lambda k, j=j: jax.random.fold_in(k, j)), keys))
        x, y = (batches[0][k][j * rows : (j + 1) * rows] for k in ("x", "y"))
        losses.append(jnp.mean((model(x) - y) ** 2))
    assert len(set(np.round(np.asarray(losses), 4))) == MICROBATCHES  # masks differ per microbatch
    np.testing.assert_allclose(loss, np.mean(losses), **TOLERANCES["sgd"])
    # The streams advanced as under jax.jit: once per step, whatever the microbatches.
    counts = nnx.state(nnx.merge(graphdef, new_state)[0], nnx.RngCount)
    jit_counts = nnx.state(nnx.merge(graphdef, jax.jit(step)(state, batches[0])[0])[0], nnx.RngCount)
    for a, b in zip(jax.tree.leaves(counts), jax.tree.leaves(jit_counts), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
