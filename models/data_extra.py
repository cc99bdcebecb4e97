"""Deterministic synthetic batches for the BERT, Wide-ResNet and MoE models.

Like :mod:`models.data`, batches come from ``numpy.random.RandomState`` and are
numpy arrays, so a seed gives bit-identical data on every host and backend.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from models.bert import BertConfig
from models.data import _random_state
from models.moe import MoEConfig
from models.wide_resnet import WResNetConfig

MASK_FRACTION = 0.15
"""Fraction of positions of each :func:`bert_batch` row that are masked and predicted."""

_TEMPLATE_SEED = 4321


def _check_batch_size(batch_size: int) -> None:
    """Raise unless ``batch_size`` is positive."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size!r}")


def _progressions(rng: np.random.RandomState, batch_size: int, length: int, vocab: int) -> np.ndarray:
    """Rows ``(start + step * t) % vocab`` with random start and a small random step, int64."""
    start = rng.randint(0, vocab, size=(batch_size, 1))
    step = rng.randint(1, min(8, vocab) + 1, size=(batch_size, 1))
    return (start + step * np.arange(length)[None, :]) % vocab


def bert_batch(seed: Any, batch_size: int, config: BertConfig) -> dict[str, np.ndarray]:
    """Masked-LM batch ``{"tokens", "labels": int32 [B, max_len], "mask": bool [B, max_len]}``.

    ``labels`` are arithmetic progressions modulo ``vocab_size - 1`` (the last id
    is the mask token). In every row ``round(0.15 * max_len)`` positions (at
    least one) are chosen: ``mask`` marks them and ``tokens`` replaces 80% of
    them with the mask id ``vocab_size - 1``, 10% with a random id and leaves
    10% unchanged, as in BERT. Each masked token is predictable from its neighbours.
    """
    _check_batch_size(batch_size)
    if config.vocab_size < 3:
        raise ValueError(f"vocab_size must be at least 3 for masked-LM batches, got {config.vocab_size!r}")
    rng = _random_state(seed)
    mask_id = config.vocab_size - 1
    length = config.max_len
    labels = _progressions(rng, batch_size, length, mask_id)
    num_masked = max(1, round(MASK_FRACTION * length))
    positions = np.argsort(rng.random_sample((batch_size, length)), axis=1)[:, :num_masked]
    mask = np.zeros((batch_size, length), dtype=bool)
    np.put_along_axis(mask, positions, True, axis=1)
    action = rng.random_sample((batch_size, length))
    random_ids = rng.randint(0, mask_id, size=(batch_size, length))
    tokens = np.where(mask & (action < 0.8), mask_id, labels)
    tokens = np.where(mask & (action >= 0.8) & (action < 0.9), random_ids, tokens)
    return {"tokens": tokens.astype(np.int32), "labels": labels.astype(np.int32), "mask": mask}


def image_batch(seed: Any, batch_size: int, config: WResNetConfig) -> dict[str, np.ndarray]:
    """Classification batch ``{"images": float32 [B, S, S, 3], "labels": int32 [B]}``.

    Each class has a fixed random template image; a sample is its class template
    plus unit Gaussian noise, so the labels are learnable.
    """
    _check_batch_size(batch_size)
    rng = _random_state(seed)
    shape = (config.image_size, config.image_size, 3)
    labels = rng.randint(0, config.num_classes, size=batch_size)
    images = rng.standard_normal((batch_size, *shape))
    # Templates are made per class on demand: 1024 classes at 224x224 would not fit in memory.
    for label in np.unique(labels):
        template = np.random.RandomState([_TEMPLATE_SEED, int(label)]).standard_normal(shape)
        images[labels == label] += template
    return {"images": images.astype(np.float32), "labels": labels.astype(np.int32)}


def moe_batch(seed: Any, batch_size: int, config: MoEConfig) -> dict[str, np.ndarray]:
    """Language-model batch ``{"tokens": int32 [B, max_len]}``.

    Rows are arithmetic progressions modulo ``vocab_size``, as in :func:`models.data.gpt_batch`.
    """
    _check_batch_size(batch_size)
    rng = _random_state(seed)
    tokens = _progressions(rng, batch_size, config.max_len, config.vocab_size)
    return {"tokens": tokens.astype(np.int32)}
