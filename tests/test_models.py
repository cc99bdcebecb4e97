"""Tests for the plain reference models in ``models``."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import (
    GPT,
    GPT_PRESETS,
    MLP,
    NNXGPT,
    NNXMLP,
    GPTConfig,
    MLPConfig,
    gpt_batch,
    mlp_batch,
    next_token_loss,
    softmax_cross_entropy,
)

TINY = GPT_PRESETS["gpt-tiny"]


def _paths(tree: Any) -> set[str]:
    """Slash-joined key paths of every leaf in ``tree``."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path) for path, _ in leaves}


def _stack_blocks(params: dict, num_layers: int) -> dict:
    """Convert per-layer ``block_i`` params into the stacked ``scan_layers`` layout."""
    p = dict(params["params"])
    layers = [p.pop(f"block_{i}") for i in range(num_layers)]
    p["blocks"] = {"block": jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)}
    return {"params": p}


@pytest.fixture(scope="module")
def tiny() -> dict[str, Any]:
    """Tokens, plain gpt-tiny params, and the plain model's logits and loss."""
    tokens = jnp.asarray(gpt_batch(1, 2, TINY)["tokens"])
    params = GPT(TINY).init(jax.random.key(0), tokens)
    logits = GPT(TINY).apply(params, tokens)
    return {
        "tokens": tokens,
        "params": params,
        "logits": logits,
        "loss": float(next_token_loss(logits, tokens)),
    }


def test_mlp_forward_shapes() -> None:
    cfg = MLPConfig(features=(16, 8), num_classes=5, in_features=12)
    x = jnp.asarray(mlp_batch(0, 4, cfg)["x"])
    model = MLP(cfg)
    params = model.init(jax.random.key(0), x)
    assert model.apply(params, x).shape == (4, 5)
    assert NNXMLP(cfg, rngs=nnx.Rngs(0))(x).shape == (4, 5)


def test_gpt_forward_shapes(tiny: dict[str, Any]) -> None:
    tokens = tiny["tokens"]
    expected = (2, TINY.max_len, TINY.vocab_size)
    assert tiny["logits"].shape == expected
    assert np.all(np.isfinite(tiny["logits"]))
    tied = dataclasses.replace(TINY, tie_embeddings=True)
    tied_params = GPT(tied).init(jax.random.key(0), tokens)
    assert GPT(tied).apply(tied_params, tokens).shape == expected
    for cfg in (TINY, tied):
        assert NNXGPT(cfg, rngs=nnx.Rngs(0))(tokens).shape == expected


def test_tied_embeddings_have_no_output_kernel(tiny: dict[str, Any]) -> None:
    tied = dataclasses.replace(TINY, tie_embeddings=True)
    tied_params = jax.eval_shape(GPT(tied).init, jax.random.key(0), tiny["tokens"])["params"]
    assert "lm_head" in tiny["params"]["params"]
    assert not any("lm_head" in p for p in _paths(tied_params))
    assert set(tiny["params"]["params"]) - set(tied_params) == {"lm_head"}

    nnx_untied = nnx.state(NNXGPT(TINY, rngs=nnx.Rngs(0)), nnx.Param)
    nnx_tied = nnx.state(NNXGPT(tied, rngs=nnx.Rngs(0)), nnx.Param)
    assert any("lm_head" in p for p in _paths(nnx_untied))
    assert not any("lm_head" in p for p in _paths(nnx_tied))


def test_gpt_sgd_training_decreases_loss(tiny: dict[str, Any]) -> None:
    model = GPT(TINY)
    tokens = jnp.asarray(gpt_batch(0, 8, TINY)["tokens"])
    params = tiny["params"]

    @jax.jit
    def train_step(p):
        loss, grads = jax.value_and_grad(lambda q: next_token_loss(model.apply(q, tokens), tokens))(p)
        return jax.tree_util.tree_map(lambda w, g: w - 0.5 * g, p, grads), loss

    losses = []
    for _ in range(21):
        params, loss = train_step(params)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(("remat", "scan"), [(True, False), (False, True), (True, True)])
def test_remat_and_scan_variants(remat: bool, scan: bool, tiny: dict[str, Any]) -> None:
    tokens = tiny["tokens"]
    cfg = dataclasses.replace(TINY, remat=remat, scan_layers=scan)
    model = GPT(cfg)

    abstract = jax.eval_shape(model.init, jax.random.key(0), tokens)
    if scan:
        blocks = abstract["params"]["blocks"]
        assert all(x.shape[0] == cfg.num_layers for x in jax.tree_util.tree_leaves(blocks))
        assert not any(k.startswith("block_") for k in abstract["params"])
    params = _stack_blocks(tiny["params"], cfg.num_layers) if scan else tiny["params"]
    assert jax.tree_util.tree_map(jnp.shape, params) == jax.tree_util.tree_map(jnp.shape, abstract)

    def loss_fn(p):
        logits = model.apply(p, tokens)
        return next_token_loss(logits, tokens), logits

    if remat:
        (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
        assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
    else:
        loss, logits = loss_fn(params)
    assert logits.shape == (2, cfg.max_len, cfg.vocab_size)
    assert np.isfinite(float(loss))
    np.testing.assert_allclose(float(loss), tiny["loss"], rtol=1e-5)


@pytest.mark.parametrize("scan", [False, True])
def test_dropout_uses_dropout_rng(scan: bool, tiny: dict[str, Any]) -> None:
    cfg = dataclasses.replace(TINY, dropout_rate=0.2, scan_layers=scan)
    model = GPT(cfg)
    params = _stack_blocks(tiny["params"], cfg.num_layers) if scan else tiny["params"]

    @jax.jit
    def train_apply(key):
        return model.apply(params, tiny["tokens"], deterministic=False, rngs={"dropout": key})

    train_a, train_b = train_apply(jax.random.key(1)), train_apply(jax.random.key(2))
    assert np.all(np.isfinite(train_a))
    assert not np.allclose(tiny["logits"], train_a)
    assert not np.allclose(train_a, train_b)
    if not scan:
        np.testing.assert_allclose(model.apply(params, tiny["tokens"]), tiny["logits"], rtol=1e-5, atol=1e-6)


def test_nnx_dropout_and_unsupported_options(tiny: dict[str, Any]) -> None:
    tokens = tiny["tokens"]
    model = NNXGPT(dataclasses.replace(TINY, dropout_rate=0.2), rngs=nnx.Rngs(0))
    assert not np.allclose(model(tokens), model(tokens, deterministic=False))
    with pytest.raises(ValueError, match="remat"):
        NNXGPT(dataclasses.replace(TINY, remat=True), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="scan_layers"):
        NNXGPT(dataclasses.replace(TINY, scan_layers=True), rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    ("cls", "kwargs", "field"),
    [
        (GPTConfig, {"num_heads": 3}, "hidden"),
        (GPTConfig, {"num_layers": 0}, "num_layers"),
        (GPTConfig, {"dropout_rate": 1.0}, "dropout_rate"),
        (GPTConfig, {"dtype": jnp.int32}, "dtype"),
        (MLPConfig, {"features": ()}, "features"),
        (MLPConfig, {"num_classes": 0}, "num_classes"),
    ],
)
def test_config_validation(cls: type, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)


def test_presets() -> None:
    assert GPTConfig.preset("gpt-tiny") == GPTConfig()
    small = GPTConfig.preset("gpt-small", tie_embeddings=True)
    assert (small.vocab_size, small.num_layers, small.hidden, small.max_len) == (512, 4, 128, 64)
    assert small.tie_embeddings
    with pytest.raises(ValueError, match="name"):
        GPTConfig.preset("gpt-huge")


def test_sequence_longer_than_max_len_is_rejected() -> None:
    tokens = jnp.zeros((1, TINY.max_len + 1), jnp.int32)
    with pytest.raises(ValueError, match="max_len"):
        jax.eval_shape(GPT(TINY).init, jax.random.key(0), tokens)
    with pytest.raises(ValueError, match="max_len"):
        NNXGPT(TINY, rngs=nnx.Rngs(0))(tokens)


def test_data_is_deterministic() -> None:
    mlp_cfg = MLPConfig()
    a, b = mlp_batch(7, 16, mlp_cfg), mlp_batch(7, 16, mlp_cfg)
    assert a["x"].dtype == np.float32 and a["x"].shape == (16, mlp_cfg.in_features)
    assert a["y"].dtype == np.int32 and a["y"].shape == (16,)
    np.testing.assert_array_equal(a["x"], b["x"])
    np.testing.assert_array_equal(a["y"], b["y"])
    assert not np.array_equal(a["x"], mlp_batch(8, 16, mlp_cfg)["x"])

    t = gpt_batch(7, 4, TINY)["tokens"]
    assert t.dtype == np.int32 and t.shape == (4, TINY.max_len)
    assert t.min() >= 0 and t.max() < TINY.vocab_size
    np.testing.assert_array_equal(t, gpt_batch(7, 4, TINY)["tokens"])


def test_losses() -> None:
    vocab = 11
    logits = jnp.zeros((2, 5, vocab))
    tokens = jnp.ones((2, 5), jnp.int32)
    np.testing.assert_allclose(next_token_loss(logits, tokens), np.log(vocab), rtol=1e-6)
    labels = jnp.array([0, 2])
    confident = jax.nn.one_hot(labels, 3) * 100.0
    assert float(softmax_cross_entropy(confident, labels)) < 1e-6
