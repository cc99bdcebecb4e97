"""Plain Flax reference models (no parallelism) used by tests, demos and benchmarks."""

from models.bert import BERT_PRESETS, Bert, BertConfig, mlm_loss
from models.data import gpt_batch, mlp_batch
from models.data_extra import bert_batch, image_batch, moe_batch
from models.gpt import GPT, GPT_PRESETS, NNXGPT, Block, GPTConfig, NNXBlock
from models.losses import next_token_loss, softmax_cross_entropy
from models.mlp import MLP, NNXMLP, MLPConfig

__all__ = [
    "BERT_PRESETS",
    "Bert",
    "BertConfig",
    "MOE_PRESETS",
    "MoEConfig",
    "MoETransformer",
    "WRESNET_PRESETS",
    "WResNetConfig",
    "WideResNet",
    "bert_batch",
    "expert_capacity",
    "image_batch",
    "mlm_loss",
    "moe_batch",
    "moe_lm_loss",
    "top2_routing",
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
