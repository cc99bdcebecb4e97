"""The other model families (BERT, Wide-ResNet with BatchNorm, MoE with gathers and
scatters) through autopar equal jax.jit."""

import pytest
from equality import OPTIMIZERS, TOLERANCES, assert_same_as_jit

from models import train

BATCH = 8


# BatchNorm normalises with the statistics of what it sees and MoE capacity is a
# fraction of the tokens routed together: both are defined per microbatch, so they
# match a full-batch step with one microbatch. BERT's masked mean divides by the whole
# batch's count of masked tokens in every microbatch, so it matches with several.
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


# The same families, and the GPT styles users bring (rematerialised and scanned blocks, NNX),
# with every stage on a 2-D (data, model) mesh laid out by the sharding ILP. Wide-ResNet is
# compared under SGD: the gradient of its first BatchNorm bias has elements that cancel to
# ~1e-8 (float32 noise, against ~1e-2 for the others), which Adam scales up to full-size
# updates, so any change of summation order (here, channel-split convolutions) shows as a
# 1e-4 parameter difference; see tests/equality.py.
@pytest.mark.parametrize(
    "kind,api,overrides,num_mb,opt",
    [
        ("bert", "linen", {}, 2, "adamw"),
        ("wresnet", "linen", {}, 1, "sgd"),
        ("moe", "linen", {}, 1, "adamw"),
        pytest.param("gpt", "linen", {"remat": True}, 2, "adamw", marks=pytest.mark.slow),  # ~18 s
        pytest.param("gpt", "linen", {"scan_layers": True}, 2, "adamw", marks=pytest.mark.slow),  # ~17 s
        ("gpt", "nnx", {}, 2, "adamw"),
    ],
)
def test_family_on_2d_meshes_equals_jit(kind, api, overrides, num_mb, opt):
    config = train.tiny_config(kind, **overrides)
    step, state = train.setup(kind, api, config, OPTIMIZERS[opt]())
    batches = [train.make_batch(kind, config, BATCH, seed=i) for i in range(3)]
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES[opt], num_stages=2, num_microbatches=num_mb, mesh_shape=(2, 2)
    )
    exe = par.executable(state, batches[0])
    assert [m.devices.shape for m in exe.meshes] == [(2, 2), (2, 2)]
    assert all(s is not None and s.specs for s in exe.shardings)
    if api == "linen" and not overrides:  # some values are split over both axes (batch by all 4 devices)
        assert any(isinstance(e, tuple) for s in exe.shardings for spec in s.specs.values() for e in spec)


# sharding="data" on the same families: the batch split, the state replicated, and the
# gradients kept as partial sums until the last microbatch, through rematerialised blocks too.
# Wide-ResNet under SGD, as above: the batch split over devices sums its convolutions' weight
# gradients in another order, and Adam turns gradient elements that cancel to float32 noise (the
# first BatchNorm's bias among them) into full-size updates.
@pytest.mark.parametrize(
    "kind,api,overrides,num_mb,opt",
    [
        ("bert", "linen", {}, 2, "adamw"),
        ("gpt", "linen", {"remat": True}, 2, "adamw"),
        ("gpt", "nnx", {}, 2, "adamw"),
        pytest.param("wresnet", "linen", {}, 1, "sgd", marks=pytest.mark.slow),  # ~26 s
        ("moe", "linen", {}, 1, "adamw"),
    ],
)
def test_family_with_data_sharding_equals_jit(kind, api, overrides, num_mb, opt):
    config = train.tiny_config(kind, **overrides)
    step, state = train.setup(kind, api, config, OPTIMIZERS[opt]())
    batches = [train.make_batch(kind, config, BATCH, seed=i) for i in range(3)]
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES[opt], num_stages=2, num_microbatches=num_mb, sharding="data"
    )
    exe = par.executable(state, batches[0])
    batch = {exe.step.arg_vars[i] for i in exe.batch_leaf_ids}
    for chosen in exe.shardings:
        held = [v for v in exe.step.arg_vars if v in chosen.specs and v not in batch]
        assert held and all(not any(chosen.specs[v]) for v in held)
    assert all(d.accumulators for d in exe.deferred) == (num_mb > 1)
