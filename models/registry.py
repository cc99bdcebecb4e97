"""Model presets by name, across families, for the command line and benchmarks."""

from __future__ import annotations

from typing import Any, Literal

from models.bert import BERT_PRESETS
from models.gpt import GPT_PRESETS
from models.mlp import MLPConfig
from models.moe import MOE_PRESETS
from models.wide_resnet import WRESNET_PRESETS

Kind = Literal["mlp", "gpt", "bert", "wresnet", "moe"]
"""The model families."""

DEFAULT_BATCH = {"gpt": 1024, "bert": 1024, "wresnet": 1536, "moe": 1024, "mlp": 1024}
"""Global batch sizes of Alpa's benchmarks for each family."""


def lookup(name: str) -> tuple[Kind, Any]:
    """``(kind, config)`` of a preset such as ``"gpt-2.6b"``, ``"bert-large"`` or ``"wresnet-1b"``.

    Raises:
      ValueError: for an unknown name (the message lists the known ones).
    """
    if name == "mlp":
        return "mlp", MLPConfig()
    families: tuple[tuple[Kind, dict[str, Any]], ...] = (
        ("gpt", GPT_PRESETS),
        ("bert", BERT_PRESETS),
        ("wresnet", WRESNET_PRESETS),
        ("moe", MOE_PRESETS),
    )
    for kind, presets in families:
        if name in presets:
            return kind, presets[name]
    raise ValueError(f"Unknown model {name!r}; known: {', '.join(names())}")


def names() -> list[str]:
    """All preset names."""
    return ["mlp", *GPT_PRESETS, *BERT_PRESETS, *WRESNET_PRESETS, *MOE_PRESETS]
