"""The other model families (BERT, Wide-ResNet with BatchNorm, MoE with gathers and
scatters) through autopar equal jax.jit."""

import pytest
from equality import OPTIMIZERS, TOLERANCES, assert_same_as_jit

from models import train

BATCH = 8


# BatchNorm normalises with the statistics of what it sees and MoE capacity is a
# fraction of the tokens routed together: both are defined per microbatch, so they
# match a full-batch step with one microbatch. BERT's masked mean is a batch mean
# (every row masks the same number of tokens), so it matches with several.
@pytest.mark.parametrize(
    "kind,num_stages,num_mb",
    [("bert", 2, 4), ("wresnet", 2, 1), ("moe", 2, 1)],
)
def test_family_equals_jit(kind, num_stages, num_mb):
    config = train.tiny_config(kind)
    step, state = train.setup(kind, "linen", config, OPTIMIZERS["sgd"]())
    batches = [train.make_batch(kind, config, BATCH, seed=i) for i in range(3)]
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["sgd"], num_stages=num_stages, num_microbatches=num_mb
    )
    assert par.plan(state, batches[0]).num_stages == num_stages
