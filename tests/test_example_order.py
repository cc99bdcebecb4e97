"""Examples sorted along the batch inside the loss function, with microbatches: equal to jax.jit
where the rows go back to the batch's order (a dropless mixture of experts' sort and scatter),
an error naming the sort where the sorted rows meet others (the labels, a weight per rank) or
are returned per example."""

import inspect

import jax
import jax.numpy as jnp
import optax
import pytest
from equality import TOLERANCES, assert_same_as_jit

import autopar
from models import train

BATCH = 16


def _setup():
    config = train.tiny_config("mlp")
    state = train.linen_state("mlp", config, optax.sgd(0.1))
    return state, [train.make_batch("mlp", config, BATCH, seed=i) for i in range(3)]


def _assert_refused_with_microbatches(step, match):
    """``step`` is an error matching ``match`` with 4 microbatches, and equals jit with one."""
    state, batches = _setup()
    with pytest.raises(ValueError, match=match):
        autopar.autoparallel(step, num_stages=2, num_microbatches=4)(state, batches[0])
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=1)


def _step(on_logits=lambda z: z, on_losses=jnp.mean, aux=None):
    """An MLP step: ``on_losses(per-example losses of on_logits(logits))``, with ``aux(logits)``
    returned as aux when given."""

    def step(state, batch):
        def loss_fn(p):
            logits = on_logits(state.apply_fn({"params": p}, batch["x"]))
            loss = on_losses(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))
            return (loss, aux(logits)) if aux is not None else loss

        if aux is None:
            loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        else:
            (loss, _), grads = autopar.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step


def _scattered_back(z, descending=False):
    order = jnp.argsort(z[:, 0], descending=descending)
    return jnp.zeros_like(z).at[order].set(2.0 * jnp.tanh(z[order]))


def _gathered_back(z, descending=False):
    order = jnp.argsort(z[:, 0], descending=descending)
    return (2.0 * jnp.tanh(z[order]))[jnp.argsort(order)]


def _sorted_twice(z):
    """A router's experts argsorted once to gather the rows and once more to scatter them back."""
    expert = jnp.argmax(z[:, :4], -1)
    return jnp.zeros_like(z).at[jnp.argsort(expert)].set(jnp.tanh(z[jnp.argsort(expert)]))


def _sorted_and_argsorted(z):
    """A key's values sorted (``jnp.sort``) and put back by its ``jnp.argsort``."""
    key = z[:, 0]
    back = jnp.zeros_like(key).at[jnp.argsort(key)].set(jnp.tanh(jnp.sort(key)))
    return z + back[:, None]


_EXPERTS = jax.random.normal(jax.random.key(0), (4, 10, 10)) * 0.3
_ROUTER = jax.random.normal(jax.random.key(1), (10, 4))


def _top2_dropless(z):
    """Each row sent to its two best of four experts as a dropless mixture in MaxText's style:
    the rows' copies sorted by expert, taken by ``order // 2``, put back by the inverse
    permutation and summed with their gates."""
    gates, experts = jax.lax.top_k(jax.nn.softmax(z @ _ROUTER), 2)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat)
    rows = jnp.take(z, order // 2, axis=0)
    out = jnp.einsum("nd,nde->ne", rows, _EXPERTS[flat[order]])
    back = jnp.take(out, jnp.argsort(order), axis=0).reshape(z.shape[0], 2, z.shape[1])
    return (back * gates[..., None]).sum(1)


def _inverse_by_scatter(z):
    order = jnp.argsort(z[:, 0])
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    return (2.0 * jnp.tanh(z[order]))[inverse]


def _copies_by_token(z):
    """GShard-style: each row's two copies numbered by ``jnp.repeat(jnp.arange(n), 2)``, sorted by
    expert, and added back to their rows."""
    expert = jnp.argmax(z[:, :4], -1)
    order = jnp.argsort(jnp.stack([expert, (expert + 1) % 4], 1).reshape(-1))
    token = jnp.repeat(jnp.arange(z.shape[0]), 2)[order]
    return jnp.zeros_like(z).at[token].add(0.5 * jnp.tanh(z[token]))


def _copies_by_tile(z):
    """Each row's two copies laid out as ``[z, z]``, numbered by ``jnp.tile(jnp.arange(n), 2)``."""
    copies = jnp.concatenate([jnp.argmax(z[:, :4], -1), jnp.argmin(z[:, :4], -1)])
    token = jnp.tile(jnp.arange(z.shape[0]), 2)[jnp.argsort(copies)]
    return jnp.zeros_like(z).at[token].add(0.5 * jnp.tanh(z[token]))


def _scaled_by_the_sorted_expert(z):
    """Rows sorted by expert, each scaled by its expert's number gathered alike (an integer,
    the index's wrapping a literal the batch's size)."""
    expert = jnp.argmax(z[:, :4], -1)
    order = jnp.argsort(expert)
    return jnp.zeros_like(z).at[order].set(jnp.tanh(z[order]) * (expert[order] + 1)[:, None])


def _sorted_by_label_step(state, batch):
    """Logits and labels sorted alike, by label, for optax's integer-label cross-entropy."""

    def loss_fn(p):
        order = jnp.argsort(batch["y"])
        logits = state.apply_fn({"params": p}, batch["x"])[order]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"][order]).mean()

    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


# A three-operand einsum contracts in an order that depends on the sizes: the two traces differ
# there, and are compared around it.
_A = jax.random.normal(jax.random.key(2), (10, 8)) * 0.3
_B = jax.random.normal(jax.random.key(3), (8, 10)) * 0.3


def _einsum3(z):
    return jnp.einsum("nd,de,ef->nf", z, _A, _B)


@pytest.mark.parametrize(
    "step",
    [
        _step(on_logits=_top2_dropless),
        _step(on_logits=_inverse_by_scatter),
        _step(on_logits=_copies_by_token),
        _step(on_logits=_copies_by_tile),
        _sorted_by_label_step,
        _step(on_logits=_scaled_by_the_sorted_expert),
        _step(on_logits=lambda z: _scattered_back(_einsum3(z))),
        _step(on_logits=_scattered_back),
        _step(on_logits=_gathered_back),
        _step(on_logits=jax.jit(_scattered_back)),
        # a layer stack: each layer sorts, computes and scatters back (a sort's order is settled
        # over the loop's carries)
        _step(
            on_logits=lambda z: jax.lax.scan(lambda c, _: (_scattered_back(c), None), z, None, length=2)[0]
        ),
        _step(on_losses=lambda losses: jnp.sort(losses).mean()),  # a mean in any order
        # Sorted descending: keys and row numbers reversed, then the positions.
        _step(on_logits=lambda z: _scattered_back(z, descending=True)),
        _step(on_logits=lambda z: _gathered_back(z, descending=True)),
        _step(on_losses=lambda losses: jnp.sort(losses, descending=True).mean()),
        # The same keys sorted twice, by two sort equations: one order.
        _step(on_logits=_sorted_twice),
        _step(on_logits=_sorted_and_argsorted),
    ],
    ids=[
        "top2-dropless",
        "inverse-by-scatter",
        "copies-by-token",
        "copies-by-tile",
        "sorted-by-label",
        "scaled-by-the-sorted-expert",
        "scattered-back-after-einsum3",
        "scattered-back",
        "gathered-by-the-inverse",
        "scattered-back-in-jit",
        "scattered-back-in-scan",
        "sorted-mean",
        "descending-scattered-back",
        "descending-gathered-by-the-inverse",
        "descending-sorted-mean",
        "argsorted-twice",
        "sorted-and-argsorted",
    ],
)
def test_rows_sorted_and_put_back_in_the_batchs_order_equal_jit_with_microbatches(step):
    state, batches = _setup()
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=4)


@pytest.mark.parametrize(
    "step,meets",
    [
        # Rows sorted by a score, then read against the labels in the batch's order.
        (_step(on_logits=lambda z: z[jnp.argsort(z[:, 0])]), "mul|add|sub|gather|select_n|eq"),
        (_step(on_logits=lambda z: jnp.sort(z, axis=0)), "mul|add|sub|gather|select_n|eq"),
        (_step(on_logits=jax.jit(lambda z: z[jnp.argsort(z[:, 0])])), "mul|add|sub|gather|select_n|eq"),
        (
            _step(
                on_logits=lambda z: jax.lax.scan(
                    lambda c, _: (c[jnp.argsort(c[:, 0])], None), z, None, length=2
                )[0]
            ),
            "mul|add|sub|gather|select_n|eq",
        ),
        (
            _step(
                on_logits=lambda z: jax.lax.cond(
                    z.sum() > -1e9, lambda c: jnp.sort(c, axis=0), lambda c: c, z
                )
            ),
            "cond",
        ),
        (_step(on_logits=lambda z: _einsum3(z)[jnp.argsort(z[:, 0])]), "mul|add|sub|gather|select_n|eq"),
        # A weight per rank: the microbatch's ranks are not the batch's.
        (
            _step(
                on_losses=lambda losses: (jnp.sort(losses) * jnp.linspace(0.5, 1.5, losses.shape[0])).mean()
            ),
            "mul",
        ),
        # A permutation shifted, then put back: each row takes its neighbour's in the sort.
        (
            _step(
                on_logits=lambda z: (lambda o: jnp.zeros_like(z).at[o].set(z[(o + 1) % z.shape[0]]))(
                    jnp.argsort(z[:, 0])
                )
            ),
            "gather|scatter",
        ),
        # Rows by the permutation's remainders: not a permutation.
        (
            _step(
                on_logits=lambda z: (lambda o: jnp.zeros_like(z).at[o].set(z[o % 2]))(jnp.argsort(z[:, 0]))
            ),
            "gather",
        ),
        # Rows sorted descending against the same rows sorted ascending: the smallest with the largest.
        (_step(on_logits=lambda z: (lambda o: z[o] + z[o[::-1]])(jnp.argsort(z[:, 0]))), "add"),
        # Rows put back by another sort's permutation.
        (
            _step(
                on_logits=lambda z: jnp.zeros_like(z).at[jnp.argsort(z[:, 1])].set(z[jnp.argsort(z[:, 0])])
            ),
            "scatter",
        ),
    ],
    ids=[
        "argsort-gather",
        "sort",
        "argsort-gather-in-jit",
        "argsort-gather-in-scan",
        "sort-in-one-branch",
        "argsort-gather-after-einsum3",
        "weight-per-rank",
        "shifted-permutation",
        "remainders",
        "descending-against-ascending",
        "another-sorts-order",
    ],
)
def test_sorted_rows_meeting_another_order_are_an_error_with_microbatches(step, meets):
    _assert_refused_with_microbatches(
        step,
        rf"sorts the examples \(at .*test_example_order.*sort\[.*combines them.*({meets})"
        r".*num_microbatches=1",
    )


def _sorted_reversed_with_rows_in_order(z):
    """Keys reversed along the batch, sorted with row numbers that are not: the permutation numbers
    the reversed rows, and gathers the batch's by it."""
    _, order = jax.lax.sort((jnp.flip(z[:, 0]), jnp.arange(z.shape[0])), num_keys=1)
    return jnp.zeros_like(z).at[order].set(jnp.tanh(z[order]))


def test_keys_reversed_and_sorted_with_row_numbers_in_order_are_an_error_with_microbatches():
    _assert_refused_with_microbatches(
        _step(on_logits=_sorted_reversed_with_rows_in_order),
        r"reverses the rows \(at .*test_example_order.*rev\[.*reads them in that order \(at .*"
        r"(gather|scatter).*num_microbatches=4",
    )


def _by_half_positions(z):
    order = jnp.argsort(z[:, 0])
    return jnp.zeros_like(z).at[order].set(jnp.tanh(z[order // 2]))


def _back_by_half_positions(z):
    order = jnp.argsort(z[:, 0])
    return jnp.tanh(z[order])[jnp.argsort(order) // 2]


@pytest.mark.parametrize(
    "on_logits", [_by_half_positions, _back_by_half_positions], ids=["half", "back-half"]
)
def test_positions_of_a_sort_picking_rows_they_do_not_number_are_an_error_with_microbatches(on_logits):
    """``order // 2`` numbers the rows of an array half the sort's length (a token's two
    copies): on the sorted array itself it picks by place."""
    _assert_refused_with_microbatches(
        _step(on_logits=on_logits),
        r"sorts the examples \(at .*test_example_order.*sort\[.*picks the rows of another array by "
        r"its positions \(at .*gather.*: 4 rows, where the positions number 2\).*num_microbatches=1",
    )


def _copies_by_division(stacked):
    """Each row's two copies, sorted by an expert and added back to ``order // 2``'s row: right
    where the copies are side by side (``jnp.stack(..., 1).reshape(-1)``), not where they are two
    runs of all the rows (``jnp.concatenate``, ``jnp.stack(..., 0).reshape(-1)``)."""

    def on_logits(z):
        experts, gates = (jnp.argmax(z[:, :4], -1), jnp.argmin(z[:, :4], -1)), jnp.tanh(z[:, :2])
        if stacked == "side-by-side":
            copies, gate = jnp.stack(experts, 1).reshape(-1), gates.reshape(-1, 1)
        elif stacked == "runs":
            copies, gate = jnp.concatenate(experts), jnp.concatenate([gates[:, :1], gates[:, 1:]])
        else:
            copies, gate = jnp.stack(experts, 0).reshape(-1), gates.T.reshape(-1, 1)
        order = jnp.argsort(copies)
        return z + jnp.zeros_like(z).at[order // 2].add(gate[order] * z[order // 2])

    return on_logits


def _token_copies_by_token(z):
    """Tokens flattened from each example (two per row), each token's two copies side by side,
    sorted by expert and numbered by ``jnp.repeat(jnp.arange(tokens), 2)[order]``, the same as
    ``order // 2`` (before, refused: the numbers' layout was compared with the sorted rows' as it
    is, not as the tokens' copies)."""
    tokens = z.reshape(-1, 5)
    copies = jnp.stack([jnp.argmax(tokens[:, :4], -1), jnp.argmin(tokens[:, :4], -1)], 1).reshape(-1)
    order = jnp.argsort(copies)
    token = jnp.repeat(jnp.arange(tokens.shape[0]), 2)[order]
    return z + jnp.zeros_like(tokens).at[token].add(0.5 * jnp.tanh(tokens[token])).reshape(z.shape)


def _runs_by_plain_numbers(z):
    """Two runs of the rows sorted together and put back by ``jnp.arange(2n)[order]``, the
    permutation itself, laid out as the runs."""
    runs = jnp.concatenate([z, 2 * z])
    order = jnp.argsort(jnp.concatenate([jnp.argmax(z[:, :4], -1), jnp.argmin(z[:, :4], -1)]))
    idx = jnp.arange(runs.shape[0])[order]
    first, second = jnp.split(jnp.zeros_like(runs).at[idx].set(jnp.tanh(runs[idx])), 2)
    return z + first + second


def _tiled_back(z):
    runs = jnp.tanh(jnp.concatenate([z[:, :5], z[:, 5:]]))
    return z + runs.reshape(2, z.shape[0], 5).transpose(1, 0, 2).reshape(z.shape)


def _split_back(z):
    first, second = jnp.split(jnp.tanh(jnp.concatenate([z[:, :5], z[:, 5:]])), 2)
    return z + jnp.concatenate([second, first], axis=1)


def _noisy_views_split_back(z):
    """Two views of the rows with drawn noise (SimCLR's, DINO's crops) run as one batch and split
    back per view: each microbatch draws its rows of the whole batch's noise."""
    k1, k2 = jax.random.split(jax.random.key(3))
    views = jnp.concatenate(
        [z + 0.1 * jax.random.normal(k1, z.shape), z + 0.1 * jax.random.normal(k2, z.shape)]
    )
    first, second = jnp.split(jnp.tanh(views), 2)
    return z + first * second


def _sliced_back(z):
    """Points and points moved off them (IGR's, SAL's) run as one batch and sliced back at the
    runs' boundary, ``out[:n]`` and ``out[n:]`` (their transposes pad the cotangents back)."""
    n = z.shape[0]
    out = jnp.tanh(jnp.concatenate([z, z + 0.1 * jax.random.normal(jax.random.key(5), z.shape)]))
    return z + out[:n] * out[n:]


def _halves_swapped(z):
    half = z.shape[0] // 2
    return z + jnp.concatenate([z[half:], z[:half]])


@pytest.mark.parametrize(
    "on_logits",
    [
        _copies_by_division("side-by-side"),
        _token_copies_by_token,
        _runs_by_plain_numbers,
        _tiled_back,
        _split_back,
        _noisy_views_split_back,
        _sliced_back,
    ],
    ids=[
        "copies-side-by-side",
        "token-copies-by-token",
        "runs-by-plain-numbers",
        "runs-put-back",
        "runs-split-back",
        "noisy-views-split-back",
        "runs-sliced-back",
    ],
)
def test_rows_laid_out_as_copies_or_runs_and_put_back_equal_jit_with_microbatches(on_logits):
    state, batches = _setup()
    assert_same_as_jit(
        _step(on_logits=on_logits), state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=4
    )


@pytest.mark.parametrize(
    "on_logits,match",
    [
        (_copies_by_division("runs"), r"sorts the examples .*laid out otherwise than the sorted ones"),
        (_copies_by_division("transposed"), r"sorts the examples .*laid out otherwise than the sorted ones"),
        (
            lambda z: (
                z + (jnp.tanh(jnp.concatenate([z[:, :5], z[:, 5:]])) * z.reshape(-1, 5)).reshape(z.shape)
            ),
            r"combines rows laid out as runs of all the examples .* with rows laid out otherwise \(at "
            r".*test_example_order.*mul",
        ),
        (_halves_swapped, r"splits the rows into parts"),
    ],
    ids=["copies-as-runs", "copies-transposed", "runs-against-copies", "halves-swapped"],
)
def test_rows_laid_out_as_runs_against_copies_are_an_error_with_microbatches(on_logits, match):
    """A microbatch's runs of all its rows are not the whole batch's run for run: ``order // 2``
    on them, or their rows against copies side by side, pair other examples."""
    _assert_refused_with_microbatches(_step(on_logits=on_logits), rf"{match}.*num_microbatches=1")


def test_sorted_rows_returned_per_example_are_an_error_with_microbatches():
    _assert_refused_with_microbatches(
        _step(aux=lambda z: jnp.sort(z, axis=0)),
        r"Aux output 0 .* in the order of a sort \(at .*test_example_order",
    )


def _above_the_median_rank(losses):
    """Hard-example mining by ranks: the examples ranked in the upper half of the batch."""
    ranks = jnp.argsort(jnp.argsort(jax.lax.stop_gradient(losses)))
    return (losses * (ranks >= losses.shape[0] // 2)).mean() * 2


@pytest.mark.parametrize(
    "step",
    [
        _step(on_losses=_above_the_median_rank),
        _step(on_losses=lambda losses: (losses * jnp.linspace(0.5, 1.5, losses.shape[0])).mean()),
        _step(aux=lambda z: jnp.argsort(jnp.argsort(z[:, 0]))),
    ],
    ids=["ranks", "weight-per-row", "ranks-per-example"],
)
def test_positions_in_the_batch_read_as_numbers_are_an_error_with_microbatches(step):
    """A microbatch's ranks and row numbers are not the whole batch's."""
    _assert_refused_with_microbatches(step, r"positions in (the batch|their microbatch)")


def _class_token(z, reps=lambda n: (n, 1)):
    """A class token tiled to the batch and joined to each example's values, as ViT's and CLIP's
    code write it (``jnp.tile(cls, (b, 1, 1))``), then read with them."""
    token = jnp.tile(
        jnp.full((1, 1), 0.5) if reps(1)[0] == 1 else jnp.array([[0.5], [1.5]]), reps(z.shape[0])
    )
    h = jnp.concatenate([token, z], axis=1)
    return h[:, 1:] * h[:, :1]


def test_a_row_tiled_to_the_batch_equals_jit_with_microbatches():
    """A tile that repeats one row along the batch is the same in every row: no position."""
    state, batches = _setup()
    assert_same_as_jit(
        _step(on_logits=_class_token), state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=4
    )


def test_rows_tiled_to_the_batch_in_turn_are_an_error_with_microbatches():
    """Two rows tiled in turn along the batch: which one an example meets is its position."""
    _assert_refused_with_microbatches(
        _step(on_logits=lambda z: _class_token(z, reps=lambda n: (n // 2, 1))), r"positions in the batch"
    )


def _low_discrepancy_times(losses):
    """VDM's low-discrepancy times, one per row, made a line before they weigh the losses."""
    times = jnp.mod(0.3 + jnp.arange(losses.shape[0]) / losses.shape[0], 1.0)
    return (losses * times).mean()


def test_the_error_for_positions_read_as_numbers_names_where_they_are_made():
    line = inspect.getsourcelines(_low_discrepancy_times)[1] + 2
    _assert_refused_with_microbatches(
        _step(on_losses=_low_discrepancy_times),
        rf"positions in the batch \(at .*:{line + 1} .*mul.*, numbered at .*:{line} .*iota",
    )


def _python_loop_step(reduce):
    """Per-example losses by a Python loop over the rows, ``reduce``d."""

    def step(state, batch):
        def loss_fn(p):
            logits = state.apply_fn({"params": p}, batch["x"])
            ce = optax.softmax_cross_entropy_with_integer_labels
            return reduce([ce(z, y) for z, y in zip(logits, batch["y"], strict=True)])

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step


def _losses_by_vmap(state, batch):
    def loss_fn(p):
        logits = state.apply_fn({"params": p}, batch["x"])
        return jax.vmap(optax.softmax_cross_entropy_with_integer_labels)(logits, batch["y"]).mean()

    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


_ROW_BY_ROW = (
    # jax 0.10 slices each row (and pads it back), jax 0.12 unstacks them
    r"(places rows by their position in the batch|takes the batch's rows one by one) \(at "
    r".*test_example_order.*(pad|unstack)\[.*Python loop over the rows.*jax.vmap, or use num_microbatches=1"
)

_ROW_OR_PLACE = rf"{_ROW_BY_ROW}|takes examples by their place .*slice\["


@pytest.mark.parametrize(
    "reduce,match",
    [
        (lambda losses: jnp.stack(losses).mean(), _ROW_BY_ROW),
        # jax 0.10 may pair the traces so that a row's slice is a pick by place
        (sum, _ROW_OR_PLACE),
        (lambda losses: jnp.stack(losses[:2]).mean(), _ROW_OR_PLACE),
    ],
    ids=["mean", "sum", "first-two"],
)
def test_a_python_loop_over_the_rows_in_the_loss_function_is_an_error_that_names_vmap(reduce, match):
    """The loop makes one equation per row: the traces at one microbatch and at the whole batch
    differ there, and the rows cannot be followed through it (a sum by Python's ``+`` would be a
    sum over the microbatch). The same with jax.vmap is one equation for all rows, and equals
    jit."""
    _assert_refused_with_microbatches(_python_loop_step(reduce), match)
    state, batches = _setup()
    assert_same_as_jit(_losses_by_vmap, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=4)


def _capacity_routing(losses):
    """Sort-based top-1 routing of the examples to 4 experts with a capacity computed from their
    count (``int(1.25 * n / 4)``), the overflow dropped into a padding row: which examples an
    expert keeps depends on the whole batch."""
    n, experts = losses.shape[0], 4
    e = (jax.lax.stop_gradient(losses) * 7).astype(jnp.int32) % experts
    order = jnp.argsort(e, stable=True)
    counts = jnp.bincount(e, length=experts)
    rank = jnp.arange(n) - (jnp.cumsum(counts) - counts)[e[order]]
    cap = max(1, int(1.25 * n / experts))
    slot = jnp.where(rank < cap, e[order] * cap + rank, experts * cap)
    buf = jnp.zeros(experts * cap + 1).at[slot].set(losses[order])
    return jnp.mean(buf[slot] ** 2)


def test_a_buffer_sized_out_of_proportion_to_the_batch_is_an_error_with_microbatches():
    _assert_refused_with_microbatches(
        _step(on_losses=_capacity_routing),
        r"size follows the batch out of proportion \(at .*test_example_order.*\[5\] for one of "
        r"num_microbatches=4, .*\[21\] for the batch\).*capacity per sequence",
    )
