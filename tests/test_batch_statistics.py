"""Figures of the batch alone inside the loss function (a masked mean's count, standardising
statistics) are the whole batch's in every microbatch, so the step equals jax.jit however the
padding falls between the microbatches."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from equality import TOLERANCES, assert_same_as_jit
from flax.training import train_state

import autopar
from autopar._src import batch_statistics, planning, share_scaling, trace
from models import train

BATCH, TOKENS, MICROBATCHES = 16, 6, 4


class Tagger(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(10)(x)


LOSSES = {
    "masked mean": lambda ce, mask, y: jnp.sum(ce * mask) / jnp.sum(mask),
    "clamped count": lambda ce, mask, y: jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1),
    "ratio of means": lambda ce, mask, y: jnp.mean(ce * mask) / jnp.mean(mask),
    "guarded": lambda ce, mask, y: jnp.where(
        jnp.sum(mask) > 0, jnp.sum(ce * mask) / jnp.sum(mask.astype(jnp.float32)), 0.0
    ),
    "reciprocal": lambda ce, mask, y: jnp.sum(ce * mask) * (1.0 / jnp.sum(mask)),
    "weighted": lambda ce, mask, y: (
        jnp.sum(ce * jnp.where(mask, 1.0 + y % 3, 0.0)) / jnp.sum(jnp.where(mask, 1.0 + y % 3, 0.0))
    ),
    # A count made in a loop over the rows, which adds up: a sum over the examples.
    "counted in a loop": lambda ce, mask, y: (
        jnp.sum(ce * mask) / jax.lax.fori_loop(0, mask.shape[0], lambda i, c: c + jnp.sum(mask[i]), 0.0)
    ),
    # Masked means stacked and weighed (per-task losses under uncertainty weighting).
    "stacked masked means": lambda ce, mask, y: jnp.sum(
        jnp.stack([jnp.mean(ce, where=mask), jnp.sum(ce * mask * (y % 2)) / jnp.sum(mask)])
        * jnp.array([0.3, 0.7])
    ),
    # A chunked loss: a scan over chunks of the tokens adding up the losses and the count.
    "counted in chunks": lambda ce, mask, y: _chunked(ce, mask),
    # A boolean figure: the whole batch's, however few tokens a microbatch holds.
    "guarded by a threshold": lambda ce, mask, y: jnp.where(
        jnp.sum(mask) > 30, jnp.sum(ce * mask) / jnp.sum(mask), 0.0
    ),
    "guarded by a cond": lambda ce, mask, y: _guarded(ce, mask, jnp.sum(mask, dtype=jnp.float32)),
    # Each class weighed by the inverse of its count in the batch (jnp.bincount: a scatter-add),
    # the share gathered per token.
    "class-balanced": lambda ce, mask, y: (
        jnp.sum(ce * mask / jnp.maximum(_class_counts(mask, y), 1.0)[jnp.where(mask, y, 0)]) / 10
    ),
    # Figures of a degree that is not a whole number: made in each microbatch from the count's share.
    "square roots of the count": lambda ce, mask, y: (
        jnp.sum(ce * mask) / jnp.sqrt(jnp.sum(mask)) / jnp.sqrt(jnp.sum(mask))
    ),
    # Class weights gathered from a constant table (a closed-over array is a constant of the step).
    "class weights": lambda ce, mask, y: (
        jnp.sum(ce * jnp.asarray(CLASS_WEIGHTS)[jnp.where(mask, y, 0)] * mask)
        / jnp.sum(jnp.asarray(CLASS_WEIGHTS)[jnp.where(mask, y, 0)] * mask)
    ),
}
CLASS_WEIGHTS = np.linspace(1.0, 4.0, 10, dtype=np.float32)


def _chunked(ce, mask, running=False):
    """A masked mean over chunks of 2 tokens, made by a scan carrying the sums of the losses and
    of the mask; ``running``: each chunk divides by the count so far instead."""
    chunks = [a.reshape(a.shape[0], -1, 2).swapaxes(0, 1) for a in (ce, mask.astype(jnp.float32))]

    def add(carry, chunk):
        total, count = carry
        c, m = chunk
        count = count + jnp.sum(m)
        return (total + jnp.sum(c * m) / (count if running else 1.0), count), None

    (total, count), _ = jax.lax.scan(add, (0.0, 0.0), chunks)
    return total if running else total / count


def _guarded(ce, mask, n, shift=0.0):
    """A masked mean (of ``n`` tokens, plus ``shift``), 0 for no tokens."""
    return jax.lax.cond(n > 0, lambda: jnp.sum(ce * mask) / (n + shift), lambda: 0.0)


def _class_counts(mask, y, dtype=jnp.float32):
    """Each class's tokens in the batch."""
    weights = mask.ravel().astype(jnp.float32)
    return jnp.bincount(jnp.where(mask, y, 0).ravel(), weights=weights, length=10).astype(dtype)


def _setup(
    loss_of,
    standardise=False,
    mask_outside=False,
    count_outside=None,
    scale_outside=False,
    before=False,
    count_first=False,
    scale_inside=None,
):
    model = Tagger()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, TOKENS, 8)).astype(np.float32)
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"], tx=optax.sgd(0.1)
    )

    def step(state, batch):
        outside = batch["y"] != -100  # made before the loss function, from the labels alone
        counted = None if count_outside is None else count_outside(outside)
        scale = jnp.max(jnp.abs(batch["x"]))  # the batch's largest input
        if before:  # standardised before the loss function
            x = batch["x"]
            batch = {**batch, "x": (x - x.mean((0, 1))) / (x.std((0, 1)) + 1e-6)}

        def loss_fn(params):
            x = batch["x"]
            if scale_outside:
                x = x / scale
            if standardise:  # by the batch's statistics, inside the loss function
                x = (x - x.mean((0, 1))) / (x.std((0, 1)) + 1e-6)
            first = jnp.sum(batch["y"] != -100) if count_first else None  # an integer, before the model
            # a robust scale of the batch's inputs (its largest, its median), in and out
            s = 1.0 if scale_inside is None else scale_inside(jnp.abs(x))
            logits = state.apply_fn({"params": params}, x / s) * s
            mask = outside if mask_outside else batch["y"] != -100
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, batch["y"], 0))
            if counted is not None:
                return jnp.sum(ce * mask) / counted
            if first is not None:
                return jnp.sum(ce * mask) / first
            return loss_of(ce, mask, batch["y"])

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    batches = []
    for seed in range(3):
        rng = np.random.default_rng(seed)
        y = rng.integers(0, 10, (BATCH, TOKENS)).astype(np.int32)
        y[:4, 1:] = -100  # the first microbatch is mostly padding, the others hardly any
        y[9, 3:] = -100
        batches.append({"x": (rng.normal(size=(BATCH, TOKENS, 8)) * 3 + 1).astype(np.float32), "y": y})
    return step, state, batches


def _microbatch_mean(step, state, batch):
    """The loss as the mean of each microbatch's own loss: what the step would compute with
    each microbatch counting its own tokens."""
    rows = BATCH // MICROBATCHES
    parts = [{k: a[j * rows : (j + 1) * rows] for k, a in batch.items()} for j in range(MICROBATCHES)]
    return np.mean([float(jax.jit(step)(state, part)[1]) for part in parts])


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_loss_weighed_by_the_batch_equals_jit_with_unequal_microbatches(name):
    step, state, batches = _setup(LOSSES[name])
    # The microbatches weigh differently: their own counts would give another loss.
    assert abs(_microbatch_mean(step, state, batches[0]) - float(jax.jit(step)(state, batches[0])[1])) > 1e-3
    par = assert_same_as_jit(
        step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=MICROBATCHES
    )
    assert par.plan(state, batches[0]).num_microbatches == MICROBATCHES


OUTSIDE = {
    "standardised inputs": {"standardise": True},
    "mask made outside": {"mask_outside": True},
    "count made outside": {"mask_outside": True, "count_outside": jnp.sum},  # an integer sum
    "float count made outside": {"count_outside": lambda m: jnp.sum(m.astype(jnp.float32))},
    "mean made outside": {"count_outside": lambda m: jnp.mean(m) * m.size},
    "maximum made outside": {"scale_outside": True},
    # before, refused as a per-tensor quantization scale of what the model computes
    "maximum made inside": {"scale_inside": jnp.max},
    "median made inside": {"scale_inside": jnp.median},
    "quantile made inside": {"scale_inside": lambda a: jnp.quantile(a, 0.9)},
    "standardised outside": {"before": True},
}


def test_a_count_made_before_the_model_and_cast_after_a_stage_cut_equals_jit_with_two_rows_a_microbatch():
    # The integer count crosses the layer boundaries as it is and is cast to float after them:
    # its degree follows it across. With 8 microbatches each has 2 rows for a stage's 4 devices,
    # while the joined batch the count is made from has 16: each has a layout of its own.
    step, state, batches = _setup(None, count_first=True)
    assert abs(_microbatch_mean(step, state, batches[0]) - float(jax.jit(step)(state, batches[0])[1])) > 1e-3
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=8)


@pytest.mark.parametrize("how", list(OUTSIDE))
def test_figures_of_the_batch_made_with_the_examples_or_before_the_loss_equal_jit(how):
    options = OUTSIDE[how]
    step, state, batches = _setup(LOSSES["masked mean"], **options)
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=MICROBATCHES)


class _WeighedState(train_state.TrainState):
    class_weights: jax.Array


@pytest.mark.parametrize("where", ["in the loss", "before the loss"])
def test_class_weights_from_the_state_are_shared_by_the_microbatches_and_equal_jit(where):
    # The weights' table is an input of the step the microbatches share (not differentiated):
    # the weights' sum is a statistic of the batch, whether gathered inside the loss or before.
    _, plain, batches = _setup(LOSSES["masked mean"])
    state = _WeighedState.create(
        apply_fn=plain.apply_fn,
        params=plain.params,
        tx=optax.sgd(0.1),
        class_weights=jnp.asarray(CLASS_WEIGHTS),
    )

    def step(state, batch):
        mask = batch["y"] != -100
        labels = jnp.where(mask, batch["y"], 0)
        before = state.class_weights[labels] * mask

        def loss_fn(params):
            ce = optax.softmax_cross_entropy_with_integer_labels(
                state.apply_fn({"params": params}, batch["x"]), labels
            )
            weights = before if where == "before the loss" else state.class_weights[labels] * mask
            return jnp.sum(ce * weights) / jnp.sum(weights)

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    assert abs(_microbatch_mean(step, state, batches[0]) - float(jax.jit(step)(state, batches[0])[1])) > 1e-3
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=MICROBATCHES)


@pytest.mark.parametrize("aux", ["perplexity", "linear"])
def test_a_nonlinear_function_of_a_loss_weighed_by_the_batch_is_an_error_and_a_linear_one_equals_jit(aux):
    # Each microbatch's masked mean is its share of the whole batch's: averaged, a linear function
    # of it is jit's, exp of it is not.
    _, state, batches = _setup(LOSSES["masked mean"])

    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            mask = batch["y"] != -100
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, batch["y"], 0))
            loss = jnp.sum(ce * mask) / jnp.sum(mask)
            return loss, {"perplexity": jnp.exp(loss)} if aux == "perplexity" else {"nats": 2.0 * loss + 1.0}

        (loss, metrics), grads = autopar.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), (loss, metrics)

    if aux == "linear":
        par = autopar.autoparallel(step, num_stages=2, num_microbatches=MICROBATCHES)
        for batch in batches:
            for a, b in zip(
                jax.tree.leaves(par(state, batch)), jax.tree.leaves(jax.jit(step)(state, batch)), strict=True
            ):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCES["sgd"])
        return
    with pytest.raises(ValueError, match=r"Aux output 0 .* applies exp \(at .*test_batch_statistics.*share"):
        autopar.autoparallel(step, num_stages=2, num_microbatches=MICROBATCHES)(state, batches[0])
    par = autopar.autoparallel(step, num_stages=2, num_microbatches=1)
    np.testing.assert_allclose(
        np.asarray(par(state, batches[0])[1][1]["perplexity"]),
        np.asarray(jax.jit(step)(state, batches[0])[1][1]["perplexity"]),
        **TOLERANCES["sgd"],
    )


def _statistics(step, state, batch):
    leaves = jax.tree.leaves((state, batch))
    batch_ids = list(range(len(leaves) - 2, len(leaves)))
    opts = trace.TraceOptions(num_layers=2)
    mine = planning.trace_at(step, (state, batch), batch_ids, BATCH // MICROBATCHES, opts)
    cuts = tuple(mine.jaxpr.eqns[mine.region_index()].params["info"].cuts)
    whole = planning.trace_at(
        step, (state, batch), batch_ids, BATCH, trace.TraceOptions(num_layers=2, cuts=cuts)
    )
    return batch_statistics.find(mine, whole, {mine.arg_vars[i] for i in batch_ids}, MICROBATCHES)


def test_the_count_is_made_once_from_the_joined_batch_and_shared_out():
    step, state, batches = _setup(LOSSES["masked mean"])
    found = _statistics(step, state, batches[0])
    assert len(found.values) == 1
    (count,) = found.values
    assert count.aval.shape == () and count.aval.dtype == jnp.float32
    modes = [(op.kind, op.mode) for op in found.ops]
    assert modes[0] == ("acc", "concat") and len(found.ops[0].ins) == MICROBATCHES  # the labels joined
    assert modes[-1] == ("acc", "mean") and found.ops[-1].divisor == MICROBATCHES  # a sum: its share
    assert {op.eqn.primitive.name for op in found.ops if op.kind == "eqn"} >= {"ne", "reduce_sum"}


@pytest.mark.parametrize("kind", ["drawn", "model"])
def test_what_is_not_a_figure_of_the_batch_alone_is_left_to_each_microbatch(kind):
    def loss_of(ce, mask, y):
        if kind == "drawn":  # random draws differ at the whole batch's shape
            keep = jax.random.bernoulli(jax.random.key(0), 0.9, mask.shape)
            return jnp.sum(ce * mask) / jnp.sum(mask * keep)
        return jnp.sum(ce * mask) / jnp.sum(ce)  # depends on the model

    step, state, batches = _setup(loss_of)
    assert _statistics(step, state, batches[0]).values == {}


REFUSED = {
    # An integer count: its share is no integer.
    "integer count": (
        lambda ce, mask, y: jnp.sum(ce * mask / _class_counts(mask, y, jnp.int32)[jnp.where(mask, y, 0)]),
        "integer figure of the batch",
    ),
    # A share compared with a constant: a rare class in the batch is not a rare one in a microbatch.
    "share compared": (
        lambda ce, mask, y: (
            jnp.sum(ce * mask * (_class_counts(mask, y)[jnp.where(mask, y, 0)] > 5.0)) / jnp.sum(mask)
        ),
        "applies gt",
    ),
    # A share with a constant added, then divided by.
    "share shifted": (
        lambda ce, mask, y: jnp.sum(ce * mask / (_class_counts(mask, y)[jnp.where(mask, y, 0)] + 1.0)) / 10,
        "applies div",
    ),
    # ... also inside a cond's branch.
    "share shifted in a cond": (
        lambda ce, mask, y: _guarded(ce, mask, jnp.sum(mask, dtype=jnp.float32), shift=1.0),
        "applies cond",
    ),
    # An integer count cast inside a cond's branch.
    "count cast in a cond": (lambda ce, mask, y: _guarded(ce, mask, jnp.sum(mask)), "integer figure"),
    # A count made inside a cond's branch: each microbatch's own.
    "count made in a cond": (
        lambda ce, mask, y: jax.lax.cond(
            jnp.sum(mask) > 0, lambda: jnp.sum(ce * mask) / jnp.sum(mask), lambda: 0.0
        ),
        "inside a cond",
    ),
    # ... or inside jax.checkpoint.
    "count made in a checkpoint": (
        lambda ce, mask, y: jax.checkpoint(lambda c, m: jnp.sum(c * m) / jnp.sum(m))(ce, mask),
        "inside a (remat|checkpoint)",
    ),
    # Class-balanced weights through a square root: each microbatch would read its share's.
    "inverse square root weights": (
        lambda ce, mask, y: jnp.mean(
            ce * mask / jnp.sqrt(jnp.maximum(_class_counts(mask, y), 1.0))[jnp.where(mask, y, 0)]
        ),
        "figure of the batch alone .* no whole number .*sum\\(l / n\\[y\\]\\)",
    ),
    # A running count read inside a scan over chunks: each microbatch's own.
    "running count in chunks": (lambda ce, mask, y: _chunked(ce, mask, running=True), "inside a scan"),
    # A figure made in a loop whose carry neither adds up nor settles: how it scales is unknown.
    "unfollowed loop": (
        lambda ce, mask, y: (
            jnp.sum(ce * mask)
            / jax.lax.fori_loop(0, mask.shape[0], lambda i, c: c * 0.5 + jnp.sum(mask[i]), 1.0)
        ),
        "cannot tell how it scales",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_figure_of_the_batch_the_microbatches_cannot_share_is_an_error(name):
    loss_of, message = REFUSED[name]
    step, state, batches = _setup(loss_of)
    with pytest.raises(ValueError, match=message):
        autopar.autoparallel(step, num_stages=2, num_microbatches=MICROBATCHES)(state, batches[0])
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=1)


def test_bert_with_padding_that_differs_between_microbatches_equals_jit():
    config = train.tiny_config("bert")
    step, state = train.setup("bert", "linen", config, optax.sgd(0.1))
    batches = []
    for seed in range(2):
        batch = train.make_batch("bert", config, 8, seed=seed)
        mask = np.array(batch["mask"])
        mask[:2] = False  # nothing to predict in the first microbatch's rows but one token
        mask[0, 0] = True
        batches.append({**batch, "mask": mask})
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=4)


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        @jax.jit  # Hugging Face style: nested jits
        def attend(q, k, v, mask):
            w = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(q.shape[-1])
            w = jnp.where(mask[:, None, :] > 0, w, -1e9)
            return jnp.einsum("bts,bsd->btd", jax.nn.softmax(w), v)

        # No bias: a key's bias has a gradient of exactly zero (the softmax does not change when
        # every score of a query moves alike), and Adam would turn the float noise of that zero
        # into updates of the order of lr * noise / eps.
        q, k, v = jnp.split(nn.Dense(48, use_bias=False)(x), 3, axis=-1)
        x = nn.LayerNorm()(x + attend(q, k, v, mask))
        return nn.LayerNorm()(x + nn.Dense(16)(nn.gelu(nn.Dense(32)(x))))


class _Encoder(nn.Module):
    @nn.compact
    def __call__(self, ids, mask):
        x = nn.Embed(32, 16)(ids)
        for _ in range(3):
            x = _Layer()(x, mask)
        return nn.Dense(32)(x), x


def test_a_padded_language_model_with_nested_jits_equals_jit_over_microbatches():
    """Sequences of different lengths, padded: the loss averages over the real tokens of the
    whole batch (the mask also masks attention), plus a mean of the model's last activations."""
    model = _Encoder()
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        lengths = np.concatenate([[2, 2, 3], rng.integers(5, 11, 13)])  # short ones first
        mask = (np.arange(10)[None] < lengths[:, None]).astype(np.float32)
        ids = rng.integers(0, 32, (16, 10)).astype(np.int32)
        batches.append({"ids": ids, "mask": mask, "labels": np.roll(ids, -1, 1)})
    params = model.init(jax.random.key(0), batches[0]["ids"], batches[0]["mask"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-2, eps=1e-5))

    def step(state, batch):
        def loss_fn(p):
            logits, hidden = state.apply_fn({"params": p}, batch["ids"], batch["mask"])
            nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["labels"][..., None], -1)[..., 0]
            return (nll * batch["mask"]).sum() / batch["mask"].sum() + 1e-3 * jnp.mean(hidden**2)

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], num_stages=2, num_microbatches=4)


def test_values_made_from_a_share_are_monomials_in_its_scale_or_refused():
    # n: a share of degree 1 (a count); losses: the examples'; y: their classes.
    def made(n, losses, y):
        per_class = losses / n[y]  # mu ** -1
        total = jnp.sum(per_class)
        zeros = jnp.zeros(3).at[y].add(per_class)  # scattered into zeros: as what it scatters
        mixed = jnp.mean(losses) + total  # degrees 0 and -1: read linearly only
        return total, zeros / n, mixed * 2.0, n[y] > 0.0, jnp.exp(total), n[0] / mixed, n[y] > 2.0

    closed = jax.make_jaxpr(made)(jnp.ones(3), jnp.ones(4), jnp.zeros(4, jnp.int32))
    found, refused = share_scaling.degrees(closed.jaxpr.eqns, {closed.jaxpr.invars[0]: 1.0})
    outs = closed.jaxpr.outvars
    assert [found.get(v) for v in outs[:4]] == [-1.0, -2.0, share_scaling.MIXED, 0.0]
    assert all(v not in found for v in outs[4:])  # exp, divided by a sum, compared with 2
    assert sorted(e.primitive.name for e in refused.values()) == ["div", "exp", "gt"]


def test_a_figure_of_the_inputs_returned_as_aux_is_the_whole_batchs():
    # The inputs' maximum and the padding's share: made once from the whole batch and read whole
    # by every microbatch, so their average is the batch's (each microbatch's own would differ).
    # The token count, of which each microbatch reads its share: returned as made once per step
    # (before, refused as a sum over the examples), and so are integer counts the loss function
    # reads nowhere else (before, refused as averaged).
    _, state, batches = _setup(LOSSES["masked mean"])

    def step(state, batch):
        counted = jnp.sum(batch["y"] != -100)  # before the loss function

        def loss_fn(params):
            mask = batch["y"] != -100
            logits = state.apply_fn({"params": params}, batch["x"])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, batch["y"], 0))
            figures = {
                "largest input": jnp.max(jnp.abs(batch["x"])),
                "padding": jnp.mean(~mask),
                "tokens": jnp.sum(mask.astype(jnp.float32)),
                # Integers too: returned as made once per step, no microbatch reads a share.
                "integer tokens": jnp.sum(mask),
                "tokens squared": jnp.sum(mask) ** 2,
                "largest label": jnp.max(batch["y"]),
                "tokens counted before": counted,
                "labels per class": jnp.bincount(jnp.where(mask, batch["y"], 0).ravel(), length=4),
                "switched off": 0.0,  # a constant (a disabled regulariser's): a literal output
            }
            return jnp.sum(ce * mask) / jnp.sum(mask), figures

        (loss, figures), grads = autopar.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), (loss, figures)

    par = autopar.autoparallel(step, num_stages=2, num_microbatches=MICROBATCHES)
    for batch in batches:
        got, want = par(state, batch)[1][1], jax.jit(step)(state, batch)[1][1]
        for name in want:
            assert got[name].dtype == want[name].dtype
            np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), **TOLERANCES["sgd"])
    first = {k: a[: BATCH // MICROBATCHES] for k, a in batches[0].items()}
    assert float(jax.jit(step)(state, first)[1][1]["largest input"]) < float(
        jax.jit(step)(state, batches[0])[1][1]["largest input"]
    )  # a microbatch's own maximum is not the batch's


def test_group_sizes_counted_from_the_batch_for_rows_that_are_no_examples_are_an_error():
    """``ragged_dot``'s group sizes are each microbatch's own where they count the examples'
    rows (a dropless mixture of experts); over a weight's rows, a count of the batch's labels is
    a figure of the whole batch, and an integer one has no share."""
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
        "e": jnp.asarray(rng.normal(size=(2, 4, 3)), jnp.float32),
        "v": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
    }
    mask = np.zeros(16, np.int32)
    mask[:10] = 1  # the microbatches hold 8 and 2 of them
    batch = {"x": rng.normal(size=(16, 4)).astype(np.float32), "m": mask}

    def step(params, batch):
        def loss_fn(p):
            first = jnp.minimum(batch["m"].sum(), 8)
            out = jax.lax.ragged_dot(p["w"], p["e"], jnp.stack([first, 8 - first]))
            return (out**2).mean() + ((batch["x"] @ p["v"]) ** 2).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda a, b: a - 0.1 * b, params, grads), loss

    with pytest.raises(ValueError, match="integer figure of the batch"):
        autopar.autoparallel(step, num_stages=1, num_microbatches=2)(params, batch)
    assert_same_as_jit(step, params, [batch], TOLERANCES["sgd"], num_stages=1, num_microbatches=1)
