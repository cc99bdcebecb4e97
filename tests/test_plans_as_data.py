"""Plans as data: the command line, JSON, timelines, dry runs, comparison with pjit."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec

import autopar
from autopar.__main__ import main
from autopar._src import timeline
from models import train


@pytest.mark.slow  # ~26 s: a subprocess plans gpt-small
def test_cli_plan_writes_json_that_round_trips_and_a_timeline(tmp_path, capsys):
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    status = main(
        [
            "plan",
            "--model",
            "gpt-2.6b",
            "--cluster",
            "1x8xV100",
            "--json",
            str(out_json),
            "--timeline",
            str(out_png),
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert "autopar plan" in printed and "predicted step" in printed and "bubble=" in printed
    plan = autopar.Plan.load(str(out_json))
    assert autopar.Plan.from_json(plan.to_json()) == plan
    assert out_json.read_text() == plan.to_json()
    assert sum(len(st.device_ids) for st in plan.stages) == 8
    assert all(st.memory_bytes <= plan.memory_budget for st in plan.stages)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = timeline.draw(timeline.simulate(plan), str(tmp_path / "again.png"), num_stages=plan.num_stages)
    assert len(fig.axes[0].get_yticklabels()) == plan.num_stages


@pytest.mark.slow  # ~35 s
def test_dry_run_plans_a_model_larger_than_this_machine():
    # 15B parameters: 60 GB in float32 alone, more than this machine's memory; nothing
    # is allocated, the step is traced on shapes.
    config = train.GPTConfig.preset("gpt-15b", dtype=jnp.bfloat16, remat=True)
    state = jax.eval_shape(lambda: train.linen_state("gpt", config, optax.adamw(1e-4)))
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    assert num_params * 4 > 24 * 2**30
    batch = {"tokens": jax.ShapeDtypeStruct((512, config.max_len), jnp.int32)}
    plan = autopar.plan_step(train.linen_step("gpt"), state, batch, cluster=autopar.parse_cluster("2x8xA100"))
    assert sorted(d for st in plan.stages for d in st.device_ids) == list(range(16))
    assert all(0 < st.memory_bytes <= plan.memory_budget for st in plan.stages)
    assert plan.predicted_step_time > 0 and 512 % plan.num_microbatches == 0


def _megatron(state, batch):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    return autopar.Manual.from_rules(mesh, autopar.megatron_rules(), (state, batch), name="megatron")


def test_compare_with_megatron_pjit_agrees():
    config = train.tiny_config("gpt")
    step, state = train.setup("gpt", "linen", config, optax.adamw(1e-3, eps=1e-5))
    batches = [train.make_batch("gpt", config, 16, seed=i) for i in range(4)]
    manual = _megatron(state, batches[0])
    kernel = manual.in_shardings[0].params["block_0"]["attn"]["query"]["kernel"]
    assert kernel.spec == PartitionSpec(None, "model")
    result = autopar.compare(
        step, state, batches, manual=manual, num_stages=2, num_microbatches=2, print_table=False
    )
    assert result.agree and result.max_loss_difference < 1e-5
    assert result.autopar_step_seconds > 0 and result.manual_step_seconds > 0
    assert result.autopar_memory_bytes > 0 and result.manual_memory_bytes > 0


def test_compare_reports_disagreement():
    # The batch variance of the logits is not a mean over examples: averaging it over
    # microbatches is not the full-batch value, so autopar with 2 microbatches and the
    # full-batch pjit step must be reported as different.
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.5))

    def step(state, batch):
        def loss_fn(p):
            logits = state.apply_fn({"params": p}, batch["x"])
            return train.softmax_cross_entropy(logits, batch["y"]) + jnp.var(logits[:, 0])

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    batches = [train.make_batch("mlp", config, 16, seed=i) for i in range(3)]
    mesh = Mesh(np.array(jax.devices()).reshape(8, 1), ("data", "model"))
    manual = autopar.Manual.from_rules(mesh, [], (state, batches[0]), name="data parallel")
    result = autopar.compare(
        step, state, batches, manual=manual, num_stages=1, num_microbatches=2, print_table=False
    )
    assert not result.agree and result.max_loss_difference > 1e-4


def test_manual_rule_that_does_not_fit_is_an_error():
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    mesh = Mesh(np.array(jax.devices()).reshape(8, 1), ("data", "model"))
    with pytest.raises(
        ValueError, match=r"Rule .bias. gives P\(None, .model.\) to .*bias.* of shape \(64,\)"
    ):
        autopar.Manual.from_rules(
            mesh, [(r"bias", PartitionSpec(None, "model"))], (state, train.make_batch("mlp", config, 8))
        )


def test_compare_needs_two_batches():
    with pytest.raises(ValueError, match="at least 2 batches"):
        autopar.compare(lambda s, b: (s, 0.0), {}, [{}], manual=None)


def test_timeline_with_measured_task_times(tmp_path):
    config = train.tiny_config("gpt")
    step, state = train.setup("gpt", "linen", config, optax.sgd(0.1))
    batch = train.make_batch("gpt", config, 16)
    par = autopar.autoparallel(step, num_stages=2, num_microbatches=4)
    (new_state, loss), measured = par.timed(state, batch)
    _, ref_loss = jax.jit(step)(state, batch)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-5, atol=1e-6)
    # 1F1B's last stage runs each microbatch's forward and backward as one task.
    assert set(measured) == {(0, "F"), (0, "B"), (1, "F+B")}
    assert all(t > 0 for t in measured.values())
    plan = par.plan(state, batch)
    tasks = timeline.simulate(plan, task_seconds=measured, forward_fraction=0.25)
    forward = [t for t in tasks if t.stage == 0 and t.kind == "F"]
    assert np.isclose(forward[0].end - forward[0].start, measured[(0, "F")])
    last = [t for t in tasks if t.stage == 1 and t.microbatch == 0]
    assert [t.kind for t in last] == ["F", "B"]
    assert np.isclose(last[0].end - last[0].start, 0.25 * measured[(1, "F+B")])
    assert np.isclose(sum(t.end - t.start for t in last), measured[(1, "F+B")])
    plan.timeline(str(tmp_path / "measured.png"), task_seconds=measured)
    assert (tmp_path / "measured.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda d: [], "Plan data must be a JSON object, got list"),
        (lambda d: {k: v for k, v in d.items() if k != "stages"}, r"Plan data has no \['stages'\]"),
        (lambda d: {**d, "foo": 1}, r"Plan data has unknown fields \['foo'\]"),
        (lambda d: {**d, "num_microbatches": "2"}, "Plan data has a field of the wrong type"),
        (lambda d: {**d, "stages": [{**d["stages"][0], "x": 1}]}, r"Plan data stages\[0\] has unknown .*'x'"),
        (lambda d: {**d, "version": 99}, "Plan format version 99 is not supported"),
    ],
)
def test_a_malformed_plan_file_is_a_value_error_naming_it(tmp_path, edit, message):
    plan = autopar.Plan(
        num_microbatches=2,
        schedule="1f1b",
        cuts=(),
        layer_flops=(1.0,),
        stages=(
            autopar.StagePlan(
                layers=(0, 1), device_ids=(0, 1), mesh_shape=(2,), axis_names=("data",), forward_flops=1.0
            ),
        ),
    )
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(edit(plan.to_dict())))
    with pytest.raises(ValueError, match=f"{path}: {message}"):
        autopar.Plan.load(str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"{path} is not a plan JSON file"):
        autopar.Plan.load(str(path))
