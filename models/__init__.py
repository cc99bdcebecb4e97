"""Plain Flax reference models (no parallelism) used by tests, demos and benchmarks."""

from models.data import gpt_batch, mlp_batch
from models.gpt import GPT, GPT_PRESETS, NNXGPT, Block, GPTConfig, NNXBlock
from models.losses import next_token_loss, softmax_cross_entropy
from models.mlp import MLP, NNXMLP, MLPConfig

__all__ = [
    "GPT",
    "GPT_PRESETS",
    "MLP",
    "NNXGPT",
    "NNXMLP",
    "Block",
    "GPTConfig",
    "MLPConfig",
    "NNXBlock",
    "gpt_batch",
    "mlp_batch",
    "next_token_loss",
    "softmax_cross_entropy",
]
