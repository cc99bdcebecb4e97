"""Scalar loss functions for the reference models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of ``logits [..., C]`` against integer ``labels [...]``."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return jnp.mean(losses)


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean language-model loss predicting ``tokens[:, t + 1]`` from ``logits[:, t]``."""
    return softmax_cross_entropy(logits[:, :-1], tokens[:, 1:])
