"""End to end: autopar's pipelined step equals single-device jax.jit."""

import itertools

import pytest
from equality import OPTIMIZERS, TOLERANCES, assert_same_as_jit

from models import train

BATCH = 16


def _case(kind, api, num_stages, num_mb, sched, opt):
    config = train.tiny_config(kind)
    step, state = train.setup(kind, api, config, OPTIMIZERS[opt]())
    batches = [train.make_batch(kind, config, BATCH, seed=i) for i in range(3)]
    par = assert_same_as_jit(
        step,
        state,
        batches,
        TOLERANCES[opt],
        num_stages=num_stages,
        num_microbatches=num_mb,
        schedule=sched,
    )
    plan = par.plan(state, batches[0])
    assert plan.num_stages == num_stages and plan.num_microbatches == num_mb
    ids = [d for st in plan.stages for d in st.device_ids]
    assert sorted(ids) == list(range(8))


ALL = list(
    itertools.product(
        ["mlp", "gpt"], ["linen", "nnx"], [1, 2, 4], [1, 4], ["gpipe", "1f1b"], ["sgd", "adamw"]
    )
)
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
