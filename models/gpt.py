"""GPT-2-style pre-LayerNorm decoder-only transformer in Flax linen and NNX."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from models.bert import check_float_dtype

_INIT_STD = 0.02


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Hyperparameters of a GPT-style decoder."""

    vocab_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    hidden: int = 64
    max_len: int = 32
    mlp_ratio: int = 4
    tie_embeddings: bool = False
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    remat: bool = False
    scan_layers: bool = False

    def __post_init__(self) -> None:
        """Validate the fields."""
        for name in ("vocab_size", "num_layers", "num_heads", "hidden", "max_len", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden must be divisible by num_heads={self.num_heads}, got {self.hidden!r}")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate!r}")
        check_float_dtype(self.dtype)

    @property
    def head_dim(self) -> int:
        """Width of each attention head."""
        return self.hidden // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        """Width of the feed-forward hidden layer."""
        return self.hidden * self.mlp_ratio

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """Return the named preset from ``GPT_PRESETS`` with ``overrides`` applied."""
        if name not in GPT_PRESETS:
            raise ValueError(f"name must be one of {sorted(GPT_PRESETS)}, got {name!r}")
        return dataclasses.replace(GPT_PRESETS[name], **overrides)


GPT_PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(vocab_size=128, num_layers=2, num_heads=4, hidden=64, max_len=32),
    "gpt-small": GPTConfig(vocab_size=512, num_layers=4, num_heads=4, hidden=128, max_len=64),
}


def _published(layers: int, hidden: int, heads: int) -> GPTConfig:
    return GPTConfig(vocab_size=51200, num_layers=layers, num_heads=heads, hidden=hidden, max_len=1024)


# Sizes of the GPT-3 paper's model table (layers, hidden, heads), with the sequence
# length 1024 and vocabulary 51200 of Alpa's GPT benchmark, plus Alpa's own sizes.
GPT_PRESETS.update(
    {
        "gpt3-125m": _published(12, 768, 12),
        "gpt3-350m": _published(24, 1024, 16),
        "gpt3-760m": _published(24, 1536, 16),
        # The table lists 24 heads of size 128 with hidden 2048; here hidden = heads x head size.
        "gpt3-1.3b": _published(24, 2048, 16),
        "gpt3-2.7b": _published(32, 2560, 32),
        "gpt3-6.7b": _published(32, 4096, 32),
        "gpt3-13b": _published(40, 5120, 40),
        "gpt3-175b": _published(96, 12288, 96),
        "gpt-350m": _published(24, 1024, 16),
        "gpt-1.3b": _published(24, 2048, 32),
        "gpt-2.6b": _published(32, 2560, 32),
        "gpt-6.7b": _published(32, 4096, 32),
        "gpt-15b": _published(48, 5120, 40),
        "gpt-39b": _published(48, 8192, 64),
        "gpt-76b": _published(60, 10240, 80),
    }
)


def _attention_weights(q: jax.Array, k: jax.Array) -> jax.Array:
    """Causal softmax weights ``[B, H, T, T]`` (float32) from ``[B, T, H, D]`` queries and keys."""
    seq_len, head_dim = q.shape[1], q.shape[-1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
    mask = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(logits, axis=-1)


def _attend(weights: jax.Array, v: jax.Array) -> jax.Array:
    """Combine values ``[B, T, H, D]`` with weights ``[B, H, T, T]`` into ``[B, T, H * D]``."""
    out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)
    return out.reshape(*out.shape[:2], -1)


def _check_length(tokens: jax.Array, config: GPTConfig) -> None:
    """Raise if ``tokens`` is not ``[B, T]`` with ``T <= max_len``."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape [batch, seq], got shape {tokens.shape}")
    if tokens.shape[1] > config.max_len:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_len={config.max_len}")


# --------------------------------------------------------------------------- linen


class LayerConfig(Protocol):
    """What the attention and feed-forward layers read of a config: GPT's, or the MoE
    transformer's for its attention and dense blocks."""

    @property
    def hidden(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> Any: ...
    @property
    def mlp_hidden(self) -> int | None: ...


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v/out projections."""

    config: LayerConfig

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        """Attend over ``x`` of shape ``[B, T, hidden]``."""
        cfg = self.config
        init = nn.initializers.normal(_INIT_STD)
        heads = (*x.shape[:2], cfg.num_heads, cfg.head_dim)
        q = nn.Dense(cfg.hidden, dtype=cfg.dtype, kernel_init=init, name="query")(x).reshape(heads)
        k = nn.Dense(cfg.hidden, dtype=cfg.dtype, kernel_init=init, name="key")(x).reshape(heads)
        v = nn.Dense(cfg.hidden, dtype=cfg.dtype, kernel_init=init, name="value")(x).reshape(heads)
        weights = _attention_weights(q, k)
        # Other models' configs (the MoE transformer) reuse this module without dropout.
        weights = nn.Dropout(getattr(cfg, "dropout_rate", 0.0))(weights, deterministic=deterministic)
        out = _attend(weights, v)
        return nn.Dense(cfg.hidden, dtype=cfg.dtype, kernel_init=init, name="out")(out)


class FeedForward(nn.Module):
    """Two-layer GELU feed-forward network."""

    config: LayerConfig
    width: int | None = None
    """Hidden width (default: ``config.mlp_hidden``, which GPT's config has)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the feed-forward network to ``x`` of shape ``[B, T, hidden]``."""
        cfg = self.config
        init = nn.initializers.normal(_INIT_STD)
        width = self.width if self.width is not None else cfg.mlp_hidden
        if width is None:
            raise ValueError("FeedForward needs width= for a config whose mlp_hidden is None")
        x = nn.Dense(width, dtype=cfg.dtype, kernel_init=init, name="fc_in")(x)
        x = jax.nn.gelu(x)
        return nn.Dense(cfg.hidden, dtype=cfg.dtype, kernel_init=init, name="fc_out")(x)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention and feed-forward with residuals."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        """Apply the block to ``x`` of shape ``[B, T, hidden]``."""
        cfg = self.config
        h = nn.LayerNorm(dtype=cfg.dtype, name="ln_1")(x)
        h = CausalSelfAttention(cfg, name="attn")(h, deterministic)
        x = x + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        h = nn.LayerNorm(dtype=cfg.dtype, name="ln_2")(x)
        h = FeedForward(cfg, name="mlp")(h)
        return x + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)


def _block_class(config: GPTConfig) -> type[nn.Module]:
    """Return :class:`Block`, wrapped in ``nn.remat`` when ``config.remat`` is set."""
    # static_argnums counts ``self``: argument 2 is ``deterministic``.
    return nn.remat(Block, static_argnums=(2,)) if config.remat else Block


class _ScanStep(nn.Module):
    """One block in ``nn.scan`` carry form: ``(x, deterministic) -> (x, None)``."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> tuple[jax.Array, None]:
        """Apply one block to the carry ``x``."""
        return _block_class(self.config)(self.config, name="block")(x, deterministic), None


class GPT(nn.Module):
    """Linen GPT: embeddings, ``num_layers`` pre-LN blocks, final LayerNorm and LM head."""

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """Map int tokens ``[B, T]`` to logits ``[B, T, vocab_size]``."""
        cfg = self.config
        _check_length(tokens, cfg)
        init = nn.initializers.normal(_INIT_STD)
        embed = nn.Embed(cfg.vocab_size, cfg.hidden, dtype=cfg.dtype, embedding_init=init, name="embed")
        pos_embed = nn.Embed(cfg.max_len, cfg.hidden, dtype=cfg.dtype, embedding_init=init, name="pos_embed")
        x = embed(tokens) + pos_embed(jnp.arange(tokens.shape[1]))[None]
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        if cfg.scan_layers:
            blocks = nn.scan(
                _ScanStep,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast,),
                length=cfg.num_layers,
            )
            x, _ = blocks(cfg, name="blocks")(x, deterministic)
        else:
            block_cls = _block_class(cfg)
            for i in range(cfg.num_layers):
                x = block_cls(cfg, name=f"block_{i}")(x, deterministic)
        h = nn.LayerNorm(dtype=cfg.dtype, name="ln_f")(x)
        if cfg.tie_embeddings:
            return embed.attend(h)
        return nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype, kernel_init=init, name="lm_head")(h)


# ----------------------------------------------------------------------------- NNX


class NNXCausalSelfAttention(nnx.Module):
    """NNX multi-head causal self-attention with separate q/k/v/out projections."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        """Create the projections from ``config``."""
        self.config = config
        init = nnx.initializers.normal(_INIT_STD)
        c = config.hidden
        self.query = nnx.Linear(c, c, dtype=config.dtype, kernel_init=init, rngs=rngs)
        self.key = nnx.Linear(c, c, dtype=config.dtype, kernel_init=init, rngs=rngs)
        self.value = nnx.Linear(c, c, dtype=config.dtype, kernel_init=init, rngs=rngs)
        self.out = nnx.Linear(c, c, dtype=config.dtype, kernel_init=init, rngs=rngs)
        self.dropout = nnx.Dropout(config.dropout_rate, rngs=rngs)

    def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """Attend over ``x`` of shape ``[B, T, hidden]``."""
        cfg = self.config
        heads = (*x.shape[:2], cfg.num_heads, cfg.head_dim)
        q, k, v = (proj(x).reshape(heads) for proj in (self.query, self.key, self.value))
        weights = self.dropout(_attention_weights(q, k), deterministic=deterministic)
        return self.out(_attend(weights, v))


class NNXFeedForward(nnx.Module):
    """NNX two-layer GELU feed-forward network."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        """Create the two projections from ``config``."""
        init = nnx.initializers.normal(_INIT_STD)
        self.fc_in = nnx.Linear(
            config.hidden, config.mlp_hidden, dtype=config.dtype, kernel_init=init, rngs=rngs
        )
        self.fc_out = nnx.Linear(
            config.mlp_hidden, config.hidden, dtype=config.dtype, kernel_init=init, rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the feed-forward network to ``x`` of shape ``[B, T, hidden]``."""
        return self.fc_out(jax.nn.gelu(self.fc_in(x)))


class NNXBlock(nnx.Module):
    """NNX pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        """Create the block's submodules from ``config``."""
        self.ln_1 = nnx.LayerNorm(config.hidden, dtype=config.dtype, rngs=rngs)
        self.attn = NNXCausalSelfAttention(config, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(config.hidden, dtype=config.dtype, rngs=rngs)
        self.mlp = NNXFeedForward(config, rngs=rngs)
        self.dropout = nnx.Dropout(config.dropout_rate, rngs=rngs)

    def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """Apply the block to ``x`` of shape ``[B, T, hidden]``."""
        h = self.attn(self.ln_1(x), deterministic=deterministic)
        x = x + self.dropout(h, deterministic=deterministic)
        h = self.mlp(self.ln_2(x))
        return x + self.dropout(h, deterministic=deterministic)


class NNXGPT(nnx.Module):
    """NNX GPT with the same architecture as :class:`GPT` (no remat or layer scan)."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        """Create the model from ``config``."""
        if config.remat:
            raise ValueError(f"remat is not supported by NNXGPT, got {config.remat!r}")
        if config.scan_layers:
            raise ValueError(f"scan_layers is not supported by NNXGPT, got {config.scan_layers!r}")
        self.config = config
        init = nnx.initializers.normal(_INIT_STD)
        self.embed = nnx.Embed(
            config.vocab_size, config.hidden, dtype=config.dtype, embedding_init=init, rngs=rngs
        )
        self.pos_embed = nnx.Embed(
            config.max_len, config.hidden, dtype=config.dtype, embedding_init=init, rngs=rngs
        )
        self.dropout = nnx.Dropout(config.dropout_rate, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(config, rngs=rngs) for _ in range(config.num_layers)])
        self.ln_f = nnx.LayerNorm(config.hidden, dtype=config.dtype, rngs=rngs)
        if not config.tie_embeddings:
            self.lm_head = nnx.Linear(
                config.hidden,
                config.vocab_size,
                use_bias=False,
                dtype=config.dtype,
                kernel_init=init,
                rngs=rngs,
            )

    def __call__(self, tokens: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """Map int tokens ``[B, T]`` to logits ``[B, T, vocab_size]``."""
        _check_length(tokens, self.config)
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1]))[None]
        x = self.dropout(x, deterministic=deterministic)
        for block in self.blocks:
            x = block(x, deterministic=deterministic)
        h = self.ln_f(x)
        if self.config.tie_embeddings:
            return self.embed.attend(h)
        return self.lm_head(h)
