"""BERT-style post-LayerNorm transformer encoder with a tied masked-LM head, in Flax linen."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

_INIT_STD = 0.02
_LN_EPS = 1e-12


def check_float_dtype(dtype: Any) -> None:
    """Raise ``ValueError`` unless ``dtype`` is a floating-point dtype."""
    try:
        floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BertConfig:
    """Hyperparameters of a BERT-style masked-LM encoder."""

    vocab_size: int = 128
    """Number of token ids; the MLM head predicts over this vocabulary."""
    num_layers: int = 2
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads per block; must divide ``hidden``."""
    hidden: int = 64
    """Width of the residual stream and the embeddings."""
    intermediate: int = 256
    """Width of the feed-forward hidden layer."""
    max_len: int = 32
    """Longest sequence the position embedding covers."""
    type_vocab_size: int = 2
    """Number of segment ids (sentence A / sentence B)."""
    dtype: Any = jnp.float32
    """Computation dtype; parameters stay float32."""

    def __post_init__(self) -> None:
        """Validate the fields."""
        for name in (
            "vocab_size",
            "num_layers",
            "num_heads",
            "hidden",
            "intermediate",
            "max_len",
            "type_vocab_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden must be divisible by num_heads={self.num_heads}, got {self.hidden!r}")
        check_float_dtype(self.dtype)

    @property
    def head_dim(self) -> int:
        """Width of each attention head."""
        return self.hidden // self.num_heads

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> BertConfig:
        """Return the named preset from ``BERT_PRESETS`` with ``overrides`` applied."""
        if name not in BERT_PRESETS:
            raise ValueError(f"name must be one of {sorted(BERT_PRESETS)}, got {name!r}")
        return dataclasses.replace(BERT_PRESETS[name], **overrides)


BERT_PRESETS: dict[str, BertConfig] = {
    "bert-tiny": BertConfig(
        vocab_size=128, num_layers=2, num_heads=4, hidden=64, intermediate=256, max_len=32
    ),
    "bert-small": BertConfig(
        vocab_size=512, num_layers=4, num_heads=4, hidden=128, intermediate=512, max_len=64
    ),
    # Devlin et al. (2019): BERT-Base and BERT-Large.
    "bert-base": BertConfig(
        vocab_size=30522, num_layers=12, num_heads=12, hidden=768, intermediate=3072, max_len=512
    ),
    "bert-large": BertConfig(
        vocab_size=30522, num_layers=24, num_heads=16, hidden=1024, intermediate=4096, max_len=512
    ),
    # Enlarged encoders with the layer/width shapes of the 1.3B and 2.6B GPT-3 sizes.
    "bert-1.3b": BertConfig(
        vocab_size=30522, num_layers=24, num_heads=32, hidden=2048, intermediate=8192, max_len=512
    ),
    "bert-2.6b": BertConfig(
        vocab_size=30522, num_layers=32, num_heads=32, hidden=2560, intermediate=10240, max_len=512
    ),
}


def mlm_loss(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits [B, T, V]`` against ``labels [B, T]`` over positions where ``mask``.

    Returns 0 when nothing is masked.
    """
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    weights = mask.astype(jnp.float32)
    return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


class BertSelfAttention(nn.Module):
    """Bidirectional multi-head self-attention with an optional key padding mask."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """Attend over ``x [B, T, hidden]``; ``attention_mask [B, T]`` is true for real tokens."""
        cfg = self.config
        init = nn.initializers.normal(_INIT_STD)
        heads = (*x.shape[:2], cfg.num_heads, cfg.head_dim)
        q = nn.Dense(cfg.hidden, dtype=cfg.dtype, kernel_init=init, name="query")(x).reshape(heads)
        k = nn.Dense(cfg.hidden, dtype=cfg.dtype, kernel_init=init, name="key")(x).reshape(heads)
        v = nn.Dense(cfg.hidden, dtype=cfg.dtype, kernel_init=init, name="value")(x).reshape(heads)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(cfg.head_dim)
        if attention_mask is not None:
            keep = attention_mask.astype(bool)[:, None, None, :]
            logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(*x.shape[:2], cfg.hidden)
        return nn.Dense(cfg.hidden, dtype=cfg.dtype, kernel_init=init, name="out")(out)


class BertLayer(nn.Module):
    """Post-LayerNorm block: ``LN(x + attn(x))`` then ``LN(h + ffn(h))``."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """Apply the block to ``x [B, T, hidden]``."""
        cfg = self.config
        init = nn.initializers.normal(_INIT_STD)
        h = BertSelfAttention(cfg, name="attn")(x, attention_mask)
        x = nn.LayerNorm(epsilon=_LN_EPS, dtype=cfg.dtype, name="ln_attn")(x + h)
        h = nn.Dense(cfg.intermediate, dtype=cfg.dtype, kernel_init=init, name="fc_in")(x)
        h = nn.Dense(cfg.hidden, dtype=cfg.dtype, kernel_init=init, name="fc_out")(jax.nn.gelu(h))
        return nn.LayerNorm(epsilon=_LN_EPS, dtype=cfg.dtype, name="ln_mlp")(x + h)


class Bert(nn.Module):
    """BERT encoder for masked-LM: embeddings, ``num_layers`` post-LN blocks, tied MLM head."""

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        *,
        segments: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
    ) -> jax.Array:
        """Map int tokens ``[B, T]`` to MLM logits ``[B, T, vocab_size]``.

        Args:
            tokens: token ids ``[B, T]`` with ``T <= max_len``.
            segments: segment ids ``[B, T]``; all zeros when omitted.
            attention_mask: ``[B, T]``, true (or 1) for real tokens and false for padding;
                padded keys receive no attention. Everything is attended when omitted.
        """
        cfg = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape [batch, seq], got shape {tokens.shape}")
        if tokens.shape[1] > cfg.max_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_len={cfg.max_len}")
        if segments is None:
            segments = jnp.zeros_like(tokens)
        init = nn.initializers.normal(_INIT_STD)
        embed = nn.Embed(cfg.vocab_size, cfg.hidden, dtype=cfg.dtype, embedding_init=init, name="embed")
        pos_embed = nn.Embed(cfg.max_len, cfg.hidden, dtype=cfg.dtype, embedding_init=init, name="pos_embed")
        seg_embed = nn.Embed(
            cfg.type_vocab_size, cfg.hidden, dtype=cfg.dtype, embedding_init=init, name="segment_embed"
        )
        x = embed(tokens) + pos_embed(jnp.arange(tokens.shape[1]))[None] + seg_embed(segments)
        x = nn.LayerNorm(epsilon=_LN_EPS, dtype=cfg.dtype, name="ln_embed")(x)
        for i in range(cfg.num_layers):
            x = BertLayer(cfg, name=f"layer_{i}")(x, attention_mask)
        # MLM head: transform, then decode with the (tied) token embedding plus a bias.
        h = nn.Dense(cfg.hidden, dtype=cfg.dtype, kernel_init=init, name="mlm_dense")(x)
        h = nn.LayerNorm(epsilon=_LN_EPS, dtype=cfg.dtype, name="mlm_ln")(jax.nn.gelu(h))
        bias = self.param("mlm_bias", nn.initializers.zeros, (cfg.vocab_size,))
        return embed.attend(h) + bias.astype(cfg.dtype)
