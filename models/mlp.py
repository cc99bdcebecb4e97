"""Multi-layer perceptron classifier in Flax linen and NNX."""

from __future__ import annotations

import dataclasses

import jax
from flax import linen as nn
from flax import nnx


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """Hyperparameters of an MLP classifier."""

    features: tuple[int, ...] = (64, 64, 64)
    num_classes: int = 10
    in_features: int = 32

    def __post_init__(self) -> None:
        """Normalise and validate the fields."""
        object.__setattr__(self, "features", tuple(self.features))
        if not self.features or any(int(f) <= 0 for f in self.features):
            raise ValueError(f"features must be a non-empty tuple of positive ints, got {self.features!r}")
        if self.num_classes <= 0:
            raise ValueError(f"num_classes must be positive, got {self.num_classes!r}")
        if self.in_features <= 0:
            raise ValueError(f"in_features must be positive, got {self.in_features!r}")


class MLP(nn.Module):
    """Linen MLP: hidden Dense + ReLU layers followed by a Dense logits layer."""

    config: MLPConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Map inputs ``[B, in_features]`` to logits ``[B, num_classes]``."""
        for i, width in enumerate(self.config.features):
            x = jax.nn.relu(nn.Dense(width, name=f"dense_{i}")(x))
        return nn.Dense(self.config.num_classes, name="head")(x)


class NNXMLP(nnx.Module):
    """NNX MLP with the same architecture as :class:`MLP`."""

    def __init__(self, config: MLPConfig, *, rngs: nnx.Rngs) -> None:
        """Create the layers from ``config``."""
        self.config = config
        widths = (config.in_features, *config.features)
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(widths[:-1], widths[1:], strict=True)]
        )
        self.head = nnx.Linear(widths[-1], config.num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Map inputs ``[B, in_features]`` to logits ``[B, num_classes]``."""
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return self.head(x)
