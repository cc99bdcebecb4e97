"""Runtime features beyond the basic matrix: shared parameters, cross-stage
update reductions, model styles users bring, errors, transfers and buffers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from equality import OPTIMIZERS, TOLERANCES, as_numpy, assert_same_as_jit
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


def test_aux_metrics_are_averaged_over_microbatches():
    config = train.tiny_config("mlp")
    tx = optax.sgd(0.1)
    state = train.linen_state("mlp", config, tx)

    def step(state, batch):
        def loss_fn(p):
            logits = state.apply_fn({"params": p}, batch["x"])
            acc = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {"acc": acc}

        (loss, aux), grads = autopar.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), (loss, aux["acc"])

    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=4)


def test_aux_outputs_per_example_are_an_error_with_microbatches():
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))

    def stepping(aux_of):
        def step(state, batch):
            def loss_fn(p):
                logits = state.apply_fn({"params": p}, batch["x"])
                loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
                return loss, aux_of(logits)

            (loss, aux), grads = autopar.value_and_grad(loss_fn, has_aux=True)(state.params)
            return state.apply_gradients(grads=grads), (loss, aux)

        return step

    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]
    per_example = stepping(lambda logits: {"logits": logits, "mean": logits.mean()})
    with pytest.raises(ValueError, match=r"Aux output 0 .* float32\[16,\d+\] for the batch but float32\[8,"):
        autopar.autoparallel(per_example, num_stages=2, num_microbatches=2)(state, batches[0])
    # Reduced over the batch, a non-scalar aux (one value per class) is averaged like a scalar.
    per_class = stepping(lambda logits: {"per_class": logits.mean(0)})
    par, s_par, s_ref = autopar.autoparallel(per_class, num_stages=2, num_microbatches=4), state, state
    for b in batches:
        (s_par, out_par), (s_ref, out_ref) = par(s_par, b), jax.jit(per_class)(s_ref, b)
        assert out_par[1]["per_class"].shape == (config.num_classes,)
        for a, r in zip(jax.tree.leaves((s_par, out_par)), jax.tree.leaves((s_ref, out_ref)), strict=True):
            np.testing.assert_allclose(as_numpy(a), as_numpy(r), **TOLERANCES["sgd"])


def test_nested_jits_dropout_and_rng_like_hugging_face():
    # Each block and the whole loss under jit; dropout keyed by an RNG carried in the
    # state and split outside the gradient (once per step).
    config = train.tiny_config("gpt", dropout_rate=0.1)
    model = train.GPT(config)
    tokens = train.make_batch("gpt", config, BATCH)["tokens"]
    params = model.init(jax.random.key(0), tokens)["params"]
    tx = optax.adamw(1e-2, eps=1e-5)
    state = (params, tx.init(params), jax.random.key(1))

    @jax.jit
    def loss_fn(p, tokens, key):
        logits = model.apply({"params": p}, tokens, deterministic=False, rngs={"dropout": key})
        return train.next_token_loss(logits, tokens)

    def step(state, batch):
        params, opt_state, key = state
        key, sub = jax.random.split(key)
        loss, grads = autopar.value_and_grad(loss_fn)(params, batch["tokens"], sub)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), loss

    batches = [train.make_batch("gpt", config, BATCH, seed=i) for i in range(3)]
    # One microbatch: the dropout masks are drawn for the same shape, so they match.
    assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], num_stages=2, num_microbatches=1)


@pytest.mark.parametrize("placed", [False, True])
def test_a_typed_key_read_on_every_stage_moves_between_them(placed):
    # The loss reads the state's key in every layer, so each step moves the new key from the
    # stage that splits it to the others (and, placed on all 8 devices, to both at the start).
    config = train.tiny_config("gpt", dropout_rate=0.1)
    model = train.GPT(config)
    batches = [train.make_batch("gpt", config, BATCH, seed=i) for i in range(3)]
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    tx = optax.adamw(1e-2, eps=1e-5)
    state = (params, tx.init(params), jax.random.key(1))
    if placed:
        everywhere = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
        state = jax.device_put(state, jax.sharding.NamedSharding(everywhere, jax.sharding.PartitionSpec()))

    def step(state, batch):
        params, opt_state, key = state

        def loss_fn(p):
            logits = model.apply({"params": p}, batch["tokens"], deterministic=False, rngs={"dropout": key})
            return train.next_token_loss(logits, batch["tokens"])

        loss, grads = autopar.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, jax.random.split(key)[0]), loss

    # One microbatch: the dropout masks are drawn for the same shape, so they match.
    assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], num_stages=2, num_microbatches=1)


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
    model = _BNNet(nnx.Rngs(0))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)))

    def step(state, batch):
        model, opt = nnx.merge(graphdef, state)

        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(batch["x"]), batch["y"]).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss

    config = train.tiny_config("mlp")
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]
    par = assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=1)
    new_state, _ = par(state, batches[0])
    mean = new_state[0]["bn"]["mean"].get_value()
    assert not np.allclose(as_numpy(mean), 0.0)  # running statistics moved


# -- errors ----------------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(num_microbatches=0), "num_microbatches must be a positive int or .auto., got 0"),
        (dict(num_stages=0), "num_stages must be a positive int or 'auto', got 0"),
        (dict(schedule="zero-bubble"), "schedule='zero-bubble' is not one of"),
        (dict(num_stages=True), "num_stages must be a positive int or 'auto', got True"),
        (dict(cost_model="measured", num_microbatches="auto"), "measured' needs num_microbatches as an int"),
    ],
)
def test_bad_options_fail_at_decoration(options, message):
    with pytest.raises(ValueError, match=message):
        autopar.autoparallel(lambda s, b: s, **options)


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


# -- structure ---------------------------------------------------------------------------------


def test_data_parallel_stage_all_reduces_only_gradients():
    step, state, batch = _mlp_step()
    par = autopar.autoparallel(step, num_stages=2, num_microbatches=2, sharding="data")
    exe = par.executable(state, batch)
    par(state, batch)
    all_reduces = {}
    for i, (task, fn) in enumerate(zip(exe.program.tasks, exe.fns, strict=True)):
        hlo = fn.lower(*exe.abstract_inputs(i)).compile().as_text()
        all_reduces[(task.label[0], task.stage)] = hlo.count("all-reduce(")
    # The first stage's forward needs no collective; the last stage's forward
    # all-reduces only the batch mean of the loss; every backward all-reduces the
    # parameter gradients.
    assert all_reduces[("F", 0)] == 0
    assert all_reduces[("F", 1)] >= 1
    assert all_reduces[("B", 0)] >= 1 and all_reduces[("B", 1)] >= 1


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
    s3, _ = par(s2, batches[2])
    for a, b in zip(jax.tree.leaves(s3), jax.tree.leaves(s_ref), strict=True):
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), **TOLERANCES["adamw"])


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


@pytest.mark.parametrize("where", ["before", "after"])
def test_whole_batch_values_outside_the_gradient_are_an_error_with_microbatches(where):
    step, state, batch = _mlp_step()

    def counted(state, batch):
        if where == "before":  # returned: it would be one microbatch's count
            count = jnp.sum(batch["x"] > 0)
            return *step(state, batch), count
        new, loss = step(state, batch)
        scale = jnp.mean(batch["x"] ** 2)  # read by the update
        return new.replace(params=jax.tree.map(lambda p: p * scale, new.params)), loss

    before = "Output \\[2\\] of the step .* before the gradient"
    message = before if where == "before" else "after the gradient"
    with pytest.raises(ValueError, match=f"{message} \\(at .*test_features.py:.*num_microbatches=2"):
        autopar.autoparallel(counted, num_stages=2, num_microbatches=2)(state, batch)
    ref, got = jax.jit(counted)(state, batch), autopar.autoparallel(counted, num_stages=2)(state, batch)
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

    def keyword_only(state, *, batch):
        return step(state, batch)

    with pytest.raises(ValueError, match=r"\['batch'\] cannot be \(keyword-only"):
        autopar.autoparallel(keyword_only)(state, batch=batch)
    with pytest.raises(TypeError, match="got an unexpected keyword argument 'labels'"):
        par(state, batch, labels=batch)


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


def test_donate_and_batch_argnums_must_not_overlap():
    with pytest.raises(ValueError, match="overlaps batch_argnums"):
        autopar.autoparallel(lambda s, b: s, donate_argnums=(1,))
