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
from models.data import gpt_batch, mlp_batch
from models.gpt import GPT, NNXGPT, GPTConfig
from models.losses import next_token_loss, softmax_cross_entropy
from models.mlp import MLP, NNXMLP, MLPConfig

Kind = Literal["mlp", "gpt"]


def make_batch(kind: Kind, config: Any, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A deterministic synthetic batch for ``kind``."""
    return mlp_batch(seed, batch_size, config) if kind == "mlp" else gpt_batch(seed, batch_size, config)


def _loss(kind: Kind, apply: Callable[[Any], Any], batch: dict[str, Any]) -> Any:
    if kind == "mlp":
        return softmax_cross_entropy(apply(batch["x"]), batch["y"])
    return next_token_loss(apply(batch["tokens"]), batch["tokens"])


def linen_state(kind: Kind, config: Any, tx: optax.GradientTransformation, seed: int = 0) -> Any:
    """A ``flax.training.train_state.TrainState`` for the linen model."""
    model = MLP(config) if kind == "mlp" else GPT(config)
    batch = make_batch(kind, config, 2)
    x = batch["x"] if kind == "mlp" else batch["tokens"]
    params = model.init(jax.random.key(seed), x)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def linen_step(kind: Kind) -> Callable[[Any, dict[str, Any]], tuple[Any, Any]]:
    """``step(state, batch) -> (state, loss)`` for a linen ``TrainState``."""

    def step(state: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
        def loss_fn(params: Any) -> Any:
            return _loss(kind, lambda x: state.apply_fn({"params": params}, x), batch)

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step


def nnx_state(kind: Kind, config: Any, tx: optax.GradientTransformation, seed: int = 0) -> tuple[Any, Any]:
    """``(graphdef, state)`` of an NNX model and its ``nnx.Optimizer``."""
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


def tiny_config(kind: Kind, **overrides: Any) -> MLPConfig | GPTConfig:
    """The tiny config used in tests."""
    if kind == "mlp":
        return MLPConfig(**overrides)
    return GPTConfig.preset("gpt-tiny", **overrides)
