"""Random draws that follow the batch (dropout masks, noise, keys split per example) with
several microbatches: each microbatch makes its rows of the whole batch's draw, so the step
equals ``jax.jit``'s."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from equality import TOLERANCES, as_numpy, assert_same_as_jit, dropout_step

import autopar
from autopar._src import draw_layout, microbatch_draws
from models import train

BATCH = 16


def _plain_dropout(x, key):
    return x * jax.random.bernoulli(key, 0.5, x.shape) * 2


@jax.custom_vjp
def _custom_vjp_dropout(x, key):
    return _plain_dropout(x, key)


def _dropout_fwd(x, key):
    mask = jax.random.bernoulli(key, 0.5, x.shape) * 2
    return x * mask, mask


_custom_vjp_dropout.defvjp(_dropout_fwd, lambda mask, g: (g * mask, None))


@pytest.mark.parametrize(
    ("shape", "whole", "dim", "runs"),
    [
        ((2, 3), (8, 3), 0, 1),
        ((4, 3, 5), (4, 12, 5), 1, 1),
        # Flat indices past 2**32, counted in two words; the first dim's stride too.
        ((2, 3), (2 * 2**31 - 2, 3), 0, 1),
        ((3, 2, 4), (3, 2 * 2**30, 4), 1, 1),
        ((2, 3, 5), (2, 3 * 2**30, 5), 1, 1),
        # Runs of the examples: the microbatch's rows of each.
        ((6, 3), (24, 3), 0, 2),
        ((2, 6, 5), (2, 18, 5), 1, 3),
        ((4, 3), (2 * 2**31, 3), 0, 2),
    ],
)
def test_counters_are_the_flat_indices_of_the_microbatchs_rows_in_the_whole_draw(shape, whole, dim, runs):
    scaled = microbatch_draws.Scaled(whole, dim, runs)
    strides = [int(np.prod(whole[k + 1 :], dtype=object)) for k in range(len(whole))]
    num_microbatches = whole[dim] // shape[dim]
    rows = shape[dim] // runs  # in each run
    for index in (0, 1, num_microbatches - 1):
        hi, lo = microbatch_draws._counters(shape, scaled, jnp.uint32(index))
        got = np.asarray(hi).astype(object) * 2**32 + np.asarray(lo).astype(object)
        for at in np.ndindex(*shape):
            run, row = divmod(at[dim], rows)
            whole_row = run * whole[dim] // runs + index * rows + row
            place = [whole_row if k == dim else a for k, a in enumerate(at)]
            assert got[at] == sum(r * s for r, s in zip(place, strides, strict=True)), (at, index)


@pytest.mark.parametrize(
    ("runs", "before", "after", "dims", "expected"),
    [
        (1, (8, 3), (2, 4, 3), (0, 1), None),  # two runs split off, but the draw is one block
        (2, (8, 3), (2, 4, 3), (0, 1), 1),
        (4, (8, 3), (2, 4, 3), (0, 1), 2),
        (1, (8, 3), (4, 2, 3), (0, 0), 1),  # each example's rows split off after it
        (2, (8, 3), (4, 2, 3), (0, 0), 2),
        (1, (5, 4, 3), (20, 3), (1, 0), 5),  # time-major: the tokens before the batch make runs
        (1, (4, 5, 3), (20, 3), (0, 0), 1),
        (3, (6, 3), (2, 3, 3), (0, 1), None),
    ],
)
def test_a_reshape_splits_or_merges_runs_of_the_examples(runs, before, after, dims, expected):
    assert draw_layout._regrouped(runs, before, after, *dims) == expected


def test_threefry_draws_are_made_alone_other_prngs_are_cut_from_the_whole_draw():
    assert microbatch_draws.supported("threefry2x32")
    assert not microbatch_draws.supported("rbg")


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
@pytest.mark.parametrize(
    "dropout",
    [
        lambda x, key: nn.Dropout(0.5, deterministic=False).apply({}, x, rngs={"dropout": key}),
        jax.checkpoint(_plain_dropout),  # the key is read inside a rematerialised block
        _custom_vjp_dropout,
    ],
    ids=["flax", "remat", "custom-vjp"],
)
def test_each_microbatch_draws_its_rows_of_the_whole_batchs_mask(make_key, dropout):
    step = dropout_step(dropout)

    w, batch, key = jnp.ones(()), {"x": jax.random.normal(jax.random.key(3), (BATCH, 32))}, make_key(1)
    expected = jax.jit(step)(w, batch, key)
    par = autopar.autoparallel(step, num_stages=1, num_microbatches=4, batch_argnums=1)
    out = par(w, batch, key)
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(expected[1]))  # the same masks
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(expected[0]), **TOLERANCES["sgd"])
    np.testing.assert_array_equal(as_numpy(out[2]), as_numpy(key))  # returned as it came
    np.testing.assert_array_equal(as_numpy(out[3]), as_numpy(expected[3]))  # split as under jit
    # Each microbatch reads its index, made once per step; no key is folded.
    modes = {op.mode for t in par.executable(w, batch, key).program.tasks for op in t.ops if op.kind == "acc"}
    assert "index" in modes and "fold" not in modes


def _keyed_sgd_step(loss_fn):
    """A step over ``(weights, key)``: splits the key, takes an SGD step on ``loss_fn(w, x, sub)``."""

    def step(state, batch):
        w, key = state
        key, sub = jax.random.split(key)
        loss, grad = autopar.value_and_grad(loss_fn)(w, batch["x"], sub)
        return (jax.tree.map(lambda p, g: p - 0.1 * g, w, grad), key), loss

    return step


def _time_major(x, key):
    h = jnp.swapaxes(x, 0, 1)  # [tokens, batch, features]: the batch is the draw's second dim
    return jnp.swapaxes(h * jax.random.bernoulli(key, 0.7, h.shape), 0, 1)


def _split_per_example(x, key):
    keys = jax.random.split(key, x.shape[0])
    return jax.vmap(lambda k, row: row * jax.random.bernoulli(k, 0.7, row.shape))(keys, x)


def _in_cond(x, key):
    return jax.lax.cond(jnp.sum(x) > -1e9, lambda h: _plain_dropout(h, key), lambda h: h, x)


def _in_a_loop(x, key):
    def body(_, carry):
        h, k = carry
        k, sub = jax.random.split(k)
        return jnp.tanh(h) * jax.random.bernoulli(sub, 0.8, h.shape), k

    return jax.lax.fori_loop(0, 3, body, (x, key))[0]


def _noise_per_example(x, key):
    return x + 0.1 * jax.random.normal(key, (x.shape[0], 1, x.shape[2]))


def _diffusion(x, key):
    # A noise level per example and Gaussian noise, drawn inside the loss function.
    k_level, k_noise = jax.random.split(key)
    level = jax.random.randint(k_level, (x.shape[0], 1, 1), 0, 10) / 10
    return jnp.sqrt(1 - level) * x + jnp.sqrt(level) * jax.random.normal(k_noise, x.shape)


def _poisson(x, key):
    # Drawn in while loops (whose predicates read constants) over keys split per element.
    return x * jax.random.poisson(key, 1.5, x.shape) / 1.5


def _gamma_family(x, key):
    # Gamma, beta and Dirichlet variates per example: their primitive splits the key per element.
    k_gamma, k_beta, k_dirichlet = jax.random.split(key, 3)
    gamma = jax.random.gamma(k_gamma, 1.0 + jnp.abs(x))
    beta = jax.random.beta(k_beta, 2.0, 3.0, x.shape)
    return x * gamma * beta * jax.random.dirichlet(k_dirichlet, jnp.ones(x.shape[-1]), x.shape[:-1])


def _gamma_per_example_key(x, key):
    keys = jax.random.split(key, x.shape[0])
    return x * jax.vmap(jax.random.gamma)(keys, 1.0 + jnp.abs(x[:, 0, 0]))[:, None, None]


def _bytes(x, key):
    return x * (jax.random.bits(key, x.shape, jnp.uint8) < 200)


def _two_runs(x, key):
    # One draw for two views of the batch, its examples in the second dim: two runs of them.
    masks = jax.random.bernoulli(key, 0.7, (2 * x.shape[0], *x.shape[1:])).reshape(2, *x.shape)
    return x * masks[0] + jnp.roll(x, 1, axis=-1) * masks[1]


def _flat_time_major(x, key):
    # Drawn flat, tokens outermost, then regrouped: ``[tokens * batch, features]``.
    h = jnp.swapaxes(x, 0, 1)
    mask = jax.random.bernoulli(key, 0.7, (h.shape[0] * h.shape[1], h.shape[2])).reshape(h.shape)
    return jnp.swapaxes(h * mask, 0, 1)


def _flattened(x, key):
    # Tokens flattened into the batch's rows, ``[batch * tokens, features]``, and back.
    flat = x.reshape(-1, x.shape[-1])
    return (flat * jax.random.bernoulli(key, 0.7, flat.shape)).reshape(x.shape)


DRAWS = {
    "time-major": (_time_major, jax.random.key),
    "split-per-example": (_split_per_example, jax.random.key),
    "cond": (_in_cond, jax.random.key),
    "fori-loop": (_in_a_loop, jax.random.PRNGKey),
    "noise": (_noise_per_example, jax.random.key),
    "diffusion": (_diffusion, jax.random.PRNGKey),
    "uint8": (_bytes, jax.random.key),
    "poisson": (_poisson, jax.random.key),
    "gamma-beta-dirichlet": (_gamma_family, jax.random.PRNGKey),
    "gamma-per-example-key": (_gamma_per_example_key, jax.random.key),
    "rbg-key": (_time_major, lambda seed: jax.random.key(seed, impl="rbg")),
    "two-runs": (_two_runs, jax.random.key),
    "flat-time-major": (_flat_time_major, jax.random.PRNGKey),
    "flattened": (_flattened, jax.random.key),
    "two-runs-rbg": (_two_runs, lambda seed: jax.random.key(seed, impl="rbg")),
}


@pytest.mark.parametrize("name", DRAWS)
def test_draws_that_follow_the_batch_equal_jit_over_microbatches_and_stages(name):
    drop, make_key = DRAWS[name]

    def loss_fn(w, x, key):
        h = drop(jnp.tanh(x @ w["a"]), key)
        return jnp.mean(drop(jnp.tanh(h @ w["b"]), jax.random.fold_in(key, 1)) ** 2)

    step = _keyed_sgd_step(loss_fn)

    w = {k: jax.random.normal(jax.random.key(i), (8, 8)) * 0.3 for i, k in enumerate("ab")}
    batches = [{"x": jax.random.normal(jax.random.key(10 + i), (BATCH, 6, 8))} for i in range(3)]
    assert_same_as_jit(step, (w, make_key(1)), batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=4)


def test_two_views_of_a_draw_that_meet_each_other_alone_are_jits_runs():
    """``(2B, d)`` reshaped to ``(2, B, d)``: its views meet no value of the batch, only each other,
    example ``i``'s rows of both runs, as ``jax.jit`` pairs them."""

    def loss_fn(w, x, key):
        views = jax.random.normal(key, (2 * x.shape[0], x.shape[-1])).reshape(2, x.shape[0], x.shape[-1])
        pairs = jnp.tanh(views[0] @ w["a"]) * jnp.tanh(views[1] @ w["a"])
        return jnp.mean(jnp.tanh(x.mean(1) @ w["a"]) ** 2) + jnp.mean(pairs)

    w = {"a": jax.random.normal(jax.random.key(0), (8, 8)) * 0.3}
    batches = [{"x": jax.random.normal(jax.random.key(10 + i), (BATCH, 6, 8))} for i in range(2)]
    step = _keyed_sgd_step(loss_fn)
    assert_same_as_jit(
        step, (w, jax.random.key(1)), batches, TOLERANCES["sgd"], num_stages=1, num_microbatches=4
    )


def test_dropout_on_rows_folded_from_channels_meets_the_inputs_statistics_on_a_later_stage():
    """A channel-independent forecaster (PatchTST's, DLinear's): channels folded into the rows,
    dropout on them, then de-normalised by each series' statistics of the inputs, which cross
    the stage boundary beside the dropped values. The boundary passes each value on as it is
    (before, its values were all laid out as its first one's: keys folded, masks not jit's)."""

    def loss_fn(w, x, key):
        mean, std = x.mean(1, keepdims=True), x.std(1, keepdims=True)
        b, steps, channels = x.shape
        z = x.transpose(0, 2, 1).reshape(b * channels, steps)
        for i, k in enumerate("abcd"):
            z = jnp.tanh(z @ w[k])
            z = z * jax.random.bernoulli(jax.random.fold_in(key, i), 0.5, z.shape) / 0.5
        y = (z @ w["e"]).reshape(b, channels, -1).transpose(0, 2, 1)
        return jnp.mean((y * std + mean) ** 2)

    shapes = {"a": (6, 16), "b": (16, 16), "c": (16, 16), "d": (16, 16), "e": (16, 4)}
    w = {k: jax.random.normal(jax.random.key(i), s) * 0.3 for i, (k, s) in enumerate(shapes.items())}
    batches = [{"x": 1.0 + 3.0 * jax.random.normal(jax.random.key(10 + i), (BATCH, 6, 8))} for i in range(2)]
    step = _keyed_sgd_step(loss_fn)
    assert_same_as_jit(
        step, (w, jax.random.key(1)), batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=2
    )


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return nn.Dropout(0.5, deterministic=False)(nn.Dense(16)(h)), None


class _Lifted(nn.Module):
    lift: str

    @nn.compact
    def __call__(self, x):
        lifted = {"params": True, "dropout": True}  # flax clones the key, then splits it per layer
        if self.lift == "scan":
            return nn.scan(_Block, variable_axes={"params": 0}, split_rngs=lifted, length=2)()(x, None)[0]
        stack = nn.vmap(
            _Block, variable_axes={"params": 0}, split_rngs=lifted, in_axes=(None, None), axis_size=2
        )
        return stack()(x, None)[0].mean(axis=0)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
@pytest.mark.parametrize("lift", ["scan", "vmap"])
def test_keys_split_by_lifted_layer_stacks_draw_jits_masks(lift, make_key):
    model = _Lifted(lift)
    params = model.init(jax.random.key(0), jnp.zeros((BATCH, 16)))["params"]

    def step(state, batch):
        params, key = state
        key, sub = jax.random.split(key)

        def loss_fn(p):
            return jnp.mean(model.apply({"params": p}, batch["x"], rngs={"dropout": sub}) ** 2)

        loss, grad = autopar.value_and_grad(loss_fn)(params)
        return (jax.tree.map(lambda p, g: p - 0.1 * g, params, grad), key), loss

    batches = [{"x": jax.random.normal(jax.random.key(i), (BATCH, 16))} for i in range(3)]
    state = (params, make_key(1))
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=1, num_microbatches=4)


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
    assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], num_stages=2, num_microbatches=4)


@pytest.mark.parametrize("placed", [False, True])
def test_a_typed_key_read_on_every_stage_moves_between_them(placed):
    # The loss reads the state's key in every layer, so each step moves the new key from the
    # stage that splits it to the others (and, placed on all 8 devices, to both at the start),
    # and the microbatch's index from the first stage that draws to the other.
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

    assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], num_stages=2, num_microbatches=2)


class _NoisyBlock(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic):
        # No attention biases: a key bias has no gradient, and Adam would amplify its rounding.
        attention = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.2, use_bias=False)
        h = attention(nn.LayerNorm()(x), deterministic=deterministic)
        keep = jax.random.bernoulli(self.make_rng("dropout"), 0.8, (x.shape[0], 1, 1))  # drop path
        x = x + jnp.where(keep, h / 0.8, 0)
        tokens = nn.LayerNorm()(x).reshape(-1, x.shape[-1])
        logits = nn.Dense(4)(tokens)  # noisy gating over 4 experts, per token
        noise = jax.random.normal(self.make_rng("dropout"), logits.shape) * nn.softplus(nn.Dense(4)(tokens))
        experts = nn.Dense(4 * x.shape[-1])(tokens).reshape(-1, 4, x.shape[-1])
        y = jnp.einsum("te,ted->td", jax.nn.softmax(logits + noise), experts).reshape(x.shape)
        uniform = jax.random.uniform(self.make_rng("dropout"), y.shape, minval=1e-6, maxval=1.0)
        return x + nn.Dropout(0.1)(y - 0.01 * jnp.log(-jnp.log(uniform)), deterministic=deterministic)


class _NoisyNet(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(50, 32)(ids)
        for _ in range(3):
            x = nn.remat(_NoisyBlock, static_argnums=(2,))()(x, False)
        return nn.Dense(50)(x)


@pytest.mark.parametrize(
    "options",
    [
        {"num_stages": 2, "num_microbatches": 4},
        pytest.param({"num_stages": 1, "num_microbatches": 2, "mesh_shape": (4, 2)}, marks=pytest.mark.slow),
    ],
    ids=["2-stages", "4x2-mesh"],
)
def test_attention_dropout_drop_path_and_noisy_gating_in_remat_blocks_equal_jit(options):
    net = _NoisyNet()
    rng = np.random.default_rng(0)
    batches = [{"ids": rng.integers(0, 50, (BATCH, 8)).astype(np.int32)} for _ in range(3)]
    params = net.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, batches[0]["ids"])[
        "params"
    ]
    tx = optax.adamw(1e-2, eps=1e-5)

    def step(state, batch):
        params, opt_state, key = state
        key, sub = jax.random.split(key)

        def loss_fn(p):
            logits = net.apply({"params": p}, batch["ids"], rngs={"dropout": sub})
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["ids"][:, 1:]).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), loss

    state = (params, tx.init(params), jax.random.PRNGKey(3))
    assert_same_as_jit(step, state, batches, TOLERANCES["adamw"], **options)


def _augment(key, image):
    k_crop, k_flip = jax.random.split(key)
    dy, dx = jax.random.randint(k_crop, (2,), 0, 3)
    padded = jnp.pad(image, ((1, 1), (1, 1), (0, 0)), mode="reflect")
    crop = jax.lax.dynamic_slice(padded, (dy, dx, 0), image.shape)
    return jnp.where(jax.random.bernoulli(k_flip), crop[:, ::-1], crop)


class _SmallCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.relu(nn.Conv(8, (3, 3), strides=2)(x))
        return nn.Dense(10)(x.mean((1, 2)))


def test_random_crops_and_flips_per_example_inside_the_loss_equal_jit():
    # On-device augmentation: one key per example, a random crop offset and flip each.
    net = _SmallCNN()
    params = net.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]
    tx = optax.sgd(0.1)

    def step(state, batch):
        params, opt_state, key = state
        key, sub = jax.random.split(key)

        def loss_fn(p):
            images = jax.vmap(_augment)(jax.random.split(sub, batch["x"].shape[0]), batch["x"])
            logits = net.apply({"params": p}, images)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), loss

    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(BATCH, 8, 8, 3)).astype(np.float32),
            "y": rng.integers(0, 10, BATCH).astype(np.int32),
        }
        for _ in range(3)
    ]
    state = (params, tx.init(params), jax.random.key(1))
    assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=4)


def test_a_per_step_and_a_per_example_draw_of_one_shape_in_a_body_each_keep_their_kind():
    # Weight noise on a [4, 4] weight and dropout on [4, 4] activations (4 examples per
    # microbatch) by one checkpointed helper inside a scan: JAX's jit cache makes both one
    # equation object at the microbatch's size; only the dropout's rows follow the batch.
    drop = jax.checkpoint(lambda h, k: h * jax.random.bernoulli(k, 0.6, h.shape) / 0.6)

    def loss_fn(w, x, key):
        def layer(h, wk):
            wl, k = wk
            return drop(jnp.tanh(h @ drop(wl, jax.random.fold_in(k, 2))), k), None

        h, _ = jax.lax.scan(layer, x, (w, jax.random.split(key, 2)))
        return jnp.mean(h**2)

    step = _keyed_sgd_step(loss_fn)

    w = jax.random.normal(jax.random.key(0), (2, 4, 4)) * 0.5
    batches = [{"x": jax.random.normal(jax.random.key(10 + i), (BATCH, 4))} for i in range(2)]
    assert_same_as_jit(
        step, (w, jax.random.key(1)), batches, TOLERANCES["sgd"], num_stages=1, num_microbatches=4
    )


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_a_mask_is_drawn_split_over_the_data_axis_each_device_making_its_rows(num_microbatches):
    def loss_fn(w, x, key):
        h = jnp.tanh(x @ w["a"])
        return jnp.mean(jnp.tanh((h * jax.random.bernoulli(key, 0.7, h.shape)) @ w["b"]) ** 2)

    step = _keyed_sgd_step(loss_fn)

    w = {k: jax.random.normal(jax.random.key(i), (64, 64)) * 0.3 for i, k in enumerate("ab")}
    batches = [{"x": jax.random.normal(jax.random.key(10 + i), (64, 16, 64))} for i in range(3)]
    state = (w, jax.random.key(1))
    options = dict(num_stages=1, num_microbatches=num_microbatches, mesh_shape=(8,))
    par = assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], **options)
    exe = par.executable(state, batches[0])
    rows = 64 // num_microbatches
    if num_microbatches == 1:  # jax.random's own draw
        draws = [
            (t.stage, k)
            for t in exe.program.tasks
            for op in t.ops
            if op.kind == "eqn" and op.eqn.primitive.name == "random_bits"
            for k in op.outs
        ]
        specs = [exe.spec(k, stage) for stage, k in draws]
    else:  # threefry of the microbatch's counters, inside the call that reads its index
        specs = [p.spec for k, p in exe._inner_pins(0).items() if k.var.aval.shape == (rows, 16, 64)]
    assert specs and all(spec == jax.sharding.PartitionSpec("data", None, None) for spec in specs)


def _masked_patches(x, key, fixed):
    """MAE's mask over each example's patches: ``keep`` of them at places a random permutation
    picks (``fixed``), or each patch kept with probability 1/4."""
    b, patches = x.shape[0], x.shape[1]
    if not fixed:
        return jax.random.bernoulli(key, 0.75, (b, patches)).astype(jnp.float32)
    ids = jnp.argsort(jax.random.uniform(key, (b, patches)), axis=1)
    return (jnp.argsort(ids, axis=1) >= patches // 4).astype(jnp.float32)


@pytest.mark.parametrize("fixed", [True, False], ids=["permuted-count-fixed", "bernoulli-count-drawn"])
def test_a_loss_divided_by_a_drawn_masks_count_equals_jit_where_every_draw_counts_the_same(fixed):
    """MAE's loss ``sum(l * mask) / sum(mask)``: the count of masked patches is the same for every
    draw (each example masks as many), so each microbatch's is its share and the loss is
    ``jax.jit``'s. A count that changes with the draw is each microbatch's own: an error."""

    def loss_fn(w, x, key):
        mask = _masked_patches(x, key, fixed)
        losses = jnp.mean((jnp.tanh(x @ w) - x) ** 2, axis=-1)
        return jnp.sum(losses * mask) / jnp.sum(mask)

    w = jax.random.normal(jax.random.key(0), (6, 6)) * 0.3
    batches = [{"x": jax.random.normal(jax.random.key(10 + i), (BATCH, 8, 6))} for i in range(2)]
    step, state = _keyed_sgd_step(loss_fn), (w, jax.random.key(1))
    if fixed:
        assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=1, num_microbatches=4)
        return
    with pytest.raises(
        ValueError, match=r"divides by a sum over the examples of what the model computes or draws"
    ):
        autopar.autoparallel(step, num_stages=1, num_microbatches=4)(state, batches[0])
