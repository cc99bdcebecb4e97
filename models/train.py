"""Single-device train steps for the reference models (linen and NNX).

The steps are plain JAX: they call ``autopar.value_and_grad`` (which is
``jax.value_and_grad`` outside ``@autopar.autoparallel``), so the same function
runs under ``jax.jit`` and under ``autopar.autoparallel``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import autopar
from models.bert import Bert, BertConfig, mlm_loss
from models.data import gpt_batch, mlp_batch
from models.data_extra import bert_batch, image_batch, moe_batch
from models.gpt import GPT, NNXGPT, GPTConfig
from models.losses import next_token_loss, softmax_cross_entropy
from models.mlp import MLP, NNXMLP, MLPConfig
from models.moe import MoEConfig, MoETransformer
from models.registry import Kind
from models.wide_resnet import WideResNet, WResNetConfig

MOE_AUX_WEIGHT = 0.01
"""Weight of the MoE load-balancing loss in the training loss."""


def make_batch(kind: Kind, config: Any, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A deterministic synthetic batch for ``kind``."""
    makers: dict[str, Callable[[int, int, Any], dict[str, np.ndarray]]] = {
        "mlp": mlp_batch,
        "gpt": gpt_batch,
        "bert": bert_batch,
        "wresnet": image_batch,
        "moe": moe_batch,
    }
    return makers[kind](seed, batch_size, config)


def _input(kind: Kind, batch: dict[str, Any]) -> Any:
    return batch[{"mlp": "x", "wresnet": "images"}.get(kind, "tokens")]


def _loss(kind: Kind, apply: Callable[[Any], Any], batch: dict[str, Any]) -> Any:
    if kind == "mlp":
        return softmax_cross_entropy(apply(batch["x"]), batch["y"])
    if kind == "bert":
        return mlm_loss(apply(batch["tokens"]), batch["labels"], batch["mask"])
    if kind == "moe":
        logits, aux = apply(batch["tokens"])
        return next_token_loss(logits, batch["tokens"]) + MOE_AUX_WEIGHT * aux
    return next_token_loss(apply(batch["tokens"]), batch["tokens"])


class BatchNormTrainState(train_state.TrainState):
    """A ``TrainState`` that also carries BatchNorm statistics."""

    batch_stats: Any = None


def _linen_model(kind: Kind, config: Any) -> Any:
    models = {"mlp": MLP, "gpt": GPT, "bert": Bert, "wresnet": WideResNet, "moe": MoETransformer}
    return models[kind](config)


def linen_state(kind: Kind, config: Any, tx: optax.GradientTransformation, seed: int = 0) -> Any:
    """A ``TrainState`` for the linen model (with BatchNorm statistics for Wide-ResNet)."""
    model = _linen_model(kind, config)
    x = _input(kind, make_batch(kind, config, 2))
    if kind == "wresnet":
        variables = model.init(jax.random.key(seed), x, train=False)
        return BatchNormTrainState.create(
            apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"], tx=tx
        )
    params = model.init(jax.random.key(seed), x)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def linen_step(kind: Kind) -> Callable[[Any, dict[str, Any]], tuple[Any, Any]]:
    """``step(state, batch) -> (state, loss)`` for a linen ``TrainState``."""
    if kind == "wresnet":
        return _batchnorm_step

    def step(state: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
        def loss_fn(params: Any) -> Any:
            return _loss(kind, lambda x: state.apply_fn({"params": params}, x), batch)

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step


def _batchnorm_step(state: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
    """Train step of a BatchNorm model: new statistics come back as aux of the loss."""

    def loss_fn(params: Any) -> Any:
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["images"],
            train=True,
            mutable=["batch_stats"],
        )
        return softmax_cross_entropy(logits, batch["labels"]), updates["batch_stats"]

    (loss, stats), grads = autopar.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads).replace(batch_stats=stats), loss


def nnx_state(kind: Kind, config: Any, tx: optax.GradientTransformation, seed: int = 0) -> tuple[Any, Any]:
    """``(graphdef, state)`` of an NNX model (MLP or GPT) and its ``nnx.Optimizer``."""
    rngs = nnx.Rngs(seed)
    model = NNXMLP(config, rngs=rngs) if kind == "mlp" else NNXGPT(config, rngs=rngs)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    return nnx.split((model, optimizer))


def nnx_step(kind: Kind, graphdef: Any) -> Callable[[Any, dict[str, Any]], tuple[Any, Any]]:
    """``step(state, batch) -> (state, loss)`` over the split NNX model and optimizer."""

    def step(state: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(m: Any) -> Any:
            return _loss(kind, m, batch)

        loss, grads = autopar.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return step


def setup(
    kind: Kind, api: Literal["linen", "nnx"], config: Any, tx: optax.GradientTransformation, seed: int = 0
) -> tuple[Callable[..., Any], Any]:
    """``(step, state)`` for a model kind and Flax API."""
    if api == "linen":
        return linen_step(kind), linen_state(kind, config, tx, seed)
    graphdef, state = nnx_state(kind, config, tx, seed)
    return nnx_step(kind, graphdef), state


def tiny_config(kind: Kind, **overrides: Any) -> Any:
    """The tiny config used in tests."""
    if kind == "mlp":
        return MLPConfig(**overrides)
    presets: dict[str, tuple[Any, str]] = {
        "gpt": (GPTConfig, "gpt-tiny"),
        "bert": (BertConfig, "bert-tiny"),
        "wresnet": (WResNetConfig, "wresnet-tiny"),
        "moe": (MoEConfig, "moe-tiny"),
    }
    cls, name = presets[kind]
    return cls.preset(name, **overrides)
