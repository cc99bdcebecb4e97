"""More models written the way users write them, each over two stages and two microbatches
against ``jax.jit``.

- A diffusion U-Net: GroupNorm, SiLU, ``avg_pool`` down and ``ConvTranspose`` up, skip
  connections concatenated across the stages, a sinusoidal timestep embedding read by every
  block, and the noised input made outside the loss from a table gathered by timestep.
- LoRA: frozen kernels behind ``stop_gradient`` with trainable low-rank adapters, and an
  ``optax.multi_transform`` that freezes everything else.
- An encoder-decoder: rotary self-attention, cross-attention to the encoder's output on every
  decoder block, a padding mask, RMSNorm, a tied output embedding and label smoothing.
- A linear recurrence by ``lax.associative_scan`` whose output clips its gradient in a
  ``custom_vjp`` (not linear in the cotangent).
- A ViT: a strided patch convolution, a class token and learned positions, Flax's
  ``MultiHeadDotProductAttention``, and a per-example flip by ``lax.map`` before the loss.
- A recommender: multi-hot bags of an embedding table pooled by ``segment_sum``, a dot
  interaction, Adagrad.
- A speech recogniser: a convolution, a bidirectional GRU and ``optax.ctc_loss`` (a scan over
  the frames).
- A rematerialised ``nn.scan`` stack (unrolled by two) that saves only a named value
  (``save_only_these_names`` and ``checkpoint_name``).
- FNet: token mixing by a 2-D Fourier transform.
- A message-passing graph network over a jraph-style batch: graphs concatenated, nodes
  indexed by edges across the batch, so it is not cut into microbatches.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from equality import TOLERANCES, assert_same_as_jit, classifier_step
from flax.training import train_state
from jax.ad_checkpoint import checkpoint_name

import autopar
from autopar._src import intra_op

D = 32


def _train(net, tx, *example):
    params = net.init(jax.random.key(0), *example)["params"]
    return train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)


def _state_step(loss_of):
    """A ``TrainState`` step minimising ``loss_of(params, batch)``."""

    def step(state, batch):
        loss, grads = autopar.value_and_grad(lambda p: loss_of(p, batch))(state.params)
        return state.apply_gradients(grads=grads), loss

    return step


def _batches(seed, **makers):
    """Three batches, each leaf ``makers[name](rng)``."""
    rng = np.random.default_rng(seed)
    return [{name: make(rng) for name, make in makers.items()} for _ in range(3)]


def _normal(*shape):
    return lambda rng: rng.normal(size=shape).astype(np.float32)


def _ints(high, *shape):
    return lambda rng: rng.integers(0, high, shape).astype(np.int32)


def _check(step, state, batches, optimizer):
    par = assert_same_as_jit(step, state, batches, TOLERANCES[optimizer], num_stages=2, num_microbatches=2)
    assert len(par.plan(state, batches[0]).stages) == 2


# --- a diffusion U-Net


def _timestep_embedding(t, dim):
    freqs = jnp.exp(-jnp.log(10000.0) * jnp.arange(dim // 2) / (dim // 2))
    angles = t[:, None].astype(jnp.float32) * freqs[None]
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], -1)


class ResBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x, temb):
        h = nn.Conv(self.channels, (3, 3))(jax.nn.silu(nn.GroupNorm(4)(x)))
        h = h + nn.Dense(self.channels)(jax.nn.silu(temb))[:, None, None, :]
        h = nn.Conv(self.channels, (3, 3))(jax.nn.silu(nn.GroupNorm(4)(h)))
        if x.shape[-1] != self.channels:
            x = nn.Conv(self.channels, (1, 1))(x)
        return x + h


class UNet(nn.Module):
    @nn.compact
    def __call__(self, x, t):
        temb = nn.Dense(D)(jax.nn.silu(nn.Dense(D)(_timestep_embedding(t, 16))))
        h = nn.Conv(8, (3, 3))(x)
        skips = []
        for channels in (8, 16):
            h = ResBlock(channels)(h, temb)
            skips.append(h)
            h = nn.avg_pool(h, (2, 2), (2, 2))
        h = ResBlock(16)(h, temb)
        for channels in (16, 8):
            h = nn.ConvTranspose(channels, (2, 2), (2, 2))(h)
            h = ResBlock(channels)(jnp.concatenate([h, skips.pop()], -1), temb)
        return nn.Conv(x.shape[-1], (3, 3))(jax.nn.silu(nn.GroupNorm(4)(h)))


ALPHAS = jnp.cumprod(1 - jnp.linspace(1e-4, 0.02, 100))


def _denoising_step(draw_noise: bool):
    net = UNet()

    def step(state, batch):
        x0, t = batch["image"], batch["t"]
        noise = jax.random.normal(jax.random.key(7), x0.shape) if draw_noise else batch["noise"]
        a = ALPHAS[t][:, None, None, None]
        noisy = jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise

        def loss_fn(p):
            return jnp.mean((net.apply({"params": p}, noisy, t) - noise) ** 2)

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    state = _train(net, optax.adamw(1e-3, eps=1e-5), jnp.zeros((8, 8, 8, 3)), jnp.zeros((8,), jnp.int32))
    rng = np.random.default_rng(0)
    batches = [
        {
            "image": rng.normal(size=(8, 8, 8, 3)).astype(np.float32),
            "noise": rng.normal(size=(8, 8, 8, 3)).astype(np.float32),
            "t": rng.integers(0, 100, 8).astype(np.int32),
        }
        for _ in range(3)
    ]
    return step, state, batches


def test_a_diffusion_unet_with_the_noise_in_the_batch_equals_jit():
    _check(*_denoising_step(draw_noise=False), "adamw")


def test_a_diffusion_unet_drawing_batch_shaped_noise_outside_the_loss_equals_jit():
    """Each microbatch draws its rows of the noise ``jax.jit`` draws for the whole batch."""
    _check(*_denoising_step(draw_noise=True), "adamw")


# --- LoRA


class LoRADense(nn.Module):
    features: int
    rank: int = 4

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        a = self.param("lora_a", nn.initializers.normal(0.02), (x.shape[-1], self.rank))
        b = self.param("lora_b", nn.initializers.normal(0.02), (self.rank, self.features))
        return x @ jax.lax.stop_gradient(kernel) + (x @ a) @ b * 2.0


class LoRANet(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = x + jax.nn.gelu(LoRADense(D)(nn.LayerNorm()(x)))
        return nn.Dense(10)(x)


def test_lora_adapters_over_frozen_kernels_equal_jit():
    net = LoRANet()
    params = net.init(jax.random.key(0), jnp.zeros((8, D)))["params"]
    trained = jax.tree_util.tree_map_with_path(
        lambda path, _: "train" if "lora" in jax.tree_util.keystr(path) else "freeze", params
    )
    tx = optax.multi_transform({"train": optax.adamw(1e-2, eps=1e-5), "freeze": optax.set_to_zero()}, trained)
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)
    batches = _batches(1, x=_normal(8, D), y=_ints(10, 8))
    step = classifier_step("x", "y")
    _check(step, state, batches, "adamw")
    # The frozen kernels did not move.
    after = autopar.autoparallel(step, num_stages=2, num_microbatches=2)(state, batches[0])[0]
    np.testing.assert_array_equal(
        after.params["LoRADense_0"]["kernel"], state.params["LoRADense_0"]["kernel"]
    )


# --- an encoder-decoder


def _rotary(x):
    t, d = x.shape[-3], x.shape[-1]
    angles = jnp.arange(t)[:, None] / (10000 ** (jnp.arange(0, d, 2) / d))[None]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    even, odd = x[..., ::2], x[..., 1::2]
    return jnp.stack([even * cos - odd * sin, even * sin + odd * cos], -1).reshape(x.shape)


class Attention(nn.Module):
    causal: bool = False

    @nn.compact
    def __call__(self, x, context=None, mask=None):
        cross = context is not None
        context = x if context is None else context
        q = nn.DenseGeneral((2, 16))(x)
        k = nn.DenseGeneral((2, 16))(context)
        v = nn.DenseGeneral((2, 16))(context)
        if not cross:
            q, k = _rotary(q), _rotary(k)
        w = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
        if self.causal:
            w = jnp.where(jnp.tril(jnp.ones((x.shape[1], context.shape[1]), bool)), w, -1e9)
        if mask is not None:
            w = jnp.where(mask[:, None, None, :], w, -1e9)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(w, -1), v)
        return nn.DenseGeneral(D, axis=(-2, -1))(out)


class EncoderDecoder(nn.Module):
    @nn.compact
    def __call__(self, source, target):
        embed = nn.Embed(64, D)
        pad = source > 0

        def mlp(h):
            return nn.Dense(D)(jax.nn.relu(nn.Dense(2 * D)(nn.RMSNorm()(h))))

        e = embed(source)
        for _ in range(2):
            e = e + Attention()(nn.RMSNorm()(e), mask=pad)
            e = e + mlp(e)
        e = nn.RMSNorm()(e)
        d = embed(target)
        for _ in range(2):
            d = d + Attention(causal=True)(nn.RMSNorm()(d))
            d = d + Attention()(nn.RMSNorm()(d), context=e, mask=pad)
            d = d + mlp(d)
        return embed.attend(nn.RMSNorm()(d))


def test_an_encoder_decoder_with_cross_attention_equals_jit():
    net = EncoderDecoder()
    state = _train(net, optax.sgd(0.1), jnp.ones((8, 12), jnp.int32), jnp.ones((8, 10), jnp.int32))

    @_state_step
    def step(p, batch):
        logits = net.apply({"params": p}, batch["source"], batch["target_in"])
        labels = optax.smooth_labels(jax.nn.one_hot(batch["target_out"], 64), 0.1)
        return optax.softmax_cross_entropy(logits, labels).mean()

    rng = np.random.default_rng(2)

    def batch():
        source = rng.integers(1, 64, (8, 12)).astype(np.int32)
        source[:, 9:] = 0  # padding
        ids = {k: rng.integers(1, 64, (8, 10)).astype(np.int32) for k in ("target_in", "target_out")}
        return {"source": source, **ids}

    _check(step, state, [batch() for _ in range(3)], "sgd")


# --- a linear recurrence that clips its gradient

CLIP = 1e-3


@jax.custom_vjp
def clip_gradient(x):
    return x


clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -CLIP, CLIP),))


class Recurrence(nn.Module):
    @nn.compact
    def __call__(self, x):
        decay = jax.nn.sigmoid(nn.Dense(D)(x))
        inputs = nn.Dense(D)(x) * (1 - decay)

        def combine(earlier, later):
            return earlier[0] * later[0], later[0] * earlier[1] + later[1]

        _, h = jax.lax.associative_scan(combine, (decay, inputs), axis=1)
        return clip_gradient(nn.Dense(D)(h))


class RecurrentLM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(64, D)(ids)
        for _ in range(4):
            x = x + Recurrence()(nn.LayerNorm()(x))
        return nn.Dense(64)(x)


def test_a_gradient_clipping_custom_vjp_sees_the_cotangents_jit_sees():
    """The clip is not linear in the cotangent: a microbatch's backward that started from 1
    rather than ``1 / num_microbatches`` would clip cotangents twice as large, and the gradients
    would differ from ``jax.jit``'s."""
    state = _train(RecurrentLM(), optax.sgd(0.1), jnp.zeros((8, 16), jnp.int32))
    batches = _batches(3, ids=_ints(64, 8, 16), labels=_ints(64, 8, 16))
    step = classifier_step("ids", "labels")

    def loss(params, batch):
        logits = state.apply_fn({"params": params}, batch["ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    # What averaging the microbatches' own gradients would give differs: the test is not of a no-op.
    halves = [{k: v[i : i + 4] for k, v in batches[0].items()} for i in (0, 4)]
    averaged = jax.tree.map(lambda a, b: (a + b) / 2, *(jax.grad(loss)(state.params, h) for h in halves))
    whole = jax.grad(loss)(state.params, batches[0])
    assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: np.allclose(a, b, rtol=1e-3), averaged, whole)))
    _check(step, state, batches, "sgd")


# --- a ViT


class ViT(nn.Module):
    @nn.compact
    def __call__(self, images):
        x = nn.Conv(D, (4, 4), (4, 4))(images)
        x = x.reshape(x.shape[0], -1, D)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, D))
        x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, D)), x], 1)
        x = x + self.param("positions", nn.initializers.normal(0.02), (1, x.shape[1], D))
        for _ in range(3):
            x = x + nn.MultiHeadDotProductAttention(4)(nn.LayerNorm()(x))
            x = x + nn.Dense(D)(jax.nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))
        return nn.Dense(10)(nn.LayerNorm()(x[:, 0]))


def test_a_vit_with_a_per_example_flip_before_the_loss_equals_jit():
    net = ViT()
    state = _train(net, optax.adamw(1e-3, eps=1e-5), jnp.zeros((8, 16, 16, 3)))

    def step(state, batch):
        images = jax.lax.map(lambda im: jnp.where(im.mean() > 0, im[:, ::-1], im), batch["x"])

        def loss_fn(p):
            logits = net.apply({"params": p}, images)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    _check(step, state, _batches(4, x=_normal(8, 16, 16, 3), y=_ints(10, 8)), "adamw")


# --- a recommender


class Recommender(nn.Module):
    @nn.compact
    def __call__(self, dense, ids):
        table = self.param("table", nn.initializers.normal(0.1), (100, 16))
        rows, per_row = ids.shape
        bags = jnp.repeat(jnp.arange(rows), per_row)
        pooled = jax.ops.segment_sum(table[ids.reshape(-1)], bags, num_segments=rows)
        d = jax.nn.relu(nn.Dense(16)(dense))
        h = jnp.concatenate([d, pooled, jnp.einsum("be,be->b", d, pooled)[:, None]], -1)
        for _ in range(3):
            h = jax.nn.relu(nn.Dense(D)(h))
        return nn.Dense(1)(h)[:, 0]


def test_a_recommender_pooling_embedding_bags_equals_jit():
    net = Recommender()
    state = _train(net, optax.adagrad(0.1), jnp.zeros((8, 4)), jnp.zeros((8, 3), jnp.int32))

    @_state_step
    def step(p, batch):
        logits = net.apply({"params": p}, batch["dense"], batch["ids"])
        return optax.sigmoid_binary_cross_entropy(logits, batch["click"]).mean()

    clicks = lambda rng: rng.integers(0, 2, 8).astype(np.float32)  # noqa: E731
    _check(step, state, _batches(5, dense=_normal(8, 4), ids=_ints(100, 8, 3), click=clicks), "sgd")


# --- a speech recogniser trained with CTC


class Recogniser(nn.Module):
    @nn.compact
    def __call__(self, frames):
        x = jax.nn.gelu(nn.Conv(D, (3,))(frames))
        x = nn.Bidirectional(nn.RNN(nn.GRUCell(D)), nn.RNN(nn.GRUCell(D)))(x)
        x = jax.nn.gelu(nn.Dense(D)(x))
        return nn.Dense(8)(x)  # 7 letters and the blank


def test_a_speech_recogniser_trained_with_ctc_equals_jit():
    # optax.ctc_loss runs a scan over the frames, reading each frame of every example.
    state = _train(Recogniser(), optax.adam(1e-2), jnp.zeros((8, 12, 5)))

    @_state_step
    def step(p, batch):
        logits = state.apply_fn({"params": p}, batch["frames"])
        return optax.ctc_loss(logits, batch["frame_pad"], batch["labels"], batch["label_pad"]).mean()

    def padding(length, low):
        return lambda rng: (np.arange(length)[None] >= rng.integers(low, length + 1, (8, 1))).astype(
            np.float32
        )

    batches = _batches(
        7,
        frames=_normal(8, 12, 5),
        frame_pad=padding(12, 8),
        labels=lambda rng: rng.integers(1, 8, (8, 4)).astype(np.int32),
        label_pad=padding(4, 1),
    )
    _check(step, state, batches, "adamw")


# --- a remat policy that saves one named value


class NamedBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = checkpoint_name(nn.Dense(2 * D)(nn.LayerNorm()(x)), "mlp_in")
        return x + nn.Dense(D)(jax.nn.gelu(h)), None


class PolicyStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = nn.remat(NamedBlock, policy=jax.checkpoint_policies.save_only_these_names("mlp_in"))
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4, unroll=2)
        x, _ = stack()(x, None)
        return nn.Dense(10)(x.mean(1))


def test_a_scanned_stack_saving_only_named_values_equals_jit():
    state = _train(PolicyStack(), optax.sgd(0.1), jnp.zeros((8, 6, D)))
    batches = _batches(6, x=_normal(8, 6, D), y=_ints(10, 8))
    _check(classifier_step("x", "y"), state, batches, "sgd")


# --- a graph network over a jraph-style batch

NODES, GRAPHS = 16, 4


class MessagePassing(nn.Module):
    @nn.compact
    def __call__(self, nodes, senders, receivers, graph_of_node):
        h = nn.Dense(16)(nodes)
        for _ in range(3):
            incoming = jax.ops.segment_sum(nn.Dense(16)(h)[senders], receivers, num_segments=h.shape[0])
            h = jnp.tanh(nn.Dense(16)(jnp.concatenate([h, incoming], -1)))
        return nn.Dense(1)(jax.ops.segment_sum(h, graph_of_node, num_segments=GRAPHS))[:, 0]


def test_a_graph_network_over_concatenated_graphs_runs_uncut_and_equals_jit():
    """Its batch's leaves have no common per-example dim (nodes, edges and graphs differ in
    number): named as the batch, an error that says to pass it outside ``batch_argnums``."""
    net = MessagePassing()
    rng = np.random.default_rng(7)

    def batch():
        return {
            "nodes": rng.normal(size=(NODES, 4)).astype(np.float32),
            "senders": rng.integers(0, NODES, 32).astype(np.int32),
            "receivers": rng.integers(0, NODES, 32).astype(np.int32),
            "graph": np.repeat(np.arange(GRAPHS), NODES // GRAPHS).astype(np.int32),
            "y": rng.normal(size=GRAPHS).astype(np.float32),
        }

    batches = [batch() for _ in range(3)]
    inputs = ("nodes", "senders", "receivers", "graph")
    state = _train(net, optax.sgd(0.01), *(batches[0][k] for k in inputs))

    @_state_step
    def step(p, batch):
        return jnp.mean((net.apply({"params": p}, *(batch[k] for k in inputs)) - batch["y"]) ** 2)

    with pytest.raises(ValueError, match=r"disagree on the batch size.*batch_argnums=\(\) for none"):
        autopar.autoparallel(step, num_stages=2)(state, batches[0])
    par = assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, batch_argnums=())
    assert len(par.plan(state, batches[0]).stages) == 2


# --- a loss rematerialised as one call


class Tower(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = jnp.tanh(nn.Dense(D)(x))
        return nn.Dense(10)(x)


@pytest.mark.parametrize("how", ["jax.checkpoint", "nn.remat"])
def test_a_loss_rematerialised_as_one_call_is_cut_into_stages_each_rematerialised(how):
    """``jax.checkpoint(loss_fn)`` or ``nn.remat`` of the whole model leaves the loss one heavy
    equation; split, it is cut into two stages, and each stage's share is one checkpoint with the
    user's policy: the backward recomputes the stage's forward from the stage's inputs."""
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    net = nn.remat(Tower, policy=policy)() if how == "nn.remat" else Tower()
    state = _train(net, optax.sgd(0.1), jnp.zeros((8, 16)))

    def step(state, batch):
        def loss_fn(p):
            logits = net.apply({"params": p}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        if how == "jax.checkpoint":
            loss_fn = jax.checkpoint(loss_fn, policy=policy)
        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    batches = _batches(8, x=_normal(8, 16), y=_ints(10, 8))
    par = assert_same_as_jit(step, state, batches, TOLERANCES["sgd"], num_stages=2, num_microbatches=2)
    traced = par.executable(state, batches[0]).step
    region = traced.jaxpr.eqns[traced.region_index()].params["info"]
    remats = [e for e in region.jaxpr.eqns if e.primitive.name in ("remat2", "checkpoint")]
    assert [e.params["policy"] for e in remats] == [policy, policy]
    assert region.cuts and len(par.plan(state, batches[0]).stages) == 2


def test_a_summed_loss_rematerialised_as_one_call_is_added_up_over_microbatches():
    """The step traced at the whole batch is cut where the plan cuts, so its region (two
    checkpoints, one per stage) is compared with the plan's equation by equation and the sum
    over the examples is found inside the split call: added up over the microbatches (plus a
    constant, refused: it would be added once per microbatch)."""
    net = Tower()
    params = net.init(jax.random.key(0), jnp.zeros((8, 16)))["params"]

    def step(params, batch):
        def loss_fn(p):
            logits = net.apply({"params": p}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).sum()

        loss, grads = autopar.value_and_grad(jax.checkpoint(loss_fn))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    batch = {"x": np.ones((8, 16), np.float32), "y": np.zeros(8, np.int32)}
    assert_same_as_jit(step, params, [batch], TOLERANCES["sgd"], num_stages=2, num_microbatches=2)

    def shifted(params, batch):
        def loss_fn(p):
            logits = net.apply({"params": p}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).sum() + 1.0

        loss, grads = autopar.value_and_grad(jax.checkpoint(loss_fn))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    with pytest.raises(ValueError, match=r"The loss \(float32\[\]\) is a sum over the examples"):
        autopar.autoparallel(shifted, num_stages=2, num_microbatches=2)(params, batch)


# --- FNet


class FNetBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(x + jnp.real(jnp.fft.fft2(x.astype(jnp.complex64))))
        return nn.LayerNorm()(x + nn.Dense(D)(jax.nn.gelu(nn.Dense(2 * D)(x))))


class FNet(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(64, D)(ids)
        for _ in range(3):
            x = FNetBlock()(x)
        return nn.Dense(64)(x)


def test_fnet_splits_its_fourier_transforms_over_the_batch_and_equals_jit():
    """An ``fft`` transforms its trailing dims and leaves the batch alone: each stage splits it
    over its devices rather than gathering the activations to transform them whole."""
    state = _train(FNet(), optax.sgd(0.1), jnp.zeros((8, 16), jnp.int32))
    batches = _batches(9, ids=_ints(64, 8, 16), labels=_ints(64, 8, 16))
    par = assert_same_as_jit(
        classifier_step("ids", "labels"), state, batches, TOLERANCES["sgd"], num_stages=2, mesh_shape=(4,)
    )
    exe = par.executable(state, batches[0])
    for stage in range(2):
        ffts = [op for op in intra_op.stage_ops(exe.program, stage)[0] if op.eqn.primitive.name == "fft"]
        assert ffts and all(exe.shardings[stage].strategies[op.outs[0]] == "split[d0@data]" for op in ffts)
