"""GShard-style mixture-of-experts decoder LM in Flax linen.

Blocks alternate a dense feed-forward layer (even blocks) and a mixture-of-experts
layer (odd blocks). Each MoE layer routes every token to its top-2 experts with
a fixed per-expert capacity; tokens over capacity skip that expert (their
residual path still carries them). Routing is deterministic: GShard's random
dispatch of the second expert is left out.

Tokens are routed in groups: each sequence is one group unless
``expert_group_size`` regroups the flattened ``[B * T]`` tokens (a batch with
fewer tokens than that is one group). With ``S`` tokens per group the capacity
of an expert is ``ceil(capacity_factor * S / E)`` (at most ``S``), so
``capacity_factor=2.0`` gives GShard's top-2 ``2S/E``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from models.bert import check_float_dtype
from models.gpt import CausalSelfAttention, FeedForward
from models.losses import next_token_loss

_INIT_STD = 0.02


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Hyperparameters of a GShard-style mixture-of-experts decoder."""

    vocab_size: int = 128
    """Number of token ids."""
    num_layers: int = 2
    """Number of transformer blocks; odd-numbered blocks are MoE blocks, so at least 2."""
    num_heads: int = 4
    """Attention heads per block; must divide ``hidden``."""
    hidden: int = 64
    """Width of the residual stream."""
    num_experts: int = 4
    """Experts in each MoE layer; at least 2 for top-2 routing."""
    expert_hidden: int = 128
    """Hidden width of each expert's feed-forward network."""
    mlp_hidden: int | None = None
    """Hidden width of the dense feed-forward layers; ``None`` uses ``expert_hidden``."""
    capacity_factor: float = 2.0
    """Expert capacity is ``ceil(capacity_factor * group_tokens / num_experts)``."""
    expert_group_size: int | None = None
    """Tokens per routing group, capped at batch * seq, which it must divide; ``None``: one per sequence."""
    dispatch: Literal["einsum", "scatter"] = "einsum"
    """Token dispatch: one-hot ``[G, S, E, C]`` einsums, or index scatter-add and gather."""
    max_len: int = 32
    """Longest sequence the position embedding covers."""
    dtype: Any = jnp.float32
    """Computation dtype; parameters and the router stay float32."""

    def __post_init__(self) -> None:
        """Validate the fields."""
        for name in ("vocab_size", "num_layers", "num_heads", "hidden", "expert_hidden", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_layers < 2:
            raise ValueError(
                f"num_layers must be at least 2 (every other block is MoE), got {self.num_layers!r}"
            )
        if (
            not isinstance(self.num_experts, int)
            or isinstance(self.num_experts, bool)
            or self.num_experts < 2
        ):
            raise ValueError(f"num_experts must be an int >= 2 for top-2 routing, got {self.num_experts!r}")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden must be divisible by num_heads={self.num_heads}, got {self.hidden!r}")
        for name in ("mlp_hidden", "expert_group_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be None or a positive int, got {value!r}")
        if not (isinstance(self.capacity_factor, (int, float)) and self.capacity_factor > 0):
            raise ValueError(f"capacity_factor must be a positive number, got {self.capacity_factor!r}")
        if self.dispatch not in ("einsum", "scatter"):
            raise ValueError(f"dispatch must be 'einsum' or 'scatter', got {self.dispatch!r}")
        check_float_dtype(self.dtype)

    @property
    def head_dim(self) -> int:
        """Width of each attention head."""
        return self.hidden // self.num_heads

    @property
    def dense_hidden(self) -> int:
        """Hidden width of the dense feed-forward layers."""
        return self.expert_hidden if self.mlp_hidden is None else self.mlp_hidden

    @property
    def num_moe_layers(self) -> int:
        """Number of MoE blocks (the odd-numbered ones)."""
        return self.num_layers // 2

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> MoEConfig:
        """Return the named preset from ``MOE_PRESETS`` with ``overrides`` applied."""
        if name not in MOE_PRESETS:
            raise ValueError(f"name must be one of {sorted(MOE_PRESETS)}, got {name!r}")
        return dataclasses.replace(MOE_PRESETS[name], **overrides)


def _gshard_config(hidden: int, num_layers: int, num_experts: int) -> MoEConfig:
    """A 32k-vocab, 16-head, 1024-token config with 8x-wide FFNs and 2048-token routing groups."""
    return MoEConfig(
        vocab_size=32000,
        num_layers=num_layers,
        num_heads=16,
        hidden=hidden,
        num_experts=num_experts,
        expert_hidden=8 * hidden,
        capacity_factor=2.0,
        expert_group_size=2048,
        max_len=1024,
    )


MOE_PRESETS: dict[str, MoEConfig] = {
    "moe-tiny": MoEConfig(
        vocab_size=128,
        num_layers=2,
        num_heads=4,
        hidden=64,
        num_experts=4,
        expert_hidden=128,
        capacity_factor=2.0,
        max_len=32,
    ),
    # Sizes of the GShard MoE benchmark of Alpa (Zheng et al., OSDI 2022). With 2048-token
    # groups, batch * 1024 must be below 2048 or a multiple of it.
    "moe-380m": _gshard_config(hidden=768, num_layers=8, num_experts=8),
    "moe-690m": _gshard_config(hidden=768, num_layers=8, num_experts=16),
    "moe-1.3b": _gshard_config(hidden=768, num_layers=16, num_experts=16),
    "moe-2.4b": _gshard_config(hidden=1024, num_layers=16, num_experts=16),
    "moe-10b": _gshard_config(hidden=1536, num_layers=16, num_experts=32),
    "moe-27b": _gshard_config(hidden=2048, num_layers=16, num_experts=48),
}


# ------------------------------------------------------------------------- routing


class Routing(NamedTuple):
    """Top-2 assignment of the tokens of ``G`` groups of ``S`` tokens to ``E`` experts."""

    expert_index: jax.Array
    """int32 ``[G, S, 2]``: first and second choice expert of each token."""
    slot: jax.Array
    """int32 ``[G, S, 2]``: position in that expert's buffer; ``capacity`` when dropped."""
    weight: jax.Array
    """float32 ``[G, S, 2]``: combine weight (renormalised top-2 gate), 0 when dropped."""
    aux_loss: jax.Array
    """float32 scalar: GShard load-balancing loss, 1 for a uniform router, at least ``1 / E``."""


def expert_capacity(group_size: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert for a group of ``group_size`` tokens: ``ceil(cf * S / E)``, in ``[1, S]``."""
    return max(1, min(group_size, math.ceil(capacity_factor * group_size / num_experts)))


def top2_routing(router_logits: jax.Array, *, capacity: int) -> Routing:
    """Route tokens to their two highest-scoring experts, respecting ``capacity``.

    Slots are given in token order, first choices before second choices, so an
    expert never holds more than ``capacity`` tokens and each slot at most one.

    Args:
        router_logits: ``[G, S, E]`` router scores (softmax is taken over ``E``).
        capacity: slots per expert and group.

    Returns:
        The :class:`Routing` of every token.
    """
    if router_logits.ndim != 3:
        raise ValueError(
            f"router_logits must have shape [groups, tokens, experts], got {router_logits.shape}"
        )
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity!r}")
    num_experts = router_logits.shape[-1]
    logits = router_logits.astype(jnp.float32)
    gates = jax.nn.softmax(logits, axis=-1)

    index_1 = jnp.argmax(logits, axis=-1)
    mask_1 = jax.nn.one_hot(index_1, num_experts, dtype=jnp.int32)
    # Mask the first choice out of the logits (not the gates) so the two always differ.
    index_2 = jnp.argmax(jnp.where(mask_1 > 0, -jnp.inf, logits), axis=-1)
    mask_2 = jax.nn.one_hot(index_2, num_experts, dtype=jnp.int32)

    # Load balancing (GShard): fraction of first choices times mean gate, per expert.
    density = jnp.mean(mask_1.astype(jnp.float32), axis=1)
    density_proxy = jnp.mean(gates, axis=1)
    aux_loss = jnp.mean(jnp.sum(density * density_proxy, axis=-1)) * num_experts

    position_1 = jnp.cumsum(mask_1, axis=1) - 1
    kept_1 = mask_1 * (position_1 < capacity)
    position_2 = jnp.cumsum(mask_2, axis=1) - 1 + jnp.sum(kept_1, axis=1, keepdims=True)
    kept_2 = mask_2 * (position_2 < capacity)

    gate_1 = jnp.sum(gates * mask_1, axis=-1)
    gate_2 = jnp.sum(gates * mask_2, axis=-1)
    denom = gate_1 + gate_2 + 1e-9
    valid_1 = jnp.sum(kept_1, axis=-1) > 0
    valid_2 = jnp.sum(kept_2, axis=-1) > 0
    slot_1 = jnp.where(valid_1, jnp.sum(position_1 * mask_1, axis=-1), capacity)
    slot_2 = jnp.where(valid_2, jnp.sum(position_2 * mask_2, axis=-1), capacity)
    return Routing(
        expert_index=jnp.stack([index_1, index_2], axis=-1).astype(jnp.int32),
        slot=jnp.stack([slot_1, slot_2], axis=-1).astype(jnp.int32),
        weight=jnp.stack([gate_1 * valid_1 / denom, gate_2 * valid_2 / denom], axis=-1),
        aux_loss=aux_loss,
    )


def dispatch_mask(routing: Routing, *, num_experts: int, capacity: int) -> jax.Array:
    """One-hot dispatch tensor ``[G, S, E, C]`` (1 where a token occupies a slot) of ``routing``."""
    experts = jax.nn.one_hot(routing.expert_index, num_experts, dtype=jnp.float32)
    # A dropped token has slot == capacity, whose one-hot row is all zeros.
    slots = jax.nn.one_hot(routing.slot, capacity, dtype=jnp.float32)
    return jnp.einsum("gske,gskc->gsec", experts, slots)


def combine_weights(routing: Routing, *, num_experts: int, capacity: int) -> jax.Array:
    """Combine tensor ``[G, S, E, C]``: the dispatch mask scaled by each token's gate weight."""
    experts = jax.nn.one_hot(routing.expert_index, num_experts, dtype=jnp.float32)
    slots = jax.nn.one_hot(routing.slot, capacity, dtype=jnp.float32)
    return jnp.einsum("gske,gskc,gsk->gsec", experts, slots, routing.weight)


# -------------------------------------------------------------------------- layers


class MoEFeedForward(nn.Module):
    """Top-2 gated mixture of ``num_experts`` GELU feed-forward experts (no biases)."""

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Apply the experts to ``x [B, T, hidden]``; return the output and the aux loss."""
        cfg = self.config
        batch, seq_len, hidden = x.shape
        num_tokens = batch * seq_len
        group_size = seq_len if cfg.expert_group_size is None else min(cfg.expert_group_size, num_tokens)
        if num_tokens % group_size:
            raise ValueError(
                f"expert_group_size={group_size} must divide batch * seq = {batch} * {seq_len}; "
                "change the batch size or expert_group_size"
            )
        groups = x.reshape(num_tokens // group_size, group_size, hidden)
        capacity = expert_capacity(group_size, cfg.num_experts, cfg.capacity_factor)

        init = nn.initializers.normal(_INIT_STD)
        router = self.param("router", init, (hidden, cfg.num_experts))
        w_in = self.param("w_in", init, (cfg.num_experts, hidden, cfg.expert_hidden))
        w_out = self.param("w_out", init, (cfg.num_experts, cfg.expert_hidden, hidden))

        router_logits = jnp.einsum("gsm,me->gse", groups.astype(jnp.float32), router)
        routing = top2_routing(router_logits, capacity=capacity)

        if cfg.dispatch == "einsum":
            dispatch = dispatch_mask(routing, num_experts=cfg.num_experts, capacity=capacity)
            expert_in = jnp.einsum("gsec,gsm->egcm", dispatch.astype(cfg.dtype), groups)
        else:
            expert_in = _scatter_to_experts(groups, routing, num_experts=cfg.num_experts, capacity=capacity)

        h = jnp.einsum("egcm,emh->egch", expert_in, w_in.astype(cfg.dtype))
        expert_out = jnp.einsum("egch,ehm->egcm", jax.nn.gelu(h), w_out.astype(cfg.dtype))

        if cfg.dispatch == "einsum":
            combine = combine_weights(routing, num_experts=cfg.num_experts, capacity=capacity)
            out = jnp.einsum("gsec,egcm->gsm", combine.astype(cfg.dtype), expert_out)
        else:
            out = _gather_from_experts(expert_out, routing, capacity=capacity)
        return out.reshape(batch, seq_len, hidden), routing.aux_loss


def _scatter_to_experts(groups: jax.Array, routing: Routing, *, num_experts: int, capacity: int) -> jax.Array:
    """Scatter-add tokens ``[G, S, M]`` into expert buffers ``[E, G, C, M]``; dropped tokens vanish."""
    num_groups, group_size, hidden = groups.shape
    group_index = jnp.broadcast_to(jnp.arange(num_groups)[:, None, None], routing.slot.shape)
    updates = jnp.broadcast_to(groups[:, :, None, :], (num_groups, group_size, 2, hidden))
    buffers = jnp.zeros((num_experts, num_groups, capacity, hidden), groups.dtype)
    # Dropped tokens have slot == capacity: out of bounds, so mode="drop" discards them.
    return buffers.at[routing.expert_index, group_index, routing.slot].add(updates, mode="drop")


def _gather_from_experts(expert_out: jax.Array, routing: Routing, *, capacity: int) -> jax.Array:
    """Gather each token's two expert outputs from ``[E, G, C, M]`` and mix them into ``[G, S, M]``."""
    num_groups = expert_out.shape[1]
    group_index = jnp.broadcast_to(jnp.arange(num_groups)[:, None, None], routing.slot.shape)
    # Clamp dropped slots to a valid index; their weight is 0.
    picked = expert_out[routing.expert_index, group_index, jnp.minimum(routing.slot, capacity - 1)]
    return jnp.einsum("gskm,gsk->gsm", picked, routing.weight.astype(expert_out.dtype))


class MoEBlock(nn.Module):
    """Pre-LayerNorm block whose feed-forward layer is dense or a mixture of experts."""

    config: MoEConfig
    use_moe: bool
    """Whether the feed-forward layer is :class:`MoEFeedForward`."""

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Apply the block to ``x [B, T, hidden]``; return it and the aux loss (0 if dense)."""
        cfg = self.config
        x = x + CausalSelfAttention(cfg, name="attn")(nn.LayerNorm(dtype=cfg.dtype, name="ln_1")(x))
        h = nn.LayerNorm(dtype=cfg.dtype, name="ln_2")(x)
        if self.use_moe:
            h, aux_loss = MoEFeedForward(cfg, name="moe")(h)
        else:
            h, aux_loss = FeedForward(cfg, width=cfg.dense_hidden, name="mlp")(h), jnp.zeros((), jnp.float32)
        return x + h, aux_loss


class MoETransformer(nn.Module):
    """Decoder-only LM whose odd-numbered blocks use top-2 mixture-of-experts FFNs."""

    config: MoEConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Map int tokens ``[B, T]`` to ``(logits [B, T, vocab_size], aux_loss)``.

        ``aux_loss`` is the load-balancing loss averaged over the MoE layers.
        """
        cfg = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape [batch, seq], got shape {tokens.shape}")
        if tokens.shape[1] > cfg.max_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_len={cfg.max_len}")
        init = nn.initializers.normal(_INIT_STD)
        embed = nn.Embed(cfg.vocab_size, cfg.hidden, dtype=cfg.dtype, embedding_init=init, name="embed")
        pos_embed = nn.Embed(cfg.max_len, cfg.hidden, dtype=cfg.dtype, embedding_init=init, name="pos_embed")
        x = embed(tokens) + pos_embed(jnp.arange(tokens.shape[1]))[None]
        aux_total = jnp.zeros((), jnp.float32)
        for i in range(cfg.num_layers):
            x, aux_loss = MoEBlock(cfg, use_moe=i % 2 == 1, name=f"block_{i}")(x)
            aux_total = aux_total + aux_loss
        h = nn.LayerNorm(dtype=cfg.dtype, name="ln_f")(x)
        logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype, kernel_init=init, name="lm_head")(
            h
        )
        return logits, aux_total / cfg.num_moe_layers


def moe_lm_loss(
    logits: jax.Array, aux_loss: jax.Array, tokens: jax.Array, *, aux_weight: float = 0.01
) -> jax.Array:
    """Next-token cross-entropy plus ``aux_weight`` times the load-balancing loss."""
    return next_token_loss(logits, tokens) + aux_weight * aux_loss
