"""The options of ``@autoparallel``, checked when they are made."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Literal

import jax

from autopar._src import schedule
from autopar._src.cluster import ClusterSpec, parse_cluster
from autopar._src.plan import Plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """Options of :func:`autoparallel` (validated on construction)."""

    num_microbatches: int | Literal["auto"] = 1
    """Microbatches each batch is split into (along the leading dim), or ``"auto"``."""
    num_stages: int | Literal["auto"] = "auto"
    """Pipeline stages, or ``"auto"`` to let autopar choose."""
    batch_argnums: tuple[int, ...] = (1,)
    """Positional arguments that hold the batch."""
    devices: tuple[Any, ...] | None = None
    """Devices to run on (default: ``jax.devices()``)."""
    schedule: schedule.ScheduleName = "1f1b"
    """Pipeline schedule."""
    plan: Plan | None = None
    """A plan to reuse instead of planning."""
    donate_argnums: tuple[int, ...] = ()
    """Positional arguments whose buffers the step may reuse for its outputs."""
    cluster: ClusterSpec | str | None = None
    """Cluster the stage search plans for, or its string (``"1x8xH100"``; default: a preset
    matching ``devices``)."""
    cost_model: Literal["analytic", "measured"] = "analytic"
    """Stage times estimated from FLOPs and links, or compiled and timed on the devices."""
    cost_cache: str | None = None
    """Directory of the measured-cost cache (default ``$AUTOPAR_CACHE_DIR`` or ``~/.cache/autopar/costs``)."""
    sharding: Literal["auto", "data"] = "auto"
    """``"auto"``: each stage's layouts come from the sharding ILP (data, tensor and
    optimizer-state parallelism as its costs say); ``"data"``: split the batch, replicate the
    parameters and optimizer state (the ILP lays out the values computed from them)."""
    mesh_shape: tuple[int, ...] | None = None
    """With an int ``num_stages``: each stage's logical mesh, ``(data,)`` or ``(data, model)``."""
    static_argnums: tuple[int, ...] = ()
    """Positional arguments that are Python values the step is traced with (hashable), as
    ``jax.jit``'s: each set of their values gets its own plan and program."""

    def __post_init__(self) -> None:
        for name in ("num_microbatches", "num_stages"):
            value = getattr(self, name)
            if value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive int or 'auto', got {value!r}")
            object.__setattr__(self, name, int(value))  # NumPy ints too
        if self.cost_model == "measured" and self.num_microbatches == "auto":
            raise ValueError(
                "cost_model='measured' needs num_microbatches as an int, got 'auto' (each candidate "
                "count would need its own measurements)"
            )
        if self.schedule not in schedule.SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {schedule.SCHEDULES}")
        if any(not isinstance(a, int) for a in self.batch_argnums):
            raise ValueError(f"batch_argnums must be ints, got {self.batch_argnums!r}")
        if any(not isinstance(a, int) for a in self.donate_argnums):
            raise ValueError(f"donate_argnums must be ints, got {self.donate_argnums!r}")
        if any(not isinstance(a, int) for a in self.static_argnums):
            raise ValueError(f"static_argnums must be ints, got {self.static_argnums!r}")
        if self.plan is not None:
            given = {
                "num_stages": (self.num_stages, "auto", self.plan.num_stages),
                "num_microbatches": (self.num_microbatches, 1, self.plan.num_microbatches),
                "schedule": (self.schedule, "1f1b", self.plan.schedule),
                "mesh_shape": (self.mesh_shape, None, None),
            }
            for name, (value, default, planned) in given.items():
                if value != default and value != planned:
                    raise ValueError(
                        f"{name}={value!r} conflicts with the plan given (which has {planned!r}); a plan "
                        f"fixes it: leave {name} out, or plan again with it."
                    )
        if set(self.donate_argnums) & set(self.batch_argnums):
            raise ValueError(
                f"donate_argnums={self.donate_argnums} overlaps batch_argnums={self.batch_argnums}; "
                "the batch is split into microbatches and cannot be donated"
            )
        if self.cost_model not in ("analytic", "measured"):
            raise ValueError(f"cost_model={self.cost_model!r} is not one of ('analytic', 'measured')")
        if self.cluster is not None:
            object.__setattr__(self, "cluster", as_cluster(self.cluster))
        if self.devices is not None:
            if len(self.devices) == 0:
                raise ValueError("devices is empty; pass at least one device or leave it as None")
            bad = [d for d in self.devices if not isinstance(d, jax.Device)]
            if bad:
                raise ValueError(f"devices must be jax devices (e.g. jax.devices()[:4]), got {bad[0]!r}")
            if len(set(self.devices)) != len(self.devices):
                twice = sorted({d.id for d in self.devices if self.devices.count(d) > 1})
                raise ValueError(f"devices lists device ids {twice} more than once; list each device once")
        if self.sharding not in ("auto", "data"):
            raise ValueError(f"sharding={self.sharding!r} is not one of ('auto', 'data')")
        if self.mesh_shape is not None:
            shape = self.mesh_shape
            if (
                not isinstance(shape, tuple)
                or len(shape) not in (1, 2)
                or not all(isinstance(d, int) and d >= 1 for d in shape)
            ):
                raise ValueError(
                    f"mesh_shape must be (data,) or (data, model) with positive ints, got {shape!r}"
                )
            if self.num_stages == "auto":
                raise ValueError(
                    f"mesh_shape={shape} needs an int num_stages; with num_stages='auto' the stage "
                    "search chooses each stage's mesh"
                )
            if len(shape) == 2 and shape[1] > 1 and self.sharding == "data":
                raise ValueError(
                    f"mesh_shape={shape} has a model axis, which sharding='data' never uses; "
                    "use sharding='auto'"
                )


def as_cluster(cluster: Any) -> ClusterSpec:
    """``cluster`` as a spec: a :class:`ClusterSpec`, or its string (``"2x8xH100"``)."""
    if isinstance(cluster, str):
        return parse_cluster(cluster)
    if not isinstance(cluster, ClusterSpec):
        raise ValueError(
            f"cluster must be an autopar.ClusterSpec or a string such as '2x8xH100', got {cluster!r}"
        )
    return cluster
