"""Wide-ResNet (bottleneck blocks, BatchNorm) image classifier in Flax linen.

The block is ``conv1x1 -> conv3x3 (stride) -> conv1x1``: with ``f`` filters in a
stage, the first 1x1 conv has ``f`` outputs, the 3x3 conv ``f * width_factor``
and the last 1x1 conv ``4 * f``. Stage ``i`` has ``f = base_channels * 2**i``.
Widening only the 3x3 conv is what makes the sizes of the Alpa benchmark configs
(250M ... 13B parameters at 1024 classes) come out as named.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import linen as nn

from models.bert import check_float_dtype

_STAGE_SIZES: dict[int, tuple[int, ...]] = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class WResNetConfig:
    """Hyperparameters of a bottleneck Wide-ResNet classifier."""

    num_layers: Literal[50, 101] = 50
    """Depth; selects blocks per stage (3, 4, 6, 3) for 50 or (3, 4, 23, 3) for 101."""
    width_factor: int = 1
    """Multiplier on the output channels of each block's 3x3 conv."""
    base_channels: int = 8
    """Filters of the stem conv and of the first stage; stage ``i`` uses ``base * 2**i``."""
    num_classes: int = 10
    """Number of output classes."""
    image_size: int = 16
    """Height and width of the square NHWC input images."""
    blocks_per_stage: tuple[int, ...] | None = None
    """Blocks in each stage; ``None`` uses the standard layout for ``num_layers``."""
    dtype: Any = jnp.float32
    """Computation dtype; parameters and batch statistics stay float32."""

    def __post_init__(self) -> None:
        """Normalise and validate the fields."""
        if self.num_layers not in _STAGE_SIZES:
            raise ValueError(f"num_layers must be one of {sorted(_STAGE_SIZES)}, got {self.num_layers!r}")
        for name in ("width_factor", "base_channels", "num_classes", "image_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.blocks_per_stage is not None:
            blocks = tuple(self.blocks_per_stage)
            if not blocks or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in blocks):
                raise ValueError(
                    f"blocks_per_stage must be None or a non-empty tuple of positive ints, got {blocks!r}"
                )
            object.__setattr__(self, "blocks_per_stage", blocks)
        check_float_dtype(self.dtype)

    @property
    def stage_sizes(self) -> tuple[int, ...]:
        """Number of bottleneck blocks in each stage."""
        if self.blocks_per_stage is not None:
            return self.blocks_per_stage
        return _STAGE_SIZES[self.num_layers]

    @property
    def num_blocks(self) -> int:
        """Total number of bottleneck blocks."""
        return sum(self.stage_sizes)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> WResNetConfig:
        """Return the named preset from ``WRESNET_PRESETS`` with ``overrides`` applied."""
        if name not in WRESNET_PRESETS:
            raise ValueError(f"name must be one of {sorted(WRESNET_PRESETS)}, got {name!r}")
        return dataclasses.replace(WRESNET_PRESETS[name], **overrides)


def _alpa_config(num_layers: Literal[50, 101], base_channels: int, width_factor: int) -> WResNetConfig:
    """A 224x224, 1024-class config with the standard block layout."""
    return WResNetConfig(
        num_layers=num_layers,
        base_channels=base_channels,
        width_factor=width_factor,
        num_classes=1024,
        image_size=224,
    )


WRESNET_PRESETS: dict[str, WResNetConfig] = {
    "wresnet-tiny": WResNetConfig(
        num_layers=50,
        blocks_per_stage=(1, 1, 1, 1),
        base_channels=8,
        width_factor=1,
        num_classes=10,
        image_size=16,
    ),
    # Sizes of the Wide-ResNet benchmark of Alpa (Zheng et al., OSDI 2022).
    "wresnet-250m": _alpa_config(50, 160, 2),
    "wresnet-500m": _alpa_config(50, 224, 2),
    "wresnet-1b": _alpa_config(50, 320, 2),
    "wresnet-2b": _alpa_config(50, 448, 2),
    "wresnet-4b": _alpa_config(50, 640, 2),
    "wresnet-6.8b": _alpa_config(50, 320, 16),
    "wresnet-13b": _alpa_config(101, 320, 16),
}


class BottleneckBlock(nn.Module):
    """Bottleneck residual block with a projection shortcut when the shape changes."""

    filters: int
    """Base filters ``f`` of the block (output has ``4 * f`` channels)."""
    width_factor: int
    """Multiplier on the 3x3 conv's output channels."""
    strides: int
    """Stride of the 3x3 conv and of the projection shortcut."""
    dtype: Any
    """Computation dtype."""
    train: bool
    """Whether BatchNorm uses batch statistics (and updates ``batch_stats``)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the block to NHWC ``x``."""
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm, use_running_average=not self.train, momentum=0.9, epsilon=1e-5, dtype=self.dtype
        )
        stride = (self.strides, self.strides)
        y = nn.relu(norm(name="bn_1")(conv(self.filters, (1, 1), name="conv_1")(x)))
        y = conv(self.filters * self.width_factor, (3, 3), stride, name="conv_2")(y)
        y = nn.relu(norm(name="bn_2")(y))
        y = conv(self.filters * 4, (1, 1), name="conv_3")(y)
        # Zero-initialised last scale: each block starts as the identity on its shortcut.
        y = norm(scale_init=nn.initializers.zeros, name="bn_3")(y)
        if x.shape != y.shape:
            x = conv(self.filters * 4, (1, 1), stride, name="conv_proj")(x)
            x = norm(name="bn_proj")(x)
        return nn.relu(x + y)


class WideResNet(nn.Module):
    """Wide-ResNet: 7x7 stem, max-pool, bottleneck stages, global average pool, Dense head."""

    config: WResNetConfig

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        """Map NHWC images ``[B, S, S, 3]`` to logits ``[B, num_classes]``.

        With ``train=True`` BatchNorm normalises with batch statistics and the
        ``batch_stats`` collection must be mutable (``mutable=["batch_stats"]``).
        """
        cfg = self.config
        if x.ndim != 4:
            raise ValueError(f"images must have shape [batch, height, width, channels], got {x.shape}")
        x = x.astype(cfg.dtype)
        x = nn.Conv(
            cfg.base_channels,
            (7, 7),
            (2, 2),
            padding=[(3, 3), (3, 3)],
            use_bias=False,
            dtype=cfg.dtype,
            name="conv_init",
        )(x)
        x = nn.BatchNorm(
            use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=cfg.dtype, name="bn_init"
        )(x)
        x = nn.max_pool(nn.relu(x), (3, 3), strides=(2, 2), padding="SAME")
        for i, num_blocks in enumerate(cfg.stage_sizes):
            for j in range(num_blocks):
                x = BottleneckBlock(
                    filters=cfg.base_channels * 2**i,
                    width_factor=cfg.width_factor,
                    strides=2 if i > 0 and j == 0 else 1,
                    dtype=cfg.dtype,
                    train=train,
                    name=f"stage_{i}_block_{j}",
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(cfg.num_classes, dtype=cfg.dtype, name="head")(x)
