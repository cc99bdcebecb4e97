"""Tests for the BERT, Wide-ResNet and MoE reference models and their synthetic data."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models.bert import BERT_PRESETS, Bert, BertConfig, mlm_loss
from models.data_extra import bert_batch, image_batch, moe_batch
from models.losses import softmax_cross_entropy
from models.moe import (
    MOE_PRESETS,
    MoEConfig,
    MoEFeedForward,
    MoETransformer,
    dispatch_mask,
    expert_capacity,
    moe_lm_loss,
    top2_routing,
)
from models.wide_resnet import WRESNET_PRESETS, WideResNet, WResNetConfig

BERT_TINY = BertConfig.preset("bert-tiny")
WRESNET_TINY = WResNetConfig.preset("wresnet-tiny")
MOE_TINY = MoEConfig.preset("moe-tiny")
NUM_STEPS = 15


def _init_key() -> jax.Array:
    """An init key whose random bits compile much faster on CPU than the default threefry."""
    return jax.random.key(0, impl="rbg")


def _num_params(tree: Any) -> int:
    """Total number of elements over the leaves of ``tree``."""
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))


def _train(
    loss_fn: Callable[[Any, Any, dict[str, Any]], tuple[jax.Array, Any]],
    params: Any,
    state: Any,
    batch: dict[str, Any],
    learning_rate: float,
    momentum: float | None = None,
) -> tuple[list[float], Any]:
    """Run ``NUM_STEPS`` jitted SGD steps of ``loss_fn(params, state, batch) -> (loss, new_state)``."""
    tx = optax.sgd(learning_rate, momentum=momentum)

    @jax.jit
    def step(params: Any, opt_state: Any, state: Any) -> tuple[Any, Any, Any, jax.Array]:
        (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_state, loss

    opt_state = tx.init(params)
    losses = []
    for _ in range(NUM_STEPS):
        params, opt_state, state, loss = step(params, opt_state, state)
        losses.append(float(loss))
    return losses, state


# ---------------------------------------------------------------------------- BERT


@pytest.fixture(scope="module")
def bert_run() -> dict[str, Any]:
    """Initial params, a jitted forward and the SGD loss curve of bert-tiny on one batch."""
    model = Bert(BERT_TINY)
    batch = {k: jnp.asarray(v) for k, v in bert_batch(0, 8, BERT_TINY).items()}
    params = jax.jit(model.init)(_init_key(), batch["tokens"])["params"]

    def loss_fn(p: Any, state: Any, b: dict[str, Any]) -> tuple[jax.Array, Any]:
        logits = model.apply({"params": p}, b["tokens"])
        return mlm_loss(logits, b["labels"], b["mask"]), state

    losses, _ = _train(loss_fn, params, None, batch, learning_rate=0.05, momentum=0.9)

    @jax.jit
    def forward(tokens: jax.Array, segments: jax.Array, attention_mask: jax.Array) -> jax.Array:
        return model.apply({"params": params}, tokens, segments=segments, attention_mask=attention_mask)

    return {"model": model, "params": params, "batch": batch, "forward": forward, "losses": losses}


def test_bert_shapes_and_tied_head(bert_run: dict[str, Any]) -> None:
    cfg, params, tokens = BERT_TINY, bert_run["params"], bert_run["batch"]["tokens"]
    logits = jax.eval_shape(bert_run["model"].apply, {"params": params}, tokens)
    assert logits.shape == (8, cfg.max_len, cfg.vocab_size)
    assert params["embed"]["embedding"].shape == (cfg.vocab_size, cfg.hidden)
    assert params["mlm_bias"].shape == (cfg.vocab_size,)
    # Tied head: the only vocabulary-sized tensors are the embedding and the output bias.
    vocab_sized = [x.shape for x in jax.tree_util.tree_leaves(params) if cfg.vocab_size in x.shape]
    assert sorted(vocab_sized) == [(cfg.vocab_size,), (cfg.vocab_size, cfg.hidden)]
    assert all(f"layer_{i}" in params for i in range(cfg.num_layers))


def test_bert_training_decreases_loss(bert_run: dict[str, Any]) -> None:
    losses = bert_run["losses"]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.6 * losses[0]


def test_bert_padding_mask_hides_padded_keys(bert_run: dict[str, Any]) -> None:
    forward, tokens = bert_run["forward"], bert_run["batch"]["tokens"][:2]
    half = BERT_TINY.max_len // 2
    zeros, ones = jnp.zeros_like(tokens), jnp.ones_like(tokens)
    padding = jnp.broadcast_to(jnp.arange(BERT_TINY.max_len) < half, tokens.shape)
    other = tokens.at[:, half:].set(3)
    a = forward(tokens, zeros, padding)
    assert np.all(np.isfinite(a))
    # Real positions do not see the padded ones...
    np.testing.assert_allclose(a[:, :half], forward(other, zeros, padding)[:, :half], rtol=1e-5, atol=1e-5)
    # ...but without the mask they do; segments change the output too.
    plain = forward(tokens, zeros, ones)
    assert not np.allclose(plain[:, :half], forward(other, zeros, ones)[:, :half])
    assert not np.allclose(plain, forward(tokens, ones, ones))


def test_mlm_loss_averages_masked_positions_only() -> None:
    vocab = 7
    labels = jnp.array([[1, 2, 3]])
    logits = jnp.where(jax.nn.one_hot(labels, vocab) > 0, 50.0, 0.0)
    logits = logits.at[0, 2].set(0.0)  # Wrong (uniform) prediction at the last position.
    mask = jnp.array([[True, True, False]])
    assert float(mlm_loss(logits, labels, mask)) < 1e-6
    np.testing.assert_allclose(mlm_loss(logits, labels, ~mask), np.log(vocab), rtol=1e-6)
    assert float(mlm_loss(logits, labels, jnp.zeros_like(mask))) == 0.0


def test_bert_batch() -> None:
    a = bert_batch(3, 16, BERT_TINY)
    np.testing.assert_array_equal(a["tokens"], bert_batch(3, 16, BERT_TINY)["tokens"])
    assert not np.array_equal(a["tokens"], bert_batch(4, 16, BERT_TINY)["tokens"])
    assert a["tokens"].dtype == a["labels"].dtype == np.int32
    assert a["tokens"].shape == a["labels"].shape == a["mask"].shape == (16, BERT_TINY.max_len)
    mask_id = BERT_TINY.vocab_size - 1
    num_masked = round(0.15 * BERT_TINY.max_len)
    np.testing.assert_array_equal(a["mask"].sum(axis=1), num_masked)
    np.testing.assert_array_equal(a["tokens"][~a["mask"]], a["labels"][~a["mask"]])
    assert np.all(a["labels"] < mask_id)
    assert (a["tokens"] == mask_id).any()
    assert np.all((a["tokens"] == mask_id) <= a["mask"])


# ---------------------------------------------------------------------- Wide-ResNet


@pytest.fixture(scope="module")
def wresnet_run() -> dict[str, Any]:
    """Initial variables, the SGD loss curve and final batch stats of wresnet-tiny on one batch."""
    model = WideResNet(WRESNET_TINY)
    batch = {k: jnp.asarray(v) for k, v in image_batch(0, 16, WRESNET_TINY).items()}
    variables = jax.jit(lambda k, x: model.init(k, x, train=False))(_init_key(), batch["images"])

    def loss_fn(p: Any, stats: Any, b: dict[str, Any]) -> tuple[jax.Array, Any]:
        logits, updates = model.apply(
            {"params": p, "batch_stats": stats}, b["images"], train=True, mutable=["batch_stats"]
        )
        return softmax_cross_entropy(logits, b["labels"]), updates["batch_stats"]

    losses, stats = _train(loss_fn, variables["params"], variables["batch_stats"], batch, learning_rate=0.1)
    return {"model": model, "variables": variables, "batch": batch, "losses": losses, "stats": stats}


def test_wresnet_shapes(wresnet_run: dict[str, Any]) -> None:
    cfg, variables = WRESNET_TINY, wresnet_run["variables"]
    images = wresnet_run["batch"]["images"]
    logits = jax.eval_shape(lambda v, x: wresnet_run["model"].apply(v, x, train=False), variables, images)
    assert logits.shape == (16, cfg.num_classes)
    block = variables["params"]["stage_3_block_0"]
    filters = cfg.base_channels * 2**3
    assert block["conv_1"]["kernel"].shape[-1] == filters
    assert block["conv_2"]["kernel"].shape[-2:] == (filters, filters * cfg.width_factor)
    assert block["conv_3"]["kernel"].shape[-1] == 4 * filters
    assert "conv_proj" in block
    assert set(variables) == {"params", "batch_stats"}
    with pytest.raises(ValueError, match="images"):
        jax.eval_shape(lambda v, x: wresnet_run["model"].apply(v, x, train=False), variables, images[0])


def test_wresnet_training_decreases_loss_and_updates_batch_stats(wresnet_run: dict[str, Any]) -> None:
    losses = wresnet_run["losses"]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0]
    before = wresnet_run["variables"]["batch_stats"]["bn_init"]["mean"]
    after = wresnet_run["stats"]["bn_init"]["mean"]
    assert not np.allclose(before, after)


def test_wresnet_layouts() -> None:
    assert WResNetConfig(num_layers=50).stage_sizes == (3, 4, 6, 3)
    assert WResNetConfig(num_layers=101).num_blocks == 33
    assert WResNetConfig(blocks_per_stage=[2, 1]).stage_sizes == (2, 1)
    # Only the 3x3 conv is widened; the block still outputs 4 * filters channels.
    cfg = WResNetConfig(blocks_per_stage=(1, 1), base_channels=4, width_factor=3)
    images = jax.ShapeDtypeStruct((1, 16, 16, 3), jnp.float32)
    init = jax.eval_shape(lambda k, x: WideResNet(cfg).init(k, x, train=False), jax.random.key(0), images)
    block = init["params"]["stage_1_block_0"]
    assert block["conv_1"]["kernel"].shape == (1, 1, 16, 8)
    assert block["conv_2"]["kernel"].shape == (3, 3, 8, 24)
    assert block["conv_3"]["kernel"].shape == (1, 1, 24, 32)
    assert block["conv_proj"]["kernel"].shape == (1, 1, 16, 32)
    assert WResNetConfig.preset("wresnet-13b").stage_sizes == (3, 4, 23, 3)


def test_image_batch() -> None:
    a = image_batch(5, 32, WRESNET_TINY)
    size = WRESNET_TINY.image_size
    assert a["images"].dtype == np.float32 and a["images"].shape == (32, size, size, 3)
    assert a["labels"].dtype == np.int32 and a["labels"].shape == (32,)
    assert a["labels"].min() >= 0 and a["labels"].max() < WRESNET_TINY.num_classes
    np.testing.assert_array_equal(a["images"], image_batch(5, 32, WRESNET_TINY)["images"])
    # The class template is shared across batches: same-class images correlate.
    b = image_batch(6, 32, WRESNET_TINY)
    label = int(a["labels"][0])
    same = b["images"][b["labels"] == label]
    if same.size:
        assert np.corrcoef(a["images"][0].ravel(), same[0].ravel())[0, 1] > 0.3


# ----------------------------------------------------------------------------- MoE


@pytest.fixture(scope="module")
def moe_run() -> dict[str, Any]:
    """Params and the SGD loss curve of moe-tiny on one batch."""
    model = MoETransformer(MOE_TINY)
    tokens = jnp.asarray(moe_batch(0, 8, MOE_TINY)["tokens"])
    params = jax.jit(model.init)(_init_key(), tokens)["params"]

    def loss_fn(p: Any, state: Any, b: dict[str, Any]) -> tuple[jax.Array, Any]:
        logits, aux_loss = model.apply({"params": p}, b["tokens"])
        return moe_lm_loss(logits, aux_loss, b["tokens"]), state

    losses, _ = _train(loss_fn, params, None, {"tokens": tokens}, learning_rate=0.05, momentum=0.9)
    return {"model": model, "params": params, "tokens": tokens, "losses": losses}


def test_moe_shapes(moe_run: dict[str, Any]) -> None:
    cfg, params = MOE_TINY, moe_run["params"]
    logits, aux = jax.eval_shape(moe_run["model"].apply, {"params": params}, moe_run["tokens"])
    assert logits.shape == (8, cfg.max_len, cfg.vocab_size)
    assert aux.shape == ()
    assert "mlp" in params["block_0"] and "moe" in params["block_1"]
    assert params["block_1"]["moe"]["w_in"].shape == (cfg.num_experts, cfg.hidden, cfg.expert_hidden)
    assert params["block_1"]["moe"]["router"].shape == (cfg.hidden, cfg.num_experts)


def test_moe_training_decreases_loss(moe_run: dict[str, Any]) -> None:
    losses = moe_run["losses"]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.85 * losses[0]


_NO_DROP = dataclasses.replace(MOE_TINY, capacity_factor=float(MOE_TINY.num_experts))
_DROPPING = dataclasses.replace(MOE_TINY, expert_group_size=16, capacity_factor=1.0)


@jax.jit
def _moe_layer_variants(params: Any, x: jax.Array) -> dict[str, Any]:
    """One MoE layer under both dispatch paths.

    Without drops (capacity = group size): outputs. With drops: output, aux loss and gradients.
    """
    results: dict[str, Any] = {}
    for dispatch in ("einsum", "scatter"):
        no_drop = MoEFeedForward(dataclasses.replace(_NO_DROP, dispatch=dispatch))
        results[f"no_drop/{dispatch}"] = no_drop.apply({"params": params}, x)
        layer = MoEFeedForward(dataclasses.replace(_DROPPING, dispatch=dispatch))

        def loss(p: Any, x: jax.Array, layer: MoEFeedForward = layer) -> tuple[jax.Array, Any]:
            out, aux = layer.apply({"params": p}, x)
            return jnp.sum(jnp.sin(out)) + aux, (out, aux)

        (_, (out, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        results[f"dropping/{dispatch}"] = (out, aux, grads)
    return results


def _reference_moe_layer(params: Any, x: np.ndarray) -> np.ndarray:
    """Per-token top-2 mixture in numpy, with no capacity limit."""
    tokens = x.reshape(-1, x.shape[-1]).astype(np.float64)
    w_in, w_out = np.asarray(params["w_in"], np.float64), np.asarray(params["w_out"], np.float64)
    logits = tokens @ np.asarray(params["router"], np.float64)
    gates = np.exp(logits - logits.max(axis=-1, keepdims=True))
    gates /= gates.sum(axis=-1, keepdims=True)
    h = np.einsum("nm,emh->neh", tokens, w_in)
    h = 0.5 * h * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (h + 0.044715 * h**3)))  # tanh GELU
    expert_out = np.einsum("neh,ehm->nem", h, w_out)
    out = np.zeros_like(tokens)
    for n, top2 in enumerate(np.argsort(-logits, axis=-1)[:, :2]):
        weights = gates[n, top2] / gates[n, top2].sum()
        out[n] = weights @ expert_out[n, top2]
    return out.reshape(x.shape)


def test_moe_layer_dispatch_paths(moe_run: dict[str, Any]) -> None:
    params = moe_run["params"]["block_1"]["moe"]
    x = np.random.RandomState(2).standard_normal((4, MOE_TINY.max_len, MOE_TINY.hidden)).astype(np.float32)
    results = _moe_layer_variants(params, jnp.asarray(x))
    reference = _reference_moe_layer(params, x)
    for dispatch in ("einsum", "scatter"):
        out, aux = results[f"no_drop/{dispatch}"]
        np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-6)
        assert np.isfinite(float(aux)) and 1.0 / MOE_TINY.num_experts - 1e-6 <= float(aux) < 2.0
    einsum, scatter = results["dropping/einsum"], results["dropping/scatter"]
    for a, b in zip(jax.tree_util.tree_leaves(scatter), jax.tree_util.tree_leaves(einsum), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # 16-token groups at capacity factor 1 drop tokens, so the output moves off the reference.
    assert not np.allclose(einsum[0], reference, rtol=1e-3, atol=1e-4)
    # Routing has no randomness: a second run is bit-identical.
    again = _moe_layer_variants(params, jnp.asarray(x))
    for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(results), strict=True):
        np.testing.assert_array_equal(a, b)
    layer = MoEFeedForward(dataclasses.replace(MOE_TINY, dispatch="scatter"))
    jaxpr = str(jax.make_jaxpr(lambda p: layer.apply({"params": p}, x))(params))
    assert "scatter-add" in jaxpr and "gather" in jaxpr


@jax.jit
def _route(logits: jax.Array) -> tuple[Any, jax.Array]:
    """Top-2 routing of ``[G, 32, 4]`` logits at capacity 8, and its dispatch mask."""
    routing = top2_routing(logits, capacity=8)
    return routing, dispatch_mask(routing, num_experts=4, capacity=8)


@pytest.mark.parametrize("skew", [0.0, 5.0])
def test_top2_routing_respects_capacity(skew: float) -> None:
    groups, tokens, experts = 3, 32, 4
    capacity = expert_capacity(tokens, experts, 1.0)
    assert capacity == 8
    logits = np.random.RandomState(1).standard_normal((groups, tokens, experts)).astype(np.float32)
    logits[..., 0] += skew  # With skew, nearly every token prefers expert 0.
    routing, dispatch = _route(logits)
    dispatch = np.asarray(dispatch)

    per_expert = dispatch.sum(axis=(1, 3))  # [G, E] tokens held by each expert.
    assert per_expert.max() <= capacity
    assert dispatch.sum(axis=1).max() <= 1  # Every slot holds at most one token.
    assert dispatch.sum(axis=(2, 3)).max() <= 2  # Every token goes to at most two experts.
    index = np.asarray(routing.expert_index)
    assert np.all(index[..., 0] != index[..., 1])
    dropped = np.asarray(routing.slot) == capacity
    assert np.all(np.asarray(routing.weight)[dropped] == 0.0)
    # The kept assignments are exactly the dispatch entries.
    assert int((~dropped).sum()) == int(dispatch.sum())
    if skew:
        assert np.all(per_expert[:, 0] == capacity) and dropped.any()
    aux = float(routing.aux_loss)
    assert np.isfinite(aux) and aux >= 1.0 / experts - 1e-6
    if skew:
        assert aux > 2.0  # Imbalance is penalised.


def test_routing_tie_goes_to_distinct_experts() -> None:
    capacity = expert_capacity(4, 2, 2.0)
    routing = jax.jit(functools.partial(top2_routing, capacity=capacity))(jnp.zeros((1, 4, 2)))
    np.testing.assert_array_equal(routing.expert_index[0], [[0, 1]] * 4)
    np.testing.assert_allclose(routing.weight, 0.5, rtol=1e-6)
    np.testing.assert_allclose(routing.aux_loss, 1.0, rtol=1e-6)


def test_moe_batch() -> None:
    t = moe_batch(7, 4, MOE_TINY)["tokens"]
    assert t.dtype == np.int32 and t.shape == (4, MOE_TINY.max_len)
    assert t.min() >= 0 and t.max() < MOE_TINY.vocab_size
    np.testing.assert_array_equal(t, moe_batch(7, 4, MOE_TINY)["tokens"])


# ------------------------------------------------------------------ configs, presets


@pytest.mark.parametrize(
    ("cls", "kwargs", "field"),
    [
        (BertConfig, {"num_heads": 3}, "hidden"),
        (BertConfig, {"intermediate": 0}, "intermediate"),
        (BertConfig, {"dtype": jnp.int32}, "dtype"),
        (WResNetConfig, {"num_layers": 34}, "num_layers"),
        (WResNetConfig, {"width_factor": 0}, "width_factor"),
        (WResNetConfig, {"blocks_per_stage": (1, 0)}, "blocks_per_stage"),
        (MoEConfig, {"num_layers": 1}, "num_layers"),
        (MoEConfig, {"num_experts": 1}, "num_experts"),
        (MoEConfig, {"capacity_factor": 0.0}, "capacity_factor"),
        (MoEConfig, {"dispatch": "loop"}, "dispatch"),
        (MoEConfig, {"expert_group_size": 0}, "expert_group_size"),
    ],
)
def test_config_validation(cls: type, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)


def test_preset_lookup_and_overrides() -> None:
    assert BertConfig.preset("bert-tiny", num_layers=3).num_layers == 3
    assert MoEConfig.preset("moe-tiny") == MoEConfig()
    assert WResNetConfig.preset("wresnet-tiny") == WResNetConfig(blocks_per_stage=(1, 1, 1, 1))
    for cls in (BertConfig, WResNetConfig, MoEConfig):
        with pytest.raises(ValueError, match="name"):
            cls.preset("does-not-exist")


def test_moe_group_size_must_divide_tokens() -> None:
    cfg = dataclasses.replace(MOE_TINY, expert_group_size=48)
    tokens = jnp.zeros((2, MOE_TINY.max_len), jnp.int32)
    with pytest.raises(ValueError, match="expert_group_size"):
        jax.eval_shape(MoETransformer(cfg).init, jax.random.key(0), tokens)
    # A group larger than the batch shrinks to the batch.
    big = dataclasses.replace(MOE_TINY, expert_group_size=2048)
    logits, _ = jax.eval_shape(
        lambda t: MoETransformer(big).init_with_output(jax.random.key(0), t)[0], tokens
    )
    assert logits.shape == (2, MOE_TINY.max_len, MOE_TINY.vocab_size)


def _size_from_name(name: str) -> float:
    """``"moe-2.4b"`` -> 2.4e9, ``"wresnet-250m"`` -> 2.5e8."""
    match = re.search(r"-([\d.]+)([mb])$", name)
    assert match, name
    return float(match.group(1)) * (1e6 if match.group(2) == "m" else 1e9)


def _abstract_params(name: str) -> Any:
    """Parameter shapes of preset ``name`` without allocating them."""
    key = jax.random.key(0)
    if name in BERT_PRESETS:
        tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
        return jax.eval_shape(Bert(BERT_PRESETS[name]).init, key, tokens)["params"]
    if name in MOE_PRESETS:
        cfg = MOE_PRESETS[name]
        tokens = jax.ShapeDtypeStruct((2, cfg.max_len), jnp.int32)
        return jax.eval_shape(MoETransformer(cfg).init, key, tokens)["params"]
    cfg = WRESNET_PRESETS[name]
    images = jax.ShapeDtypeStruct((1, cfg.image_size, cfg.image_size, 3), jnp.float32)
    return jax.eval_shape(lambda k, x: WideResNet(cfg).init(k, x, train=False), key, images)["params"]


_PUBLISHED_SIZES = {"bert-base": 110e6, "bert-large": 340e6}
_SIZED_PRESETS = sorted(
    name
    for name in (*BERT_PRESETS, *WRESNET_PRESETS, *MOE_PRESETS)
    if name in _PUBLISHED_SIZES or re.search(r"-[\d.]+[mb]$", name)
)
_FAST_PRESETS = {"bert-base", "wresnet-250m", "moe-380m"}


@pytest.mark.parametrize(
    "name",
    [n if n in _FAST_PRESETS else pytest.param(n, marks=pytest.mark.slow) for n in _SIZED_PRESETS],
)
def test_preset_parameter_counts_match_names(name: str) -> None:
    expected = _PUBLISHED_SIZES.get(name) or _size_from_name(name)
    count = _num_params(_abstract_params(name))
    assert abs(count - expected) <= 0.1 * expected, f"{name}: {count / 1e6:.1f}M parameters"
