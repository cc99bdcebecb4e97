"""What the loss function returns besides the loss, with microbatches: aux outputs averaged
or concatenated per example as ``jax.jit`` of the whole batch gives them, gradients of batch
inputs, module state, and the errors for outputs microbatches cannot combine."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from equality import TOLERANCES, as_numpy, assert_same_as_jit
from flax import nnx

import autopar
from autopar._src import region_outputs
from models import train

BATCH = 16


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


def _aux_step(aux_of, after=lambda aux: aux):
    """An MLP step whose loss function returns ``aux_of(logits, labels)`` as aux; the step
    returns ``after(aux)``."""

    def step(state, batch):
        def loss_fn(p):
            logits = state.apply_fn({"params": p}, batch["x"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, aux_of(logits, batch["y"])

        (loss, aux), grads = autopar.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), (loss, after(aux))

    return step


def _assert_outputs_as_jit(step, state, batches, **options):
    par, s_par, s_ref = autopar.autoparallel(step, **options), state, state
    for b in batches:
        (s_par, out_par), (s_ref, out_ref) = par(s_par, b), jax.jit(step)(s_ref, b)
        for a, r in zip(jax.tree.leaves((s_par, out_par)), jax.tree.leaves((s_ref, out_ref)), strict=True):
            assert a.shape == r.shape and a.dtype == r.dtype
            np.testing.assert_allclose(as_numpy(a), as_numpy(r), **TOLERANCES["sgd"])
    return out_par


def _loss_step(loss_of):
    """An MLP step whose loss is ``loss_of(per-example losses, labels)``."""

    def step(state, batch):
        def loss_fn(p):
            logits = state.apply_fn({"params": p}, batch["x"])
            return loss_of(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch["y"])

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step


@jax.custom_jvp
def _custom_sum(x):
    return x.sum()


_custom_sum.defjvp(lambda primals, tangents: (_custom_sum(primals[0]), tangents[0].sum()))


@jax.custom_vjp
def _pair_gaps(x):
    """Every example's value minus every other's, by a ``custom_vjp`` function."""
    return x[:, None] - x[None, :]


_pair_gaps.defvjp(lambda x: (_pair_gaps(x), None), lambda _, g: (g.sum(1) - g.sum(0),))


def _chunk_sum(x):
    """A sum over the examples made by a ``scan`` over chunks of two."""
    return jax.lax.scan(lambda c, chunk: (c + chunk.sum(), None), 0.0, x.reshape(-1, 2))[0]


def _row_sum(x):
    """A sum over the examples made by a ``fori_loop`` (a ``scan``) over the rows."""
    return jax.lax.fori_loop(0, x.shape[0], lambda i, c: c + x[i], 0.0)


def _while_sum(x):
    """A sum over the examples made by a ``while_loop`` over the rows."""
    return jax.lax.while_loop(
        lambda c: c[0] < x.shape[0], lambda c: (c[0] + 1, c[1] + x[c[0]]), (0, jnp.zeros((), x.dtype))
    )[1]


def _stacked(total):
    """``total(losses)`` added up over a three-iteration ``scan`` (a layer stack's aux losses)."""
    # Each iteration's term reads its slice of the scanned weights: it stays in the body.
    return lambda losses, y: jax.lax.scan(lambda c, w: (c + total(losses * w), None), 0.0, jnp.ones(3))[0]


@pytest.mark.parametrize(
    "loss_of",
    [
        lambda losses, y: losses.sum() / losses.shape[0],
        lambda losses, y: jnp.dot(losses, jnp.full_like(losses, 1 / losses.shape[0])),
        # A masked mean: exact when every microbatch holds the same weight (here: none is 0).
        lambda losses, y: jnp.sum(losses * (y >= 0)) / jnp.sum(y >= 0),
        # An integer count clamped, and a guard on the batch: the ratio is still a mean.
        lambda losses, y: jnp.sum(losses * (y >= 0)) / jnp.maximum(jnp.sum(y >= 0), 1),
        lambda losses, y: jnp.where(jnp.all(jnp.isfinite(losses)), losses.mean(), 0.0),
        # Sums made inside bodies, divided by the batch size outside them.
        lambda losses, y: _custom_sum(losses) / losses.shape[0],
        lambda losses, y: jax.jit(_chunk_sum)(losses) / losses.shape[0],
        lambda losses, y: _row_sum(losses) / losses.shape[0],
        _stacked(jnp.mean),
        lambda losses, y: jax.lax.fori_loop(0, y.shape[0], lambda i, c: c + (losses[i] - c) / (i + 1), 0.0),
        lambda losses, y: _row_sum(jnp.where(y >= 0, losses, 0.0)) / y.shape[0],
        # A loop of a fixed count adding up means (a refinement loop), under stop_gradient.
        lambda losses, y: (
            losses.mean()
            + jax.lax.while_loop(
                lambda c: c[0] < 3,
                lambda c: (c[0] + 1, jnp.tanh(c[1]), c[2] + jnp.mean(c[1] ** 2)),
                (0, jax.lax.stop_gradient(losses), 0.0),
            )[2]
        ),
        # A gather with the rows' indices: jnp's index wrapping adds the batch size to them,
        # but an index places the loss's terms, it does not scale them.
        lambda losses, y: jnp.stack([losses, -losses])[y % 1, jnp.arange(y.shape[0])].mean(),
    ],
    ids=[
        "sum-over-size",
        "dot",
        "masked",
        "int-count",
        "guarded",
        "custom-jvp",
        "chunks",
        "rows",
        "stack",
        "running-mean",
        "rows-where",
        "fixed-while",
        "gathered-rows",
    ],
)
def test_losses_that_are_means_over_the_examples_equal_jit(loss_of):
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(2)]
    assert_same_as_jit(
        _loss_step(loss_of), state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=4
    )


def _hardest_negative(losses):
    """A triplet loss's hardest negative: every other example's distance but one's own."""
    gaps = (losses[:, None] - losses[None, :]) ** 2
    hardest = jnp.min(gaps + 1e3 * jnp.eye(losses.shape[0]), axis=1)
    return jnp.mean(jax.nn.relu(jnp.diagonal(gaps) - hardest + 1.0))


def _summed_like_hugging_face(state, batch):
    """Hugging Face's Flax seq2seq examples: the loss function returns the sum over the tokens and
    their count, the step divides the loss and the gradients by the count."""

    def loss_fn(p):
        logits = state.apply_fn({"params": p}, batch["x"])
        mask = batch["y"] > 2
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return jnp.sum(losses * mask), mask.sum()

    (loss, count), grads = autopar.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=jax.tree.map(lambda g: g / count, grads)), loss / count


@pytest.mark.parametrize(
    "step",
    [
        _loss_step(lambda losses, y: losses.sum()),
        # divided by the batch size of the configuration, a constant: still a sum
        _loss_step(lambda losses, y: 0.5 * losses.sum() / BATCH),
        _loss_step(lambda losses, y: 0.01 * jnp.dot(losses, losses)),
        _loss_step(lambda losses, y: jnp.sum(losses * (y > 2)) - losses.sum()),
        _aux_step(lambda logits, y: {"correct": jnp.sum(jnp.argmax(logits, -1) == y, dtype=jnp.float32)}),
        _summed_like_hugging_face,
        # Sums made inside bodies: a custom_jvp, loops over chunks or rows from zero, a layer stack.
        _loss_step(lambda losses, y: _custom_sum(losses)),
        _loss_step(lambda losses, y: _chunk_sum(losses)),
        _loss_step(lambda losses, y: _row_sum(losses)),
        _loss_step(_stacked(jnp.sum)),
        _aux_step(
            lambda logits, y: {"correct": _while_sum((jnp.argmax(logits, -1) == y).astype(jnp.float32))}
        ),
        _loss_step(lambda losses, y: -jax.lax.fori_loop(0, y.shape[0], lambda i, c: c - losses[i], 0.0)),
        _loss_step(
            lambda losses, y: jax.lax.fori_loop(
                0, y.shape[0], lambda i, c: jnp.where(y[i] > 2, c + losses[i], c), 0.0
            )
        ),
    ],
    ids=[
        "loss-sum",
        "loss-sum-over-a-constant",
        "loss-dot",
        "sums-subtracted",
        "aux-count",
        "hugging-face",
        "custom-jvp",
        "chunks",
        "rows",
        "stack",
        "aux-while",
        "rows-sub",
        "rows-where",
    ],
)
def test_losses_and_aux_outputs_that_are_sums_over_the_examples_are_added_up_and_equal_jit(step):
    """A sum over the examples of terms per example, every term of it, is the sum of the
    microbatches' sums: added up, not averaged (a summed loss's backward starts from 1 in every
    microbatch, so the gradients are the whole batch's sums too)."""
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.01))
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(2)]
    _assert_outputs_as_jit(step, state, batches, num_stages=2, num_microbatches=4)


@pytest.mark.parametrize(
    "loss_of,aux_of,message",
    [
        # a sum plus what is no sum: added up, the other term would count once per microbatch
        (
            lambda losses, y: losses.sum() + losses.mean(),
            None,
            r"The loss .* is a sum over the examples .*divided by 4.*x\.shape\[0\], not a constant",
        ),
        (
            None,
            lambda logits, y: {"correct": jnp.sum(jnp.argmax(logits, -1) == y, dtype=jnp.float32) + 1.0},
            # named by its path in the aux pytree too
            r"Aux output 0 \(\['correct'\]\) of the loss function .* is a sum over the examples \(at "
            r".*test_region_outputs.*reduce_sum",
        ),
        (
            None,
            lambda logits, y: {"max": logits.max()},
            r"Aux output 0 .* reduced over the examples by reduce_max",
        ),
        # A per-tensor scale over the whole batch meets the examples' values (quantization).
        (
            lambda losses, y: jnp.mean(jnp.round(losses / jnp.max(jnp.abs(losses), keepdims=True)) + losses),
            None,
            r"The loss .* scaled by a reduce_max over the whole batch .*per-row or per-token scale",
        ),
        (
            None,
            lambda logits, y: {"first": logits[0, 0]},
            r"takes examples by their place in the batch \(at .*test_region_outputs.*slice",
        ),
        # Sums made inside bodies that are not sums of terms per example only: a loop's running
        # sum from another start, a layer stack's that adds more than sums, a segment sum.
        (
            lambda losses, y: jax.lax.fori_loop(0, y.shape[0], lambda i, c: c + losses[i], 1.0),
            None,
            r"takes examples by their place .*runs once per microbatch, from its initial carries",
        ),
        (
            _stacked(lambda v: v.sum() + 1.0),
            None,
            r"The loss .* is a sum over the examples \(at .*reduce_sum",
        ),
        (
            None,
            lambda logits, y: {"per_class": jax.ops.segment_sum(logits[:, 0], y, num_segments=10)},
            r"Aux output 0 .* is a sum over the examples \(at .*scatter-add",
        ),
        (
            None,
            lambda logits, y: {
                "counts": jax.lax.fori_loop(
                    0, y.shape[0], lambda i, c: c.at[y[i]].add(logits[i, 0]), jnp.zeros(10)
                )
            },
            r"Aux output 0 .* is a sum over the examples \(at .*scatter-add",
        ),
        (
            None,
            lambda logits, y: {"n": jnp.asarray(y.shape[0], jnp.float32)},
            r"Aux output 0 .* is the constant 4.0 for one of num_microbatches=4 .* 16.0 for",
        ),
        (
            None,
            lambda logits, y: {
                "max": jax.lax.reduce(jax.lax.stop_gradient(logits[:, 0]), -jnp.inf, jnp.maximum, (0,))
            },
            r"Aux output 0 .* reduced over the examples by reduce",
        ),
        (
            None,
            lambda logits, y: {
                "max": jax.lax.fori_loop(0, y.shape[0], lambda i, c: jnp.maximum(c, logits[i, 0]), 0.0)
            },
            r"Aux output 0 .* reduced over the examples by",
        ),
        # Every example paired with every other (in-batch negatives): no microbatch sees them.
        (
            lambda losses, y: jax.nn.logsumexp(losses[:, None] - losses[None, :], axis=1).mean(),
            None,
            r"The loss \(float32\[\]\) pairs the examples with each other: at .*test_region_outputs.* sub",
        ),
        (
            None,
            lambda logits, y: {"contrast": jax.jit(lambda z: jax.nn.log_softmax(z @ z.T).mean())(logits)},
            r"Aux output 0 .* pairs the examples with each other: at .*test_region_outputs.*dot_general",
        ),
        (
            lambda losses, y: jax.checkpoint(
                lambda v: jax.nn.logsumexp(v[:, None] - v[None, :], axis=1).mean()
            )(losses),
            None,
            r"The loss \(float32\[\]\) pairs the examples with each other: at .*test_region_outputs.* sub",
        ),
        (
            lambda losses, y: jax.nn.logsumexp(_pair_gaps(losses), axis=1).mean(),
            None,
            r"The loss \(float32\[\]\) pairs the examples with each other: at .*test_region_outputs.* sub",
        ),
        (
            lambda losses, y: _hardest_negative(losses),
            None,
            r"pairs the examples with each other and reads the pairs' positions \(at .*test_region_outputs",
        ),
        (lambda losses, y: jnp.sqrt(losses.sum()), None, r"proportional to the batch size to the power 0.5"),
        # LSQ's gradient scale: the forward unchanged, the backward scaled by 1 / sqrt(x.size).
        (
            lambda losses, y: jnp.mean(
                jax.lax.stop_gradient(losses - losses / np.sqrt(losses.size)) + losses / np.sqrt(losses.size)
            ),
            None,
            r"square root of the batch's size \(at .*test_region_outputs.*x\[0\]\.size",
        ),
        # Each example's term scaled by a norm over the batch of what the model computes (an
        # adaptive solver's step size): a figure no microbatch makes as the whole batch does.
        (
            lambda losses, y: jnp.mean(losses / jnp.linalg.norm(jax.lax.stop_gradient(losses))),
            None,
            r"The loss .* reduces over the examples .* terms that depend on a figure over the whole "
            r"batch that is no mean \(at .*test_region_outputs.*\).*jax.vmap",
        ),
        # Divided by a sum over the examples of what the model computes: each microbatch's own.
        (
            lambda losses, y: jnp.nanmean(jnp.where(y > 2, losses, jnp.nan)),
            None,
            r"divides by a sum over the examples of what the model computes .*test_region_outputs.*"
            r"nanmean.*where=m",
        ),
        (
            lambda losses, y: 1 - jnp.sum(losses * (y > 2)) / jnp.sum(losses + (y > 2)),
            None,
            r"divides by a sum over the examples of what the model computes",
        ),
    ],
    ids=[
        "loss-sum-plus-a-mean",
        "aux-count-plus-one",
        "aux-max",
        "loss-per-tensor-scale",
        "aux-first-example",
        "rows-from-one",
        "stack-plus-one",
        "aux-segment-sum",
        "aux-rows-scatter",
        "aux-batch-size",
        "aux-lax-reduce-max",
        "aux-row-max",
        "loss-pairs",
        "aux-pairs-in-jit",
        "loss-pairs-in-checkpoint",
        "loss-pairs-in-custom-vjp",
        "loss-hardest-negative",
        "loss-sqrt-of-sum",
        "gradient-scale-by-a-root-of-the-size",
        "terms-scaled-by-a-norm",
        "loss-nanmean-of-the-model",
        "loss-batch-dice",
    ],
)
def test_outputs_averaging_would_change_are_an_error(loss_of, aux_of, message):
    # Averaged over microbatches, a sum comes back divided by their number (the loss's gradients
    # too) and a max is no average of maxima: an error, where jax.jit's value cannot be had.
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    batch = train.make_batch("mlp", config, BATCH)
    step = _loss_step(loss_of) if aux_of is None else _aux_step(aux_of)
    with pytest.raises(ValueError, match=message):
        autopar.autoparallel(step, num_stages=2, num_microbatches=4)(state, batch)
    autopar.autoparallel(step, num_stages=2, num_microbatches=1)(state, batch)  # one: as jit


@pytest.mark.parametrize("form", ["masked-mean-over-a-learned-scale", "gaussian-nll-learned-variance"])
def test_a_sum_of_the_batch_alone_times_a_learned_scale_as_divisor_equals_jit(form):
    """A divisor whose batch-size degree comes from the batch alone (a token count, the batch
    size) times a value of the model (a learned temperature or variance) divides alike in every
    microbatch's share: no error (only sums over the examples of the model's values are one)."""
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.normal(size=(8, 4)) * 0.3, jnp.float32), "t": jnp.asarray(0.3)}

    def step(p, batch):
        def loss_fn(p):
            err = jnp.sum((jnp.tanh(batch["x"] @ p["w"]) - 0.5) ** 2, -1)
            if form == "masked-mean-over-a-learned-scale":
                m = batch["m"] > 0
                return jnp.sum(err * m) / (jnp.sum(m) * jnp.exp(p["t"]))
            return jnp.sum(err) / (2 * batch["x"].shape[0] * jnp.exp(p["t"])) + 0.5 * p["t"]

        loss, grads = autopar.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), loss

    batches = [
        {"x": rng.normal(size=(BATCH, 8)).astype(np.float32), "m": (np.arange(BATCH) % 3).astype(np.int32)}
        for _ in range(2)
    ]
    _assert_outputs_as_jit(step, p, batches, num_stages=1, num_microbatches=4)


def test_integer_counts_of_the_labels_alone_returned_as_aux_are_the_whole_batchs():
    """With no other figure of the batch in the loss (a plain mean), integer counts returned as
    aux are made once per step all the same (before, their whole-batch ops were never run: a
    driver ``KeyError``)."""
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    step = _aux_step(lambda logits, y: {"classes": jnp.bincount(y, length=10), "tokens": jnp.sum(y >= 2)})
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(2)]
    out = _assert_outputs_as_jit(step, state, batches, num_stages=2, num_microbatches=4)
    assert out[1]["classes"].dtype == jnp.int32


def test_counts_of_the_labels_returned_as_aux_are_the_whole_batchs():
    """Sums over the examples of the labels alone (class counts by segment_sum or by a loop over
    the rows) are figures of the batch: each microbatch reads its share, and the aux output
    comes back as the whole batch's figure, made once per step, as jax.jit returns it."""
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    step = _aux_step(
        lambda logits, y: {
            "per_class": jax.ops.segment_sum(jnp.ones(y.shape), y, num_segments=10),
            "counts": jax.lax.fori_loop(0, y.shape[0], lambda i, c: c.at[y[i]].add(1.0), jnp.zeros(10)),
        }
    )
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(2)]
    out = _assert_outputs_as_jit(step, state, batches, num_stages=2, num_microbatches=4)
    assert float(out[1]["per_class"].sum()) == BATCH


@pytest.mark.parametrize("mesh_shape", [None, (2, 2)])
def test_aux_outputs_per_example_are_concatenated_over_microbatches(mesh_shape):
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    step = _aux_step(
        lambda logits, y: {
            "logits": logits,  # batch dim 0
            "by_class": logits.T,  # batch dim 1
            "right": jnp.argmax(logits, -1) == y,  # booleans: concatenated, not the last microbatch's
            "labels": y,  # a batch input passed through
            "mean": logits.mean(),
        }
    )
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]
    options = dict(num_stages=2, num_microbatches=4, mesh_shape=mesh_shape)
    out = _assert_outputs_as_jit(step, state, batches, **options)
    assert out[1]["by_class"].shape == (config.num_classes, BATCH)
    np.testing.assert_array_equal(np.asarray(out[1]["labels"]), np.asarray(batches[-1]["y"]))


def test_gradients_of_batch_inputs_are_concatenated_over_microbatches():
    # d loss / d x per example (saliency, input-gradient penalties): the whole batch's mean
    # gradient is each microbatch's divided by the number of microbatches.
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))

    def step(state, batch):
        def loss_fn(p, x):
            logits = state.apply_fn({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, (grads, grad_x) = autopar.value_and_grad(loss_fn, argnums=(0, 1))(state.params, batch["x"])
        return state.apply_gradients(grads=grads), (loss, grad_x)

    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]
    out = _assert_outputs_as_jit(step, state, batches, num_stages=2, num_microbatches=4)
    assert out[1].shape == batches[0]["x"].shape


def test_the_batch_shape_read_outside_the_loss_function_is_the_whole_batchs_or_an_error():
    # An examples-seen counter. Outside the loss function the step is traced at one microbatch:
    # that code runs at the whole batch (jit's count) after the gradient, and before it where the
    # loss does not read it. What the loss reads (here the examples' positions) would be one
    # microbatch's: an error.
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    inner = _aux_step(lambda logits, y: logits.mean())

    def counted_after(state_and_seen, batch):
        state, seen = state_and_seen
        state, out = inner(state, batch)
        return (state, seen + batch["x"].shape[0]), out

    def counted_before(state_and_seen, batch):
        state, seen = state_and_seen
        seen = seen + batch["x"].shape[0]
        seen_twice = seen * 2  # code before the loss reading the count, and the update reading it
        state, out = inner(state, batch)
        return (state.replace(step=state.step + seen_twice), seen), (out, seen_twice)

    def positions_before(state_and_seen, batch):
        position = jnp.arange(batch["x"].shape[0], dtype=batch["x"].dtype)
        return inner(state_and_seen[0], {**batch, "x": batch["x"] + 1e-3 * position[:, None]})

    batch = train.make_batch("mlp", config, BATCH)
    state = (state, jnp.zeros((), jnp.int32))
    for counted in (counted_after, counted_before):
        _assert_outputs_as_jit(counted, state, [batch, batch], num_stages=2, num_microbatches=4)
        par = autopar.autoparallel(counted, num_stages=2, num_microbatches=4)
        assert int(par(state, batch)[0][1]) == BATCH
    outside = r"outside the loss function differs .* \(at .*test_region_outputs.*'a:f32\[4\] = iota"
    with pytest.raises(
        ValueError, match=outside + r".* for one of num_microbatches=4, .*f32\[16\].* for the batch"
    ):
        autopar.autoparallel(positions_before, num_stages=2, num_microbatches=4)(state, batch)
    _assert_outputs_as_jit(positions_before, state, [batch], num_stages=2, num_microbatches=1)

    # Per-microbatch code may depend on the microbatch's shape (here: a loop over its rows).
    def rowwise(state_and_seen, batch):
        rows = jnp.stack([row[::-1] for row in batch["x"]])
        return inner(state_and_seen[0], {**batch, "x": rows})

    _assert_outputs_as_jit(rowwise, state, [batch], num_stages=2, num_microbatches=4)


class _Counting(nnx.Module):
    """A module whose forward updates its own state: an RNG key it splits, optionally an
    examples-seen counter."""

    def __init__(self, count: bool):
        self.dense, self.out = nnx.Linear(8, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 4, rngs=nnx.Rngs(1))
        self.key = nnx.Variable(jax.random.key(3))
        self.seen = nnx.Variable(jnp.zeros((), jnp.int32)) if count else None

    def __call__(self, x):
        if self.seen is not None:
            self.seen[...] += x.shape[0]
        self.key[...], noise = jax.random.split(self.key[...])
        return self.out(self.dense(x + 0.01 * jax.random.normal(noise, x.shape)))


def test_module_state_updated_in_the_forward_comes_back_as_from_jit_or_is_an_error():
    def step(state, batch):
        model = nnx.merge(graphdef, state)
        loss, grads = autopar.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param), grads))
        return nnx.state(model), loss

    batch = {"x": jnp.ones((BATCH, 8)), "y": jnp.zeros((BATCH, 4))}
    graphdef, state = nnx.split(_Counting(count=False))
    # The key split in the forward: the first microbatch reads it unfolded, so the module's
    # next key is jit's (the noise drawn per example differs by design).
    out, ref = (
        autopar.autoparallel(step, num_stages=2, num_microbatches=4)(state, batch),
        jax.jit(step)(state, batch),
    )
    np.testing.assert_array_equal(as_numpy(out[0]["key"].get_value()), as_numpy(ref[0]["key"].get_value()))
    graphdef, state = nnx.split(_Counting(count=True))
    with pytest.raises(
        ValueError, match=r"reads the batch's shape \(at .*test_region_outputs.*'a:i32\[\] = add b 4:i32"
    ):
        autopar.autoparallel(step, num_stages=2, num_microbatches=4)(state, batch)


@pytest.mark.parametrize("loop", ["scan", "cond"])
def test_a_counter_passed_through_a_loop_with_the_examples_is_not_computed_from_them(loop):
    # An RNG-counter-like int goes through a scan or cond together with activations: output by
    # output, it depends only on itself, so it may be the first microbatch's.
    def counted(logits, count):
        if loop == "scan":
            (logits, count), _ = jax.lax.scan(
                lambda c, _: ((c[0] * 1.1, c[1] + 1), None), (logits, count), None, 2
            )
        else:
            logits, count = jax.lax.cond(
                count > 0, lambda h, c: (h * 2, c + 1), lambda h, c: (h, c + 1), logits, count
            )
        return logits, count

    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    step = _aux_step(lambda logits, y: counted(logits, jnp.ones((), jnp.int32))[1])
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(2)]
    _assert_outputs_as_jit(step, state, batches, num_stages=2, num_microbatches=4)


def test_a_variance_over_the_batch_is_averaged_over_microbatches_like_batchnorm_statistics():
    # jnp.var divides by the element count (a batch-size literal, unlike an examples-seen
    # counter): a nonlinear function of means, averaged per microbatch as documented.
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    batch = train.make_batch("mlp", config, BATCH)
    step = _aux_step(lambda logits, y: {"var": jnp.var(logits), "std": jnp.std(logits, axis=0)})
    _, (_, out) = autopar.autoparallel(step, num_stages=2, num_microbatches=4)(state, batch)
    logits = state.apply_fn({"params": state.params}, batch["x"]).reshape(4, BATCH // 4, -1)
    np.testing.assert_allclose(out["var"], jnp.var(logits, axis=(1, 2)).mean(), **TOLERANCES["sgd"])
    np.testing.assert_allclose(out["std"], jnp.std(logits, axis=1).mean(0), **TOLERANCES["sgd"])


def test_integer_aux_outputs_computed_from_the_examples_are_an_error():
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    batch = train.make_batch("mlp", config, BATCH)
    correct = _aux_step(lambda logits, y: jnp.sum(jnp.argmax(logits, -1) == y))
    with pytest.raises(ValueError, match=r"Aux output 0 .*int32\[\]\) is computed from the examples"):
        autopar.autoparallel(correct, num_stages=2, num_microbatches=2)(state, batch)
    _assert_outputs_as_jit(correct, state, [batch], num_stages=2, num_microbatches=1)


def test_aux_outputs_reduced_over_the_batch_are_averaged_whatever_their_shape():
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    step = _aux_step(lambda logits, y: {"per_class": logits.mean(0)})
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]
    out = _assert_outputs_as_jit(step, state, batches, num_stages=2, num_microbatches=4)
    assert out[1]["per_class"].shape == (config.num_classes,)


@pytest.mark.parametrize("constant", [jnp.int32(7), jnp.float32(1.5), 3.0])
def test_constant_aux_outputs_come_back_as_from_jit(constant):
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    step = _aux_step(lambda logits, y: {"constant": constant, "mean": logits.mean()})
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(2)]
    _assert_outputs_as_jit(step, state, batches, num_stages=2, num_microbatches=4)


def test_aux_outputs_neither_reduced_nor_per_example_are_an_error():
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    batch = train.make_batch("mlp", config, BATCH)
    pairs = _aux_step(lambda logits, y: logits @ logits.T)  # one value per pair of examples
    shapes = r"Aux output 0 .* float32\[16,16\] for the batch but float32\[8,8\]"
    with pytest.raises(ValueError, match=shapes):
        autopar.autoparallel(pairs, num_stages=2, num_microbatches=2)(state, batch)


def test_per_example_aux_outputs_read_after_the_gradient_are_read_whole():
    """Code after the gradient that reads the logits (and the labels) runs once per step at the
    whole batch, on the microbatches' logits joined: an accuracy, the batch's largest logit, the
    count of correct predictions (an integer) are jax.jit's."""
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    batches = [train.make_batch("mlp", config, BATCH, seed=i) for i in range(2)]

    def step(state, batch):
        new, (loss, logits) = _aux_step(lambda logits, y: logits)(state, batch)
        right = jnp.argmax(logits, -1) == batch["y"]
        return new, (loss, jnp.mean(right), jnp.sum(right), logits.max(), jnp.argmax(logits, -1))

    out = _assert_outputs_as_jit(step, state, batches, num_stages=2, num_microbatches=4)
    assert out[2].dtype == jnp.int32 and out[4].shape == (BATCH,)


def _value_mlp(ws, x):
    for w in ws[:-1]:
        x = jnp.tanh(x @ w)
    return (x @ ws[-1])[:, 0]


def _advantages_step(state, batch):
    """PPO's advantages: the model's values before the gradient, standardised by the batch's
    mean and std, read by the loss and returned after the gradient."""
    old = _value_mlp(state["w"], batch["x"])
    adv = batch["r"] - old
    target = adv + old
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)

    def loss_fn(ws):
        v = _value_mlp(ws, batch["x"])
        return (v * adv).mean() + ((v - target) ** 2).mean()

    loss, grads = autopar.value_and_grad(loss_fn)(state["w"])
    return {"w": [w - 0.1 * g for w, g in zip(state["w"], grads, strict=True)]}, (loss, adv.mean())


def _views_step(state, batch):
    """DINO's teacher: two views' outputs made before the gradient, each read by the loss with
    the other view's student, one of them averaged again after the gradient (the centre)."""
    x, x2 = batch["x"], 2 * batch["x"]
    t1, t2 = jnp.tanh(x @ state["t"][0]) @ state["t"][1], jnp.tanh(x2 @ state["t"][0]) @ state["t"][1]

    def loss_fn(ws):
        def student(v):
            return jnp.tanh(jnp.tanh(v @ ws[0]) @ ws[1]) @ ws[2]

        return ((student(x) - t2) ** 2).mean() + ((student(x2) - t1) ** 2).mean()

    loss, grads = autopar.value_and_grad(loss_fn)(state["w"])
    new = [w - 0.1 * g for w, g in zip(state["w"], grads, strict=True)]
    centre = 0.9 * state["centre"] + 0.1 * t2.mean(0)
    return {"w": new, "t": state["t"], "centre": centre}, loss


def _ema_eval_step(state, batch):
    """An EMA model's loss evaluated before the gradient and returned: ``jax.nn.logsumexp``'s
    trace holds an equation nothing reads (its ``sign``), which a forward task kept, reading a
    value made only at the whole batch (before, a driver ``KeyError``)."""
    classes = (batch["r"] > 0).astype(jnp.int32)

    def nll(ws):
        logits = jnp.tanh(jnp.tanh(batch["x"] @ ws[0]) @ ws[1]) @ ws[2]
        return optax.softmax_cross_entropy_with_integer_labels(logits, classes).mean()

    ema_loss = nll(state["t"] + state["w"][2:])
    loss, grads = autopar.value_and_grad(nll)(state["w"])
    return {**state, "w": [w - 0.1 * g for w, g in zip(state["w"], grads, strict=True)]}, (loss, ema_loss)


@pytest.mark.parametrize(
    "step", [_advantages_step, _views_step, _ema_eval_step], ids=["advantages", "views", "ema-eval"]
)
def test_values_made_before_the_gradient_for_the_loss_and_again_for_code_after_it_equal_jit(step):
    """Made per microbatch in the forward tasks for the loss and again at the whole batch for the
    code after the gradient: the forward equations go to the stage of the loss's first reader,
    also those the whole batch's code reads (before, they went to the first stage and read
    values made on the second: a missing input)."""
    keys = jax.random.split(jax.random.key(0), 6)
    state = {"w": [jax.random.normal(keys[i], (8, 8)) * 0.3 for i in range(3)]}
    if step is _advantages_step:
        state["w"].append(jax.random.normal(keys[3], (8, 1)))
    elif step is _ema_eval_step:
        state["t"] = [0.9 * w for w in state["w"][:2]]
    else:
        state |= {
            "t": [jax.random.normal(keys[4 + i], (8, 8)) * 0.3 for i in range(2)],
            "centre": jnp.zeros(8),
        }
    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(BATCH, 8)).astype(np.float32),
            "r": rng.normal(size=(BATCH,)).astype(np.float32),
        }
        for _ in range(2)
    ]
    _assert_outputs_as_jit(step, state, batches, num_stages=2, num_microbatches=4)


@pytest.mark.parametrize("after", [False, True], ids=["alone", "with-code-after-the-gradient"])
def test_a_constant_the_loss_function_closes_over_equals_jit(after):
    """A scalar made before the loss function (``jnp.ones(())``) reaches the region as a literal
    operand: the profile and the order check take it as a constant (before, they hashed it)."""

    def step(p, batch):
        weight = jnp.ones(())

        def loss_fn(p):
            out = (jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"])[..., 0]
            return jnp.mean((out - batch["r"]) ** 2 * weight)

        loss, grads = autopar.value_and_grad(loss_fn)(p)
        new = jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)
        return (jax.tree.map(lambda a: a + 1e-3 * batch["r"].mean(), new) if after else new), loss

    rng = np.random.default_rng(0)
    p = {"w1": rng.normal(size=(8, 16)) * 0.3, "w2": rng.normal(size=(16, 1)) * 0.3}
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)
    batches = [
        {
            "x": rng.normal(size=(BATCH, 8)).astype(np.float32),
            "r": rng.normal(size=(BATCH,)).astype(np.float32),
        }
        for _ in range(2)
    ]
    _assert_outputs_as_jit(step, p, batches, num_stages=2, num_microbatches=4)


def test_a_sum_of_values_made_in_several_tasks_is_split_per_task():
    """``(a + a) + b + c`` with ``a`` and ``c`` made in one task and ``b`` in another: one running
    sum per task, adding each value as often as the sum does; the additions run once per step.
    A sum made in one task, or of an integer, is not split."""

    def f(x, y):
        a = jnp.sin(x)
        return ((a + a) + jnp.cos(y)) + jnp.tanh(x)

    jaxpr = jax.make_jaxpr(f)(1.0, 2.0).jaxpr
    made = {e.primitive.name: e.outvars[0] for e in jaxpr.eqns}
    sin, cos, tanh = made["sin"], made["cos"], made["tanh"]
    made_in = {sin: (0, "B"), tanh: (0, "B"), cos: (1, "B")}
    (split,) = region_outputs.split_sums(jaxpr, [(jaxpr.outvars[0], "grad")], made_in).values()
    assert split.output == "grad"
    assert [values for values, _ in split.parts] == [(sin, sin, tanh), (cos,)]
    assert [e.primitive.name for e in split.adds] == ["add"] * 3
    assert split.combine().ins == tuple((acc, None) for _, acc in split.parts)
    one_task = {v: (0, "B") for v in made_in}
    assert region_outputs.split_sums(jaxpr, [(jaxpr.outvars[0], "grad")], one_task) == {}
    ints = jax.make_jaxpr(lambda i, j: (i * 2) + (j * 3))(1, 2).jaxpr
    apart = {e.outvars[0]: (k, "B") for k, e in enumerate(ints.eqns[:2])}
    assert region_outputs.split_sums(ints, [(ints.outvars[0], "n")], apart) == {}


def test_a_sum_after_an_einsum_whose_contraction_order_depends_on_the_batch_size_is_added_up():
    """A three-operand einsum contracts in another order at the whole batch: the two traces
    differ there and are compared around it, so the sum over the examples is still found, and
    added up over the microbatches."""
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    batch = train.make_batch("mlp", config, BATCH)
    a, b = jnp.full((10, 8), 0.1), jnp.full((8, 10), 0.1)

    def step(state, batch):
        def loss_fn(p):
            logits = jnp.einsum("nd,de,ef->nf", state.apply_fn({"params": p}, batch["x"]), a, b)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).sum()

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    assert_same_as_jit(step, state, [batch], TOLERANCES["sgd"], num_stages=2, num_microbatches=4)
