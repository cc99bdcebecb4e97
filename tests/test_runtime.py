"""End to end: autopar's pipelined step equals single-device jax.jit."""

import itertools

import pytest
from equality import OPTIMIZERS, TOLERANCES, assert_same_as_jit

from autopar._src import fusion
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


@pytest.mark.parametrize(
    "num_stages,sched,joined_stages",
    [(1, "1f1b", {0}), (2, "1f1b", {1}), (2, "gpipe", set())],
)
def test_a_stage_that_runs_a_microbatch_backward_right_after_its_forward_runs_them_as_one_task(
    num_stages, sched, joined_stages
):
    config = train.tiny_config("gpt")
    step, state = train.setup("gpt", "linen", config, OPTIMIZERS["sgd"]())
    batches = [train.make_batch("gpt", config, BATCH, seed=i) for i in range(3)]
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["sgd"], num_stages=num_stages, num_microbatches=4, schedule=sched
    )
    tasks = par.executable(state, batches[0]).program.tasks
    pipeline = [t for t in tasks if t.label[0] in "FB"]
    for s in range(num_stages):
        labels = [t.label for t in pipeline if t.stage == s]
        if s in joined_stages:
            assert labels == [f"F{s}.{j}+B{s}.{j}" for j in range(4)], labels
        else:  # GPipe's last microbatch is the one it runs back to back
            assert all("+" not in lab for lab in labels[:-1]), labels
    for t in pipeline:
        if "+" not in t.label:
            continue
        # What the forward keeps for the backward stays inside the task: it is neither
        # returned nor read back.
        made_in_forward = {k for op in t.ops for k in op.outs if k is not None}
        kept = {k for k in made_in_forward if any(k in op.ins for op in t.ops)}
        assert kept and not kept & set(t.out_keys), t.label
    # A backward apart from its forward makes again the cheap values the forward made from
    # what it returns (XLA's choice inside one program): the forward does not return them.
    by_label = {t.label: t for t in pipeline}
    for s in set(range(num_stages)) - joined_stages:
        forward, backward = by_label[f"F{s}.1"], by_label[f"B{s}.1"]
        made = {k for op in forward.ops for k in op.outs if k is not None}
        again = [op for op in backward.ops if op.kind == "eqn" and made.intersection(op.outs)]
        assert again, forward.label
        assert all(fusion.fusible(op.eqn) or fusion.regenerated(op.eqn) for op in again)
        assert not {k for op in again for k in op.outs} & set(forward.out_keys)
