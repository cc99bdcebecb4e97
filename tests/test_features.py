"""Runtime features beyond the basic matrix: shared parameters, cross-stage
update reductions, model styles users bring, errors, transfers and buffers."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from equality import OPTIMIZERS, TOLERANCES, as_numpy, assert_same_as_jit, nnx_classifier
from flax import nnx

import autopar
from autopar._src.program import Transfer
from models import train

BATCH = 16


def _gpt(api="linen", opt="adamw", **overrides):
    config = train.tiny_config("gpt", **overrides)
    step, state = train.setup("gpt", api, config, OPTIMIZERS[opt]())
    batches = [train.make_batch("gpt", config, BATCH, seed=i) for i in range(3)]
    return step, state, batches


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_tied_embeddings_across_stages(api):
    step, state, batches = _gpt(api, tie_embeddings=True)
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["adamw"], num_stages=4, num_microbatches=4, schedule="1f1b"
    )
    exe = par.executable(state, batches[0])
    # The embedding table is read by the first stage (lookup) and the last (logits).
    leaves = jax.tree.leaves(state)
    table = next(i for i, x in enumerate(leaves) if np.shape(x) == (128, 64))
    var = exe.step.arg_vars[table]
    assert set(exe.program.input_stages[(var, None)]) == {0, 3}


def test_global_norm_clipping_across_stages():
    config = train.tiny_config("gpt")
    clip = 0.05
    tx = optax.chain(optax.clip_by_global_norm(clip), optax.sgd(0.5))
    step, state = train.setup("gpt", "linen", config, tx)
    batches = [train.make_batch("gpt", config, BATCH, seed=i) for i in range(3)]

    # Clipping is active: the unclipped gradient norm is well above the threshold.
    def loss(p):
        return train._loss("gpt", lambda x: state.apply_fn({"params": p}, x), batches[0])

    assert optax.tree.norm(jax.grad(loss)(state.params)) > 10 * clip
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["sgd"], num_stages=4, num_microbatches=2, schedule="gpipe"
    )
    # The global norm sums squares from every stage: some update task reads a value
    # made on another stage after the pipeline.
    exe = par.executable(state, batches[0])
    post = [i for i, t in enumerate(exe.program.tasks) if "post" in t.label]
    assert len({exe.program.tasks[i].stage for i in post}) == 4
    first_post = min(post)
    later = exe.program.instrs[
        [n for n, ins in enumerate(exe.program.instrs) if getattr(ins, "task", -1) == first_post][0] :
    ]
    assert any(isinstance(ins, Transfer) for ins in later)


@pytest.mark.parametrize(
    "overrides,num_stages", [({"remat": True}, 2), ({"scan_layers": True, "remat": True}, 2)]
)
def test_remat_and_scanned_layer_stacks(overrides, num_stages):
    step, state, batches = _gpt("linen", "sgd", **overrides)
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=num_stages, num_microbatches=2)


class _BNNet(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(32, 64, rngs=rngs)
        self.bn = nnx.BatchNorm(64, rngs=rngs)
        self.b = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.relu(self.bn(self.a(x))))


def test_nnx_batchnorm_state_is_updated():
    step, state = nnx_classifier(_BNNet(nnx.Rngs(0)), optax.sgd(0.1))
    config = train.tiny_config("mlp")
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]
    par = assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=1)
    new_state, _ = par(state, batches[0])
    mean = new_state[0]["bn"]["mean"].get_value()
    assert not np.allclose(as_numpy(mean), 0.0)  # running statistics moved


# -- errors ----------------------------------------------------------------------------------


def _assert_refused_with_microbatches(step, state, batch, match):
    """``step`` is an error naming ``match`` with 2 microbatches, and equals jit with one."""
    with pytest.raises(ValueError, match=match):
        autopar.autoparallel(step, num_stages=2, num_microbatches=2)(state, batch)
    assert_same_as_jit(step, state, [batch], TOLERANCES["sgd"], num_stages=2, num_microbatches=1)


def _mlp_step():
    config = train.tiny_config("mlp")
    step, state = train.setup("mlp", "linen", config, optax.sgd(0.1))
    return step, state, train.make_batch("mlp", config, BATCH)


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(num_microbatches=3), "batch size 16 is not divisible by num_microbatches=3"),
        (dict(num_stages=16), "num_stages=16 is more than the 8 devices"),
        (dict(num_stages=3), "8 devices cannot be split evenly among num_stages=3"),
        (dict(num_stages=8), "4 heavy operations .* but 8 layers"),
        (dict(batch_argnums=(5,)), r"batch_argnums=\(5,\) names argument 5"),
    ],
)
def test_bad_input_is_a_clear_error_before_any_work(options, message):
    step, state, batch = _mlp_step()
    before = [np.array(x) for x in jax.tree.leaves(state)]
    par = autopar.autoparallel(step, **options)
    with pytest.raises(ValueError, match=message):
        par(state, batch)
    # Inputs are untouched and still usable.
    for a, b in zip(before, jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    jax.jit(step)(state, batch)


def test_a_step_taking_the_batch_first_without_batch_argnums_is_an_error_naming_them():
    step, state, batch = _mlp_step()

    def swapped(batch, state):
        return step(state, batch)

    with pytest.raises(
        ValueError,
        match=r"argument 1.step is a scalar.*Is the batch another argument\? batch_argnums names it",
    ):
        autopar.autoparallel(swapped)(batch, state)
    _, loss = autopar.autoparallel(swapped, batch_argnums=0, num_microbatches=2)(batch, state)
    np.testing.assert_allclose(loss, jax.jit(swapped)(batch, state)[1], **TOLERANCES["sgd"])


def test_a_batch_leaf_with_several_rows_per_example_is_an_error_naming_the_layout_to_use():
    step, state, batch = _mlp_step()
    captions = np.zeros((5 * BATCH, 4), np.float32)  # five per example, flattened
    with pytest.raises(ValueError, match=r"disagree on the batch size: \[16, 80\].*as \[batch, 5, \.\.\.\]"):
        autopar.autoparallel(step)(state, {**batch, "captions": captions})


def test_a_batch_size_written_in_the_code_is_an_error_naming_it_with_microbatches():
    """autopar traces the step at one microbatch: a reshape to ``8 * seq`` rows fails there."""
    w = jnp.eye(4) * 0.5

    def step(w, batch):
        def loss_fn(w):
            h = jnp.tanh(batch["x"] @ w).reshape(8 * 3, 4) @ w  # the batch size, 8, as a number
            return jnp.mean(h**2)

        loss, grad = autopar.value_and_grad(loss_fn)(w)
        return w - 0.1 * grad, loss

    batch = {"x": jnp.ones((8, 3, 4))}
    with pytest.raises(
        ValueError, match=r"traced with 2 rows in place of the batch's 8.*cannot reshape.*x\.reshape\(-1, d\)"
    ):
        autopar.autoparallel(step, num_stages=1, num_microbatches=4)(w, batch)
    assert_same_as_jit(step, w, [batch], TOLERANCES["sgd"], num_stages=1, num_microbatches=1)


def test_a_row_per_example_kept_outside_the_batch_is_an_error_naming_it_with_microbatches():
    """A recurrent state carried between steps in the state (truncated backpropagation through
    time) has a row per example but is not split: the error names it and says to pass it in the
    batch."""
    w = jnp.eye(4) * 0.5

    def step(state, batch):
        def loss_fn(w):
            h = jnp.tanh(batch["x"] @ w + state["carry"])
            return jnp.mean(h**2), jax.lax.stop_gradient(h)

        (loss, carry), grad = autopar.value_and_grad(loss_fn, has_aux=True)(state["w"])
        return {"w": state["w"] - 0.1 * grad, "carry": carry}, loss

    state, batch = {"w": w, "carry": jnp.zeros((8, 4))}, {"x": jnp.ones((8, 4))}
    with pytest.raises(
        ValueError,
        match=r"At 8 rows it traces\. Arrays outside the batch have 8 rows too \(args\[0\]\['carry'\]\)"
        r".*pass it in.* Otherwise it takes the batch size from elsewhere",
    ):
        autopar.autoparallel(step, num_stages=1, num_microbatches=4)(state, batch)
    assert_same_as_jit(step, state, [batch], TOLERANCES["sgd"], num_stages=1, num_microbatches=1)


def test_two_gradients_are_an_error_naming_them_before_the_second_is_cut_into_layers():
    """The second loss reads ``x[8:]``, which one microbatch of 8 rows has none of."""

    def loss_of(w, x):
        return jnp.mean(jnp.tanh(jnp.tanh(x @ w) @ w))

    def step(w, batch):
        first, g1 = autopar.value_and_grad(loss_of)(w, batch["x"][:8])
        second, g2 = autopar.value_and_grad(loss_of)(w, batch["x"][8:])
        return w - 0.1 * (g1 + g2), first + second

    w, batch = jnp.eye(4), {"x": jnp.ones((16, 4))}
    with pytest.raises(ValueError, match="calls autopar.value_and_grad/grad more than once"):
        autopar.autoparallel(step, num_stages=2, num_microbatches=2)(w, batch)


def test_a_gradient_in_each_branch_of_a_cond_runs_whole_as_jit():
    def loss_of(w, x):
        return jnp.mean(jnp.tanh(jnp.tanh(x @ w) @ w))

    def step(w, batch):
        x = batch["x"]
        loss, grad = jax.lax.cond(
            x.sum() > 0,
            lambda: autopar.value_and_grad(loss_of)(w, x),
            lambda: autopar.value_and_grad(loss_of)(w, -x),
        )
        return w - 0.1 * grad, loss

    batches = [{"x": jax.random.normal(jax.random.key(i), (16, 4))} for i in range(2)]
    assert_same_as_jit(step, jnp.eye(4), batches, TOLERANCES["sgd"], num_microbatches=1)


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(num_microbatches=0), "num_microbatches must be a positive int or .auto., got 0"),
        (dict(num_stages=0), "num_stages must be a positive int or 'auto', got 0"),
        (dict(schedule="zero-bubble"), "schedule='zero-bubble' is not one of"),
        (dict(num_stages=True), "num_stages must be a positive int or 'auto', got True"),
        (dict(cost_model="measured", num_microbatches="auto"), "measured' needs num_microbatches as an int"),
        (dict(devices=[0, 1]), "devices must be jax devices .*, got 0"),
        (dict(devices=jax.devices()[:2] * 2), r"devices lists device ids \[0, 1\] more than once"),
        (dict(cluster=8), "cluster must be an autopar.ClusterSpec or a string such as '2x8xH100', got 8"),
        (dict(cluster="8xH100"), "8xH100"),
        (dict(static_argnums=("mode",)), r"static_argnums must be ints, got \('mode',\)"),
    ],
)
def test_bad_options_fail_at_decoration(options, message):
    with pytest.raises(ValueError, match=message):
        autopar.autoparallel(lambda s, b: s, **options)


def test_autopar_grad_under_vmap_or_scan_runs_as_a_plain_gradient():
    # Per-example gradients (DP-SGD clipping) take autopar.grad under vmap; gradient
    # accumulation takes it under scan. Neither can be pipelined: one stage, one microbatch.
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))

    def example_loss(p, x, y):
        logits = state.apply_fn({"params": p}, x[None])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y[None]).mean()

    def clipped(state, batch):
        grads = jax.vmap(autopar.grad(example_loss), in_axes=(None, 0, 0))(
            state.params, batch["x"], batch["y"]
        )
        scale = jnp.minimum(1.0, 1.0 / (jax.vmap(optax.tree.norm)(grads) + 1e-6))
        grads = jax.tree.map(lambda g: jnp.tensordot(scale, g, 1) / scale.shape[0], grads)
        return state.apply_gradients(grads=grads), scale.mean()

    def accumulated(state, batch):
        halves = jax.tree.map(lambda a: a.reshape(2, -1, *a.shape[1:]), batch)

        def add(acc, half):
            grads = autopar.grad(
                lambda p: jax.vmap(example_loss, (None, 0, 0))(p, half["x"], half["y"]).mean()
            )
            return jax.tree.map(jnp.add, acc, grads(state.params)), None

        grads, _ = jax.lax.scan(add, jax.tree.map(jnp.zeros_like, state.params), halves)
        return state.apply_gradients(grads=jax.tree.map(lambda g: g / 2, grads)), jnp.zeros(())

    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]
    for step in (clipped, accumulated):
        assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=1, num_microbatches=1)
    with pytest.raises(
        ValueError, match=r"calls it inside scan \(at .*test_features.* accumulating gradients"
    ):
        autopar.autoparallel(accumulated, num_stages=2, num_microbatches=2)(state, batches[0])


@pytest.mark.parametrize("sharding", ["auto", "data"])
def test_per_example_gradients_of_a_convolution_equal_jit(sharding):
    """vmap of a convolution's gradient makes a grouped convolution (the examples as feature
    groups) whose input comes split along the batch: its operands are pinned to the layout
    the ILP priced. Left to XLA, the partitioner reshards it into a program its own verifier
    rejects ("Expected instruction to have shape equal to f32[3,3,1,4]")."""

    def example_loss(w, x):
        y = jax.lax.conv_general_dilated(
            x[None], w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return jnp.mean(jnp.tanh(y) ** 2)

    def step(w, batch):
        grads = jax.vmap(autopar.grad(example_loss), in_axes=(None, 0))(w, batch["x"])
        scale = jnp.minimum(1.0, 1.0 / (jnp.sqrt(jnp.sum(grads**2, axis=(1, 2, 3, 4))) + 1e-6))
        return w - 0.1 * jnp.tensordot(scale, grads, 1) / scale.shape[0], scale.mean()

    w = jax.random.normal(jax.random.key(0), (3, 3, 1, 4)) * 0.3
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(8, 8, 8, 1)).astype(np.float32)} for _ in range(2)]
    assert_same_as_jit(
        step, w, batches, TOLERANCES["sgd"], num_stages=1, num_microbatches=1, sharding=sharding
    )


def test_plain_jax_grad_runs_with_one_microbatch_and_errors_with_more():
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))

    def step(state, batch):
        def loss_fn(p):
            return train._loss("mlp", lambda x: state.apply_fn({"params": p}, x), batch)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=1, num_microbatches=1)
    with pytest.raises(ValueError, match="need the step to compute its gradient with autopar.value_and_grad"):
        autopar.autoparallel(step, num_microbatches=2)(state, batches[0])

    # An evaluation step computes no gradient: the options name what the user gave.
    def evaluate(state, batch):
        return train._loss("mlp", lambda x: state.apply_fn({"params": state.params}, x), batch)

    with pytest.raises(
        ValueError, match=r"num_stages=auto need .*\(an evaluation step\) has nothing to pipeline"
    ):
        autopar.autoparallel(evaluate, num_stages="auto", num_microbatches=2)(state, batches[0])
    np.testing.assert_allclose(
        np.asarray(autopar.autoparallel(evaluate)(state, batches[0])),
        np.asarray(jax.jit(evaluate)(state, batches[0])),
        **TOLERANCES["sgd"],
    )


# -- structure ---------------------------------------------------------------------------------


def test_data_parallel_stages_all_reduce_gradients_once_per_step():
    step, state, batch = _mlp_step()
    par = autopar.autoparallel(step, num_stages=2, num_microbatches=2, sharding="data")
    exe = par.executable(state, batch)
    par(state, batch)
    all_reduces: dict[tuple[str, int], int] = {}
    for i, (task, fn) in enumerate(zip(exe.program.tasks, exe.fns, strict=True)):
        kind = ("F+B" if "+B" in task.label else task.label[0]) if task.repeated else "once"
        n = fn.lower(*exe.abstract_inputs(i)).compile().as_text().count("all-reduce(")
        all_reduces[(kind, task.stage)] = all_reduces.get((kind, task.stage), 0) + n
    # The first stage's forwards need no collective, nor its backwards, which keep their
    # gradients' partial sums. The last stage runs each microbatch's forward and backward as
    # one task, which all-reduces only the batch mean of the loss: once per microbatch, as
    # the loss's own gradient needs no collective. Each stage's once-per-step tasks
    # all-reduce the sums.
    assert set(all_reduces) == {("F", 0), ("B", 0), ("F+B", 1), ("once", 0), ("once", 1)}
    assert all_reduces[("F", 0)] == 0 and all_reduces[("B", 0)] == 0
    assert all_reduces[("F+B", 1)] == 2  # two microbatches, one loss mean each
    assert all_reduces[("once", 0)] >= 1 and all_reduces[("once", 1)] >= 1


ALIAS = re.compile(r"\{(\d+)\}: \((\d+), \{\}, may-alias\)")


@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(1, 1), (2, 2)])
def test_donated_state_leaves_give_their_buffers_to_their_own_new_values(num_stages, num_microbatches):
    # GPT's attention kernels share one shape, so pairing donated inputs with outputs by shape
    # alone would give a kernel's buffer to another's update and make XLA copy it first.
    step, state, batches = _gpt("linen", "adamw")
    par = autopar.autoparallel(
        step, num_stages=num_stages, num_microbatches=num_microbatches, donate_argnums=0, sharding="data"
    )
    exe = par.executable(state, batches[0])
    in_paths, out_paths = exe.step.input_paths(), exe.step.output_paths()
    arg_index = {v: i for i, v in enumerate(exe.step.arg_vars)}
    out_index = {k: o for o, k in enumerate(exe.program.output_keys) if isinstance(k, tuple)}
    pairs = []
    for i, (task, fn) in enumerate(zip(exe.program.tasks, exe.fns, strict=True)):
        header = fn.lower(*exe.abstract_inputs(i)).compile().as_text().splitlines()[0]
        for out, arg in ALIAS.findall(header):
            var = task.in_keys[int(arg)][0]
            if var in arg_index:
                made = task.out_keys[exe.out_orders[i][int(out)]]
                pairs.append((in_paths[arg_index[var]], out_paths[out_index[made]]))
    param_leaves = len(jax.tree.leaves(state.params))
    assert len(pairs) >= 3 * param_leaves  # every parameter and both Adam moments
    assert all(a == b for a, b in pairs), [p for p in pairs if p[0] != p[1]][:3]


def test_buffers_are_freed_after_the_step():
    step, state, batches = _gpt("linen", "sgd")
    par = autopar.autoparallel(step, num_stages=2, num_microbatches=4)
    out = par(state, batches[0])
    jax.block_until_ready(out)
    del out
    baseline = len(jax.live_arrays())
    out = par(state, batches[1])
    jax.block_until_ready(out)
    # Only the step's outputs (new state and loss) remain alive.
    assert len(jax.live_arrays()) - baseline == len(jax.tree.leaves(out))


def test_donated_state_is_reused_and_survives_a_failing_call():
    config = train.tiny_config("mlp")
    step, state = train.setup("mlp", "linen", config, optax.adamw(1e-2, eps=1e-5))
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]
    par = autopar.autoparallel(step, num_stages=2, num_microbatches=2, donate_argnums=0)
    ref = jax.jit(step)
    s_ref = state
    for b in batches:
        s_ref, _ = ref(s_ref, b)
    # The first call copies the caller's host-side state onto the stages; later calls
    # get the state autopar returned, already in place, and reuse its buffers.
    s1, _ = par(state, batches[0])
    params_before = jax.tree.leaves(s1.params)
    # A failing call (batch of 15 rows cannot make 2 microbatches) leaves s1 intact.
    bad = {k: v[:15] for k, v in batches[1].items()}
    with pytest.raises(ValueError, match="not divisible by num_microbatches=2"):
        par(s1, bad)
    assert not any(x.is_deleted() for x in params_before)
    s2, _ = par(s1, batches[1])
    assert all(x.is_deleted() for x in params_before)  # donated to the new parameters
    # Passing the donated state again is an error naming a leaf (XLA would crash), raised
    # before anything runs: s2 stays valid.
    with pytest.raises(ValueError, match=r"Argument \[0\]\.\S+ is a deleted array"):
        par(s1, batches[2])
    s3, _ = par(s2, batches[2])
    for a, b in zip(jax.tree.leaves(s3), jax.tree.leaves(s_ref), strict=True):
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["adamw"])

    # One array donated twice (a state holding s3 twice), as jit refuses it.
    def train_first(pair, batch):
        return (step(pair[0], batch)[0], pair[1]), 0.0

    with pytest.raises(ValueError, match=r"\[0\]\[1\]\S* are the same array, and donate_argnums donates"):
        autopar.autoparallel(train_first, num_stages=2, num_microbatches=2, donate_argnums=0)(
            (s3, s3), batches[0]
        )


def test_a_donated_state_also_fetched_to_the_host_is_an_error_when_passed_again():
    """A state fetched with jax.device_get (logged, checkpointed) and then donated may still read
    as alive once its buffers are consumed; running on it again crashed the process. The call
    deletes what it was donated, so passing it again is the deleted-array error."""
    config = train.tiny_config("mlp")
    step, state = train.setup("mlp", "linen", config, optax.sgd(0.1))
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(2)]
    par = autopar.autoparallel(step, num_stages=2, num_microbatches=4, donate_argnums=0)
    s1, _ = par(state, batches[0])
    host = jax.device_get(s1)
    s2, _ = par(s1, batches[1])
    assert all(x.is_deleted() for x in jax.tree.leaves(s1) if isinstance(x, jax.Array))
    with pytest.raises(ValueError, match=r"Argument \[0\]\.\S+ is a deleted array"):
        par(s1, batches[1])
    assert not any(x.is_deleted() for x in jax.tree.leaves(s2))
    assert jax.tree.structure(host) == jax.tree.structure(s1)
    jax.device_get(s2)  # the same through a timed call
    (s3, _), _ = par.timed(s2, batches[0])
    assert all(x.is_deleted() for x in jax.tree.leaves(s2) if isinstance(x, jax.Array))
    assert not any(x.is_deleted() for x in jax.tree.leaves(s3))


def test_donated_state_the_step_returns_unchanged_stays_alive():
    # inject_hyperparams keeps its constant hyperparameters in the optimizer state and returns
    # them as they came: the caller's arrays, which must not be donated to a task's output.
    config = train.tiny_config("mlp")
    opt = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, eps=1e-5)
    step, state = train.setup("mlp", "linen", config, opt)
    state = jax.device_put(state)
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]
    par = autopar.autoparallel(step, num_stages=2, num_microbatches=2, donate_argnums=0)
    s_ref, losses = state, []
    for b in batches:  # first: autopar donates the caller's state
        s_ref, loss = jax.jit(step)(s_ref, b)
        losses.append(loss)
    s_par = state
    for b, loss_ref in zip(batches, losses, strict=True):
        s_par, loss_par = par(s_par, b)
        assert not any(x.is_deleted() for x in jax.tree.leaves(s_par))
        np.testing.assert_allclose(np.asarray(loss_par), np.asarray(loss_ref), **TOLERANCES["adamw"])
    for a, b in zip(jax.tree.leaves(s_par), jax.tree.leaves(s_ref), strict=True):
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["adamw"])


@pytest.mark.parametrize("where", ["before", "feeding", "filled", "after"])
def test_whole_batch_values_outside_the_gradient_equal_jit_with_microbatches(where):
    """What the step makes from the batch outside the loss function for its outputs or after the
    gradient runs once per step at the whole batch, as jax.jit runs it; what also feeds the loss
    runs per microbatch as well."""
    step, state, batch = _mlp_step()

    def counted(state, batch):
        if where == "before":  # returned: one microbatch's count, were it made per microbatch
            count = jnp.sum(batch["x"] > 0)
            return *step(state, batch), count
        if where == "feeding":
            x = jnp.abs(batch["x"])
            new, loss = step(state, {**batch, "x": x})
            return new, loss, jnp.sum(x > 0.5)
        if where == "filled":  # jnp.where broadcasts its -1.0 to the batch's shape: a fill
            x = jnp.where(batch["x"] > 0, batch["x"], -1.0)
            new, loss = step(state, {**batch, "x": x})
            return new, loss, jnp.sum(x != -1.0)
        new, loss = step(state, batch)
        scale = jnp.mean(batch["x"] ** 2)  # read by the update
        return new.replace(params=jax.tree.map(lambda p: p * scale, new.params)), loss

    batches = [batch, jax.tree.map(lambda x: x[::-1] * 0.5 if x.dtype == np.float32 else x, batch)]
    par = autopar.autoparallel(counted, num_stages=2, num_microbatches=4)
    state_par = state_ref = state
    for b in batches:
        (state_par, *out_par), (state_ref, *out_ref) = par(state_par, b), jax.jit(counted)(state_ref, b)
        for a, r in zip(
            jax.tree.leaves((state_par, out_par)), jax.tree.leaves((state_ref, out_ref)), strict=True
        ):
            assert a.shape == r.shape and a.dtype == r.dtype
            np.testing.assert_allclose(as_numpy(a), as_numpy(r), **TOLERANCES["sgd"])
    if where == "before":  # the whole batch's count, not a microbatch's
        assert int(out_par[-1]) == int(np.sum(batches[-1]["x"] > 0)) > int(np.sum(batches[-1]["x"][:4] > 0))
    if where == "feeding":
        assert int(out_par[-1]) == int(np.sum(np.abs(batches[-1]["x"]) > 0.5))
    if where == "filled":
        assert int(out_par[-1]) == int(np.sum(batches[-1]["x"] > 0))
    assert par.plan(state, batch).num_microbatches == 4


def test_whole_batch_code_that_changes_with_the_batch_size_is_an_error_with_microbatches():
    step, state, batch = _mlp_step()

    def shaped(state, batch):
        new, loss = step(state, batch)
        x = batch["x"]
        if x.shape[0] > 8:  # Python that sees the batch size: another equation for the whole batch
            x = jnp.tanh(x)
        return new, loss, jnp.mean(x)

    differs = r"computes reduce_sum from the batch outside the loss function \(at .*test_features.py"
    with pytest.raises(ValueError, match=differs + r".*num_microbatches=2 in more than shapes"):
        autopar.autoparallel(shaped, num_stages=2, num_microbatches=2)(state, batch)
    ref, got = jax.jit(shaped)(state, batch), autopar.autoparallel(shaped, num_stages=2)(state, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["sgd"])


@pytest.mark.parametrize(
    "mix",
    [
        lambda x: 0.7 * x + 0.3 * jnp.roll(x, 1, axis=0),  # mixup with the next example
        lambda x: x + 0.1 * x[::-1],  # an example's mirror in the batch
        lambda x: jnp.cumsum(x, axis=0) / 16,
        lambda x: jnp.concatenate(jnp.split(x, 2)[::-1]),  # the batch's halves swapped
        lambda x: x + 0.01 * jnp.sort(x, axis=0),
        lambda x: x.at[0].set(0.0),  # the batch's first example, by position
        lambda x: jax.lax.dynamic_update_slice(x, jnp.zeros((2, x.shape[1])), (1, 0)),
        # mixup's partner by a random permutation of the batch, and a mirror by gathered positions
        lambda x: 0.7 * x + 0.3 * x[jax.random.permutation(jax.random.key(0), x.shape[0])],
        lambda x: x + 0.1 * x[jnp.arange(x.shape[0])[::-1]],
        # inside a loop's or a cond's body
        lambda x: jax.lax.scan(lambda c, _: (c + 0.1 * c[::-1], None), x, None, length=2)[0],
        lambda x: jax.lax.cond(x.sum() > -1e9, lambda c: c + 0.1 * jnp.roll(c, 1, 0), lambda c: c, x),
        # a Python loop over the rows: each with its neighbour, in reverse, the first row for all
        lambda x: jnp.stack([x[i] + 0.1 * x[i - 1] for i in range(x.shape[0])]),
        lambda x: jnp.stack(list(x)[::-1]),
        lambda x: x + 0.1 * list(x)[0],
    ],
    ids=[
        "roll",
        "rev",
        "cumsum",
        "halves",
        "sort",
        "scatter",
        "update-slice",
        "permutation",
        "gathered-rev",
        "rev-in-scan",
        "roll-in-cond",
        "loop-neighbours",
        "loop-reversed",
        "loop-first-row",
    ],
)
def test_code_before_the_gradient_that_combines_examples_is_an_error_with_microbatches(mix):
    """Run per microbatch, it would see one microbatch's examples: not jax.jit's result."""
    step, state, batch = _mlp_step()

    def mixed(state, batch):
        return step(state, {**batch, "x": mix(batch["x"])})

    with pytest.raises(ValueError, match=r"code before the gradient combines examples .*num_microbatches=2"):
        autopar.autoparallel(mixed, num_stages=2, num_microbatches=2)(state, batch)
    ref, got = jax.jit(mixed)(state, batch), autopar.autoparallel(mixed, num_stages=2)(state, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["sgd"])


@pytest.mark.parametrize(
    "per_row",
    [
        lambda batch: jnp.stack([jnp.tanh(row) for row in batch["x"]]),
        lambda batch: jnp.stack([row * (y + 1) for row, y in zip(batch["x"], batch["y"], strict=True)]),
        lambda batch: jnp.stack([batch["x"][i] * 2 for i in range(batch["x"].shape[0])]),
    ],
    ids=["rows", "rows-with-labels", "rows-by-index"],
)
def test_a_python_loop_over_the_rows_before_the_gradient_equals_jit_with_microbatches(per_row):
    """Each row taken one by one, made into its own, and put back in its place: each example's."""
    step, state, batch = _mlp_step()

    def looped(state, batch):
        return step(state, {**batch, "x": per_row(batch)})

    assert_same_as_jit(looped, state, [batch], TOLERANCES["sgd"], num_stages=2, num_microbatches=2)


def test_a_sort_along_each_example_before_the_gradient_equals_jit_with_microbatches():
    """``jnp.argsort(..., axis=1)`` before the loss function sorts with an iota counting along
    the sequence, in the batch's shape: each microbatch's rows of the whole batch's, a fill
    (before, refused as reading the batch's shape)."""

    def step(p, batch):
        labelled = jnp.argsort(batch["labels"] == -100, axis=1, stable=True)[:, :3]  # labelled first

        def loss_fn(p):
            h = jnp.take_along_axis(jnp.tanh(batch["x"] @ p["w1"]), labelled[..., None], axis=1)
            target = jnp.take_along_axis(batch["labels"], labelled, axis=1)
            valid = (target != -100).astype(jnp.float32)
            return jnp.sum(((h @ p["w2"])[..., 0] - target) ** 2 * valid) / jnp.sum(valid)

        loss, grads = autopar.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), loss

    rng = np.random.default_rng(0)
    p = {"w1": rng.normal(size=(4, 16)) * 0.3, "w2": rng.normal(size=(16, 1)) * 0.3}
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)
    batches = [
        {
            "x": rng.normal(size=(16, 8, 4)).astype(np.float32),
            "labels": np.where(rng.random((16, 8)) < 0.3, rng.integers(0, 5, (16, 8)), -100).astype(np.int32),
        }
        for _ in range(2)
    ]
    assert_same_as_jit(step, p, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=4)


def test_feature_slices_before_the_gradient_with_one_example_per_microbatch_equal_jit():
    """With one example per microbatch a slice of its features is one row wide along the batch:
    the whole microbatch, not a row taken by place."""
    step, state, batch = _mlp_step()

    def sliced(state, batch):
        x = batch["x"]
        return step(state, {**batch, "x": jnp.concatenate([x[:, :16] * 2, x[:, 16:]], 1)})

    assert_same_as_jit(
        sliced, state, [batch], TOLERANCES["sgd"], num_stages=2, num_microbatches=len(batch["y"])
    )


def _above_the_median(losses):
    threshold = jax.lax.stop_gradient(jnp.median(losses))  # the examples above the batch's median
    kept = (losses >= threshold).astype(losses.dtype)
    return jnp.sum(losses * kept) / jnp.sum(kept)


def _causal_conv_along_the_batch(x):
    """A depthwise causal convolution whose window runs along ``x``'s leading dim."""
    kernel = jnp.full((x.shape[1], 1, 3), 0.3, x.dtype)
    lhs = x.T[None]  # (1, features, rows): the rows are the convolution's spatial dim
    return jax.lax.conv_general_dilated(lhs, kernel, (1,), ((2, 0),), feature_group_count=x.shape[1])[0].T


def _rows_rebuilt(kind, x):
    """``x`` remade row by row, each row from itself alone."""
    if kind == "fori-buffer":
        return jax.lax.fori_loop(0, x.shape[0], lambda i, a: a.at[i].set(jnp.sin(x[i])), jnp.zeros_like(x))
    if kind == "fori-in-place":
        return jax.lax.fori_loop(0, x.shape[0], lambda i, a: a.at[i].set(jnp.sin(a[i])), x)
    if kind == "scan-over-row-numbers":  # each iteration picks its row by number
        return jax.lax.scan(lambda c, i: (c, jnp.sin(x[i])), 0.0, jnp.arange(x.shape[0]))[1]
    # a scan over the rows with a counter carried alongside
    return jax.lax.scan(lambda c, r: (c + 1, jnp.sin(r)), 0, x)[1]


def _over_rows(kind, x):
    """Loops over the rows whose microbatched runs differ from the whole batch's in ways their
    form does not show: each is found by running the loop."""
    if kind == "ema":
        return jax.lax.scan(lambda c, v: (0.9 * c + 0.1 * v, None), 0.0, x)[0]
    if kind == "logsumexp":

        def online(carry, v):
            top, total = carry
            new = jnp.maximum(top, v)
            return (new, total * jnp.exp(top - new) + jnp.exp(v - new)), None

        top, total = jax.lax.scan(online, (-jnp.inf, 0.0), x)[0]
        return top + jnp.log(total)
    if kind == "key-per-row":

        def noisy(key, row):
            key, sub = jax.random.split(key)
            return key, row + 0.1 * jax.random.normal(sub, row.shape)

        return jax.lax.scan(noisy, jax.random.key(0), x)[1]
    if kind == "position":
        return jax.lax.fori_loop(0, x.shape[0], lambda i, a: a.at[i].set(a[i] * (1.0 + 0.1 * i)), x)
    if kind == "while":

        def recur(carry):
            i, a = carry
            return i + 1, a.at[i].set(jnp.tanh(a[i] + 0.5 * a[i - 1]))

        return jax.lax.while_loop(lambda carry: carry[0] < x.shape[0], recur, (1, x))[1]
    previous = jax.jit(lambda a, i: jax.lax.dynamic_index_in_dim(a, i - 1, keepdims=False))
    return jax.lax.fori_loop(
        1, x.shape[0], lambda i, a: a.at[i].set(jnp.tanh(a[i] + 0.5 * previous(a, i))), x
    )


@pytest.mark.parametrize(
    "kind", ["fori-buffer", "fori-in-place", "scan-over-row-numbers", "scan-with-counter"]
)
def test_loops_over_the_rows_that_carry_no_examples_values_into_anothers_equal_jit(kind):
    """A loop over the batch's rows inside the loss function whose carries are a counter or a
    buffer of the rows is no recurrence over the examples (those are refused above)."""
    _, state, batch = _mlp_step()

    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, _rows_rebuilt(kind, batch["x"]))
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    assert_same_as_jit(step, state, [batch], TOLERANCES["sgd"], num_stages=2, num_microbatches=2)


@pytest.mark.parametrize(
    "inputs,reduce",
    [
        (lambda x: 0.7 * x + 0.3 * jnp.roll(x, 1, axis=0), jnp.mean),  # mixup with the next example
        (lambda x: x + 0.1 * jnp.flip(x, 0), jnp.mean),
        (lambda x: x, lambda losses: jnp.split(losses, 2)[0].mean()),  # the first half's
        # along the batch, differentiated as associative scans whose depth follows the batch
        (lambda x: jax.lax.cummax(x, axis=0), jnp.mean),
        (lambda x: jax.lax.cumlogsumexp(x, axis=0), jnp.mean),
        (lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (2, 1), (1, 1), "SAME"), jnp.mean),
        (lambda x: x, lambda losses: jax.lax.top_k(losses, 4)[0].mean()),  # the hardest examples
        (lambda x: x, lambda losses: jnp.sort(losses)[-4:].mean()),
        (lambda x: x, _above_the_median),
        (lambda x: 0.7 * x + 0.3 * x[jax.random.permutation(jax.random.key(0), x.shape[0])], jnp.mean),
        # inside a loop's or a cond's body
        (lambda x: jax.lax.scan(lambda c, _: (c + 0.1 * c[::-1], None), x, None, length=2)[0], jnp.mean),
        (lambda x: jax.lax.fori_loop(0, 2, lambda i, c: 0.7 * c + 0.3 * jnp.roll(c, 1, 0), x), jnp.mean),
        (lambda x: jax.lax.cond(x.sum() > -1e9, lambda c: c + 0.1 * c[::-1], lambda c: c, x), jnp.mean),
        # along the batch as along time (time-major data): a recurrence, a running sum, a window
        (
            lambda x: jax.lax.scan(lambda h, r: (jnp.tanh(r + 0.5 * h),) * 2, jnp.zeros(x.shape[1:]), x)[1],
            jnp.mean,
        ),
        (lambda x: jax.lax.scan(lambda c, r: (c + r, c + r), jnp.zeros(x.shape[1:]), x)[1], jnp.mean),
        (lambda x: _causal_conv_along_the_batch(x), jnp.mean),
        (
            lambda x: jax.lax.fori_loop(
                1, x.shape[0], lambda i, a: a.at[i].set(jnp.tanh(a[i] + 0.5 * a[i - 1])), x
            ),
            jnp.mean,
        ),
        (
            lambda x: x,
            lambda losses: (
                losses.mean() + jax.lax.scan(lambda h, v: (jnp.tanh(v + 0.5 * h), None), 0.0, losses)[0]
            ),
        ),
        (lambda x: jax.lax.fori_loop(1, x.shape[0], lambda i, a: a.at[i].set(x[i] + x[i - 1]), x), jnp.mean),
        # found by running the loop once per microbatch: what each iteration depends on besides
        # its own rows (a key split per row, the counter as a position, a value carried through
        # a while loop or read through a nested jit), or what is carried to the end and does not
        # add up over microbatches (an exponential moving average, a running logsumexp)
        (lambda x: x, lambda losses: losses.mean() + _over_rows("ema", losses)),
        (lambda x: x, lambda losses: _over_rows("logsumexp", losses)),
        (lambda x: _over_rows("key-per-row", x), jnp.mean),
        (lambda x: _over_rows("position", x), jnp.mean),
        (lambda x: _over_rows("while", x), jnp.mean),
        (lambda x: _over_rows("nested-jit", x), jnp.mean),
    ],
    ids=[
        "roll",
        "flip",
        "first-half",
        "cummax",
        "cumlogsumexp",
        "max-pool",
        "top_k",
        "sorted",
        "median",
        "permutation",
        "flip-in-scan",
        "roll-in-loop",
        "flip-in-cond",
        "recurrence-over-rows",
        "running-sum-over-rows",
        "conv-over-rows",
        "row-from-the-previous-row",
        "rnn-final-state",
        "previous-input-row",
        "ema-to-the-end",
        "running-logsumexp",
        "key-per-row",
        "counter-as-position",
        "while-recurrence",
        "nested-jit-recurrence",
    ],
)
def test_a_loss_function_that_takes_examples_by_place_is_an_error_with_microbatches(inputs, reduce):
    """Each microbatch would take among its own examples: neither the loss nor the gradient would
    be jax.jit's."""
    _, state, batch = _mlp_step()

    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, inputs(batch["x"]))
            return reduce(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    _assert_refused_with_microbatches(
        step, state, batch, r"loss function takes examples by their place .*test_features.*num_microbatches=2"
    )


@pytest.mark.parametrize(
    "edit",
    [
        lambda x: x.at[:, 0].set(0.0),  # its update: zeros in the batch's shape
        lambda x: jax.vmap(lambda row: jax.lax.dynamic_update_slice(row, jnp.zeros(2), (1,)))(x),
        # positions per example, as a Hugging Face model's default position_ids
        lambda x: x + jnp.broadcast_to(0.01 * jnp.arange(x.shape[1], dtype=x.dtype)[None], x.shape),
        lambda x: x + jnp.tile(0.01 * jnp.arange(x.shape[1], dtype=x.dtype), (x.shape[0], 1)),
        lambda x: x * (jnp.ones(x.shape, x.dtype) + 0.01 * jnp.arange(x.shape[1], dtype=x.dtype)),
    ],
    ids=["column", "vmapped-update", "positions", "tiled-positions", "ones-plus-positions"],
)
def test_fills_in_the_batchs_shape_made_outside_the_loss_equal_jit_with_microbatches(edit):
    """A value broadcast to the batch's shape, read only by code run per microbatch, is each
    microbatch's part of the whole batch's fill."""
    step, state, batch = _mlp_step()

    def edited(state, batch):
        return step(state, {**batch, "x": edit(batch["x"])})

    ref = jax.jit(edited)(state, batch)
    got = autopar.autoparallel(edited, num_stages=2, num_microbatches=2)(state, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["sgd"])


def test_arguments_by_keyword_and_numpy_int_options_are_taken_like_jit():
    step, state, batch = _mlp_step()
    par = autopar.autoparallel(step, num_stages=np.int64(2), num_microbatches=np.int32(2))
    assert par.options.num_stages == 2 and type(par.options.num_microbatches) is int
    by_keyword, ref = par(state, batch=batch), jax.jit(step)(state, batch=batch)
    for a, b in zip(jax.tree.leaves(by_keyword), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["sgd"])
    assert par.plan(state=state, batch=batch) is par.plan(state, batch)  # one compiled program

    # Keyword-only arguments and **kwargs are passed on by name, after the others by position.
    def keyword_only(state, *, batch, scale=1.0, **extra):
        new, loss = step(state, batch)
        return new, loss * scale + sum(extra.values())

    par = autopar.autoparallel(keyword_only, num_stages=2, num_microbatches=2)
    for kwargs in (dict(batch=batch), dict(batch=batch, scale=2.0, shift=jnp.ones(()))):
        got, ref = par(state, **kwargs), jax.jit(keyword_only)(state, **kwargs)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["sgd"])

    # Negative argnums count from the last positional argument, as jax.jit's do.
    def with_mode(state, batch, mode, *, scale):
        new, loss = step(state, batch)
        return new, loss * scale if mode == "scaled" else loss

    got = autopar.autoparallel(with_mode, static_argnums=-1)(state, batch, "scaled", scale=2.0)
    ref = jax.jit(with_mode, static_argnums=-1)(state, batch, "scaled", scale=2.0)
    np.testing.assert_allclose(as_numpy(got[1]), as_numpy(ref[1]), **TOLERANCES["sgd"])
    shardings = par.input_shardings(state, batch=batch, scale=2.0)
    assert len(shardings) == 1 and jax.tree.structure(shardings[0]) == jax.tree.structure(state)
    with pytest.raises(TypeError, match="got an unexpected keyword argument 'labels'"):
        autopar.autoparallel(step)(state, batch, labels=batch)


def test_static_arguments_are_traced_as_python_values_with_a_program_for_each_like_jit():
    config = train.tiny_config("mlp")
    _, state = train.setup("mlp", "linen", config, optax.sgd(0.1))
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(2)]

    def step(mode, state, batch):  # a Python string the step branches on while traced
        def loss_fn(p):
            logits = state.apply_fn({"params": p}, batch["x"])
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return losses.mean() if mode == "mean" else losses.sum()

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    par = autopar.autoparallel(step, num_stages=2, num_microbatches=2, static_argnums=0, batch_argnums=2)
    ref = jax.jit(step, static_argnums=0)
    for mode in ("mean", "mean"):
        mine, theirs = par(mode, state, batches[0]), ref(mode, state, batches[0])
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["sgd"])
    assert par.plan("mean", state, batches[0]) is par.plan("mean", state, batches[1])  # one program
    # Another value is another step: here one whose loss is a sum, added up over microbatches.
    summed = par("sum", state, batches[0])
    assert par.plan("sum", state, batches[0]) is not par.plan("mean", state, batches[0])
    for a, b in zip(jax.tree.leaves(summed), jax.tree.leaves(ref("sum", state, batches[0])), strict=True):
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["sgd"])
    one = autopar.autoparallel(step, num_stages=2, static_argnums=(0,), batch_argnums=(2,))
    mine, theirs = one("sum", state, batches[0]), ref("sum", state, batches[0])
    np.testing.assert_allclose(np.asarray(mine[1]), np.asarray(theirs[1]), **TOLERANCES["sgd"])
    shardings = one.input_shardings("sum", state, batches[0])
    assert shardings[0] is None and len(shardings) == 3
    with pytest.raises(ValueError, match=r"static argument 0 \(list\) is not hashable"):
        par(["mean"], state, batches[0])
    with pytest.raises(ValueError, match=r"batch_argnums=\(0,\) and static_argnums name the same argument 0"):
        autopar.autoparallel(step, static_argnums=0, batch_argnums=0)("mean", state, batches[0])


def test_arguments_and_constants_passed_through_come_back_as_arrays_like_jit():
    step, state, batch = _mlp_step()
    table = np.arange(3.0, dtype=np.float32)

    def passing(state, batch, scale):
        return *step(state, batch), scale, table

    out = autopar.autoparallel(passing, num_stages=2, num_microbatches=2)(state, batch, 0.5)
    ref = jax.jit(passing)(state, batch, 0.5)
    for got, want in zip(out[2:], ref[2:], strict=True):
        assert isinstance(got, jax.Array) and (got.dtype, got.weak_type) == (want.dtype, want.weak_type)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_weak_typed_arguments_promote_as_under_jit_and_a_loop_keeps_one_program():
    # A Python float learning rate times bfloat16 gradients stays bfloat16 (a float32 array
    # would make float32 parameters); TrainState.step starts as a Python int and comes back
    # weak, as from jit, so the next call reuses the program.
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    state = state.replace(params=jax.tree.map(lambda p: p.astype(jnp.bfloat16), state.params))
    assert isinstance(state.step, int)

    def step(state, batch, lr):
        def loss_fn(p):
            logits = state.apply_fn({"params": p}, batch["x"].astype(jnp.bfloat16))
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, 2 * lr  # a weak aux output, averaged over microbatches: still weak

        (loss, twice), grads = autopar.value_and_grad(loss_fn, has_aux=True)(state.params)
        params = jax.tree.map(lambda p, g: p - lr * g, state.params, grads)
        return state.replace(params=params, step=state.step + 1), (loss, twice)

    par, s_par, s_ref = autopar.autoparallel(step, num_stages=2, num_microbatches=2), state, state
    for i in range(3):
        batch = train.make_batch("mlp", config, BATCH, seed=i)
        (s_par, loss_par), (s_ref, loss_ref) = par(s_par, batch, 0.1), jax.jit(step)(s_ref, batch, 0.1)
        for a, b in zip(jax.tree.leaves((s_par, loss_par)), jax.tree.leaves((s_ref, loss_ref)), strict=True):
            assert (a.dtype, a.weak_type) == (b.dtype, b.weak_type)
            np.testing.assert_allclose(as_numpy(a), as_numpy(b), rtol=1e-2, atol=1e-2)  # bfloat16
    assert len(par._cache) == 1
    assert jax.tree.leaves(s_par.params)[0].dtype == jnp.bfloat16


@pytest.mark.parametrize("num_stages", [1, "auto"])
def test_a_loss_without_matmuls_is_one_layer(num_stages):
    # Matrix factorisation: embedding lookups and elementwise products, nothing to cut between.
    keys = jax.random.split(jax.random.key(0), 5)
    params = {"users": jax.random.normal(keys[0], (10, 4)), "items": jax.random.normal(keys[1], (12, 4))}

    def step(params, batch):
        def loss_fn(p):
            score = jnp.sum(p["users"][batch["u"]] * p["items"][batch["i"]], -1)
            return jnp.mean((score - batch["r"]) ** 2)

        loss, grads = autopar.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    batches = [
        {
            "u": jax.random.randint(jax.random.fold_in(keys[2], i), (BATCH,), 0, 10),
            "i": jax.random.randint(jax.random.fold_in(keys[3], i), (BATCH,), 0, 12),
            "r": jax.random.normal(jax.random.fold_in(keys[4], i), (BATCH,)),
        }
        for i in range(3)
    ]
    par = assert_same_as_jit(
        step, params, batches, TOLERANCES["sgd"], num_stages=num_stages, num_microbatches=2
    )
    assert par.plan(params, batches[0]).num_layers == 1


def test_an_empty_batch_is_an_error():
    step, state, batch = _mlp_step()
    with pytest.raises(ValueError, match=r"The batch is empty: argument 1\['x'\] has 0 rows"):
        autopar.autoparallel(step, num_stages=1)(state, {k: v[:0] for k, v in batch.items()})


def test_nnx_rngs_passed_to_the_loss_function_is_updated_as_by_nnx_value_and_grad():
    class Net(nnx.Module):
        def __init__(self):
            self.a, self.b = nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.Linear(16, 4, rngs=nnx.Rngs(1))
            self.drop = nnx.Dropout(0.3)

        def __call__(self, x, rngs):
            return self.b(self.drop(jax.nn.relu(self.a(x)), rngs=rngs))

    graphdef, state = nnx.split((Net(), nnx.Rngs(dropout=7)))

    def step(state, batch):
        model, rngs = nnx.merge(graphdef, state)
        loss_fn = lambda m, r: jnp.mean((m(batch["x"], r) - batch["y"]) ** 2)  # noqa: E731
        loss, grads = autopar.value_and_grad(loss_fn)(model, rngs)  # rngs: not differentiated
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param), grads))
        return nnx.state((model, rngs)), loss

    batches = [{"x": jnp.full((BATCH, 8), i + 1.0), "y": jnp.zeros((BATCH, 4))} for i in range(3)]
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=1)
    out = autopar.autoparallel(step, num_stages=2, num_microbatches=1)(state, batches[0])[0]
    assert int(out[1]["dropout"]["count"].get_value()) == 1  # the stream advanced once, as under jit


def test_nnx_objects_shared_between_arguments_stay_shared_as_in_nnx_value_and_grad():
    # A teacher keeps the nnx.Rngs that is passed as well: one stream, advanced twice.
    class Teacher(nnx.Module):
        def __init__(self, rngs):
            self.lin, self.rngs = nnx.Linear(8, 4, rngs=nnx.Rngs(2)), rngs

        def __call__(self, x):
            return self.lin(x) + 0.01 * jax.random.normal(self.rngs.noise(), (4,))

    rngs = nnx.Rngs(noise=5)
    student = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 4, rngs=nnx.Rngs(1)))
    graphdef, state = nnx.split((student, Teacher(rngs), rngs))

    def stepping(value_and_grad):
        def step(state, batch):
            student, teacher, rngs = nnx.merge(graphdef, state)

            def loss_fn(s, t, r):
                noise = 0.01 * jax.random.normal(r.noise(), (4,))
                return jnp.mean((s(batch["x"]) - t(batch["x"]) - noise) ** 2)

            loss, grads = value_and_grad(loss_fn)(student, teacher, rngs)
            nnx.update(student, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(student, nnx.Param), grads))
            return nnx.state((student, teacher, rngs)), loss

        return step

    batch = {"x": jax.random.normal(jax.random.key(3), (BATCH, 8))}
    out = autopar.autoparallel(stepping(autopar.value_and_grad), num_stages=2)(state, batch)
    ref = jax.jit(stepping(nnx.value_and_grad))(state, batch)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["sgd"])
    assert int(out[0][1]["rngs"]["noise"]["count"].get_value()) == 2  # the teacher holds the stream


@pytest.mark.parametrize(
    "argnums, message",
    [
        ("model", r"argnums must be an int, an nnx.DiffState or a sequence of them, got 'model'"),
        (
            nnx.DiffState(1, nnx.Param),
            r"nnx.DiffState\(1, ...\) names argument 1, a ndarray, not an nnx.Module",
        ),
        ((0, nnx.DiffState(0, nnx.Param)), r"names an argument more than once"),
    ],
)
def test_argnums_that_are_no_positions_repeat_one_or_a_diff_state_of_no_module_are_clear_errors(
    argnums, message
):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(model))
    grad = autopar.value_and_grad(lambda m, x: m(x).sum(), argnums=argnums)
    with pytest.raises(ValueError, match=message):
        grad(model, np.ones((1, 2), np.float32))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(nnx.state(model)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_donate_and_batch_argnums_must_not_overlap():
    with pytest.raises(ValueError, match="overlaps batch_argnums"):
        autopar.autoparallel(lambda s, b: s, donate_argnums=(1,))
    step, state, batch = _mlp_step()
    with pytest.raises(ValueError, match=r"donate_argnums=\(-1,\) and batch_argnums=\(1,\) name the same"):
        autopar.autoparallel(step, donate_argnums=-1)(state, batch)


def test_calls_inside_transformations_or_with_shapes_only_are_errors():
    step, state, batch = _mlp_step()
    par = autopar.autoparallel(step, num_stages=2, num_microbatches=2, cluster="1x8xV100")
    assert par.options.cluster == autopar.parse_cluster("1x8xV100")
    inside = "step, decorated with autopar.autoparallel, was called inside a JAX transformation"
    with pytest.raises(ValueError, match=inside):
        jax.jit(par)(state, batch)
    with pytest.raises(ValueError, match=inside):
        jax.grad(lambda p: par(state.replace(params=p), batch)[1])(state.params)
    shapes = jax.eval_shape(lambda: state)
    with pytest.raises(
        ValueError, match=r"Argument \[0\]\.\S+ is a jax.ShapeDtypeStruct: running the step needs"
    ):
        par(shapes, batch)
    assert par.plan(shapes, batch) is par.plan(state, batch)  # planning from shapes is fine


def _with_partners(batch, seed=0):
    """``batch`` with each example's partner: a row of the whole batch, as a data pipeline
    numbers it."""
    rng = np.random.default_rng(seed)
    return {**batch, "partner": rng.permutation(len(batch["y"])).astype(np.int32)}


@pytest.mark.parametrize(
    "before,inside",
    [
        (None, lambda z, partner: 0.5 * (z + z[partner])),
        (None, lambda z, partner: 0.5 * (z + jnp.take(z, partner, axis=0))),  # in jnp's jit
        (lambda x, partner: 0.5 * (x + x[partner]), None),  # before the gradient
        (None, lambda z, partner: jax.lax.fori_loop(0, 2, lambda i, c: 0.5 * (c + c[partner]), z)),
        (
            None,
            lambda z, partner: jax.lax.cond(z.sum() > -1e9, lambda c: 0.5 * (c + c[partner]), lambda c: c, z),
        ),
        (lambda x, partner: jax.lax.fori_loop(0, 1, lambda i, c: 0.5 * (c + c[partner]), x), None),
        # after a three-operand einsum, whose contraction order differs between the traces
        (None, lambda z, partner: jnp.einsum("nd,de,ef->nf", z, jnp.eye(10), jnp.eye(10)) + z[partner]),
        # a partner or the example itself, chosen by jnp.where
        (None, lambda z, partner: 0.5 * (z + z[jnp.where(partner >= 0, partner, jnp.arange(z.shape[0]))])),
        (lambda x, partner: 0.5 * (x + x[jnp.where(partner >= 0, partner, jnp.arange(x.shape[0]))]), None),
        # the partner by a one-hot matmul
        (None, lambda z, partner: 0.5 * (z + jax.nn.one_hot(partner, z.shape[0]) @ z)),
        (lambda x, partner: 0.5 * (x + jax.nn.one_hot(partner, x.shape[0]) @ x), None),
    ],
    ids=[
        "in-loss",
        "take-in-loss",
        "before-the-gradient",
        "in-loop",
        "in-cond",
        "in-loop-before",
        "after-einsum3",
        "where-in-loss",
        "where-before",
        "one-hot-in-loss",
        "one-hot-before",
    ],
)
def test_rows_picked_by_indices_read_from_the_batch_are_an_error_with_microbatches(before, inside):
    """The batch's own integers number the whole batch's rows: a microbatch holds others."""
    _, state, batch = _mlp_step()
    batch = _with_partners(batch)

    def step(state, batch):
        x = batch["x"] if before is None else before(batch["x"], batch["partner"])

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, x)
            logits = logits if inside is None else inside(logits, batch["partner"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    _assert_refused_with_microbatches(
        step,
        state,
        batch,
        r"((takes examples by their place|combines examples) .*|compares indices )read from the batch",
    )


def test_positions_read_from_the_batch_offset_by_each_examples_row_equal_jit_with_microbatches():
    """Positions within each example (a masked LM's), made rows of the flattened batch by adding
    the example's row from an ``iota``: each microbatch's own."""
    _, state, batch = _mlp_step()
    rng = np.random.default_rng(0)
    batches = [{**batch, "pos": rng.integers(0, 10, (len(batch["y"]), 3)).astype(np.int32)} for _ in range(2)]

    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            n, k = logits.shape
            rows = (batch["pos"] + jnp.arange(n)[:, None] * k).reshape(-1)
            picked = logits.reshape(-1)[rows].reshape(n, -1)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return ce + 0.1 * jnp.mean(picked**2)

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=2)
