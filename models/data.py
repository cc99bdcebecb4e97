"""Deterministic synthetic batches for the reference models.

Batches are generated with ``numpy.random.RandomState`` and returned as numpy
arrays, so the same seed yields bit-identical data on every host and backend.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from models.gpt import GPTConfig
from models.mlp import MLPConfig

_TEACHER_SEED = 1234


def _random_state(seed: Any) -> np.random.RandomState:
    """Build a ``RandomState`` from an int seed or a JAX PRNG key."""
    if isinstance(seed, (int, np.integer)):
        return np.random.RandomState(int(seed) % 2**32)
    import jax  # Only needed for key inputs.

    key = seed
    if jax.dtypes.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.random.RandomState(np.asarray(key, dtype=np.uint32).ravel())


def mlp_batch(key_or_seed: Any, batch_size: int, config: MLPConfig) -> dict[str, np.ndarray]:
    """Classification batch ``{"x": float32 [B, in_features], "y": int32 [B]}``.

    Labels come from a fixed random linear teacher, so the task is learnable.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size!r}")
    rng = _random_state(key_or_seed)
    x = rng.standard_normal((batch_size, config.in_features)).astype(np.float32)
    teacher = np.random.RandomState(_TEACHER_SEED).standard_normal((config.in_features, config.num_classes))
    y = np.argmax(x @ teacher, axis=-1).astype(np.int32)
    return {"x": x, "y": y}


def gpt_batch(seed: Any, batch_size: int, config: GPTConfig) -> dict[str, np.ndarray]:
    """Language-model batch ``{"tokens": int32 [B, max_len]}``.

    Each row is an arithmetic progression modulo ``vocab_size`` with a random
    start and a small random step, so next tokens are predictable from context.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size!r}")
    rng = _random_state(seed)
    start = rng.randint(0, config.vocab_size, size=(batch_size, 1))
    step = rng.randint(1, min(8, config.vocab_size) + 1, size=(batch_size, 1))
    positions = np.arange(config.max_len)[None, :]
    tokens = (start + step * positions) % config.vocab_size
    return {"tokens": tokens.astype(np.int32)}
