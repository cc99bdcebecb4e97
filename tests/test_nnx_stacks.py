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


@pytest.mark.parametrize("num_microbatches", [1, MICROBATCHES])
def test_an_nnx_scanned_stack_with_dropout_equals_jit(num_microbatches):
    # With microbatches too: each microbatch draws its rows of the whole batch's masks, layer by
    # layer, and the RNG streams (in the state compared) advance once per step, as under jax.jit.
    _, state, step, batches = _setup(dropout=0.3)
    assert_same_as_jit(
        step, state, batches, TOLERANCES["adamw"], num_stages=2, num_microbatches=num_microbatches
    )
