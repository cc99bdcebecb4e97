"""Meshes, layout specs and what one equation costs in a given layout.

The building blocks of :mod:`autopar._src.strategies`: a :class:`MeshSpec` with an
alpha-beta link model per axis, the candidate specs of an array, and
:func:`priced_strategy`, which turns one layout of one equation into a
:class:`~autopar._src.sharding_ilp.Strategy` with compute, communication and memory costs.
A spec is a tuple with, per tensor dim, the mesh axis the dim is split over, or ``None``; on a
mesh of several axes, dim 0 may also be split over all of them at once (a tuple of axes), which
is a batch split over every device of the mesh.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from autopar._src import cost
from autopar._src.collectives import Axes, Spec, all_reduce_cost, entry_axes, reduce_scatter_cost
from autopar._src.sharding_ilp import Strategy

Collective = Literal["allreduce", "reducescatter"]
"""A collective that finishes partial sums over one mesh axis."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """A logical device mesh with an alpha-beta link model per axis.

    Example:
      >>> mesh = MeshSpec(axis_names=("data", "model"), axis_sizes=(2, 4), bandwidth=(1e11, 1e11),
      ...                 latency=(1e-5, 1e-5), peak_flops=1e14, memory_bandwidth=1e12)
      >>> mesh.num_devices
      8
    """

    axis_names: tuple[str, ...]
    """Mesh axis names, e.g. ``("data", "model")``."""
    axis_sizes: tuple[int, ...]
    """Devices along each axis."""
    bandwidth: tuple[float, ...]
    """Collective bandwidth along each axis, bytes/s."""
    latency: tuple[float, ...]
    """Latency of one collective step along each axis, seconds."""
    peak_flops: float
    """Peak FLOP/s of one device; prices matmuls and convolutions."""
    memory_bandwidth: float
    """Device memory bandwidth, bytes/s; prices the memory-bound equations."""
    emulated_reduce_scatter: bool = False
    """Whether the backend lowers a reduce-scatter to an all-reduce and a slice (XLA:CPU does),
    so that it costs as much as the all-reduce."""

    def __post_init__(self) -> None:
        for field in ("axis_names", "axis_sizes", "bandwidth", "latency"):
            object.__setattr__(self, field, tuple(getattr(self, field)))
        n = len(self.axis_names)
        if n == 0 or len(set(self.axis_names)) != n or not all(isinstance(a, str) for a in self.axis_names):
            raise ValueError(f"MeshSpec.axis_names={self.axis_names!r} must be one or more distinct strings")
        for field in ("axis_sizes", "bandwidth", "latency"):
            if len(getattr(self, field)) != n:
                raise ValueError(
                    f"MeshSpec.{field}={getattr(self, field)!r} needs one entry per axis of "
                    f"axis_names={self.axis_names!r}"
                )
        if not all(isinstance(s, int | np.integer) and s >= 1 for s in self.axis_sizes):
            raise ValueError(f"MeshSpec.axis_sizes={self.axis_sizes!r} must be integers >= 1")
        for field in ("bandwidth", "peak_flops", "memory_bandwidth"):
            value = getattr(self, field)
            if not all(math.isfinite(v) and v > 0 for v in (value if isinstance(value, tuple) else (value,))):
                raise ValueError(f"MeshSpec.{field}={value!r} must be finite and > 0")
        if not all(math.isfinite(v) and v >= 0 for v in self.latency):
            raise ValueError(f"MeshSpec.latency={self.latency!r} must be finite and >= 0 seconds")

    @property
    def num_devices(self) -> int:
        """Devices in the mesh."""
        return math.prod(self.axis_sizes)

    def size(self, axis: Axes) -> int:
        """Devices along ``axis``, or along several axes together (a tuple: their product).

        Raises:
          ValueError: if an axis is not one of ``axis_names``.
        """
        return math.prod(self.axis_sizes[self._index(a)] for a in entry_axes(axis))

    def _index(self, axis: str) -> int:
        if axis not in self.axis_names:
            raise ValueError(f"mesh axis {axis!r} is not one of axis_names={self.axis_names!r}")
        return self.axis_names.index(axis)

    def link(self, axis: Axes) -> tuple[float, float]:
        """``(bandwidth, latency)`` of ``axis``; of several axes together, a ring over all their
        devices, as slow as their slowest link."""
        index = [self._index(a) for a in entry_axes(axis)]
        return min(self.bandwidth[i] for i in index), max(self.latency[i] for i in index)


def shape_of(v: Any) -> tuple[int, ...]:
    """Shape of a jaxpr atom (``()`` for scalars and tokens)."""
    return tuple(int(d) for d in getattr(v.aval, "shape", ()))


def num_shards(spec: Spec, mesh: MeshSpec) -> int:
    """Pieces an array laid out as ``spec`` is cut into."""
    return math.prod(mesh.size(a) for a in spec_axes(spec))


def spec_axes(*specs: Spec) -> set[str]:
    """The mesh axes ``specs`` split anything over."""
    return {a for spec in specs for entry in spec for a in entry_axes(entry)}


def share_bytes(v: Any, spec: Spec, mesh: MeshSpec) -> float:
    """Bytes per device of ``v`` laid out as ``spec``."""
    return cost.aval_bytes(v.aval) / num_shards(spec, mesh)


def split_axes(mesh: MeshSpec) -> tuple[str, ...]:
    """The axes with more than one device; splitting over the others changes nothing."""
    return tuple(a for a, s in zip(mesh.axis_names, mesh.axis_sizes, strict=True) if s > 1)


def divides(shape: Sequence[int], dim: int, axis: Axes, mesh: MeshSpec) -> bool:
    """Whether dim ``dim`` of ``shape`` splits evenly over ``axis`` (or over several axes)."""
    return shape[dim] > 0 and shape[dim] % mesh.size(axis) == 0


def all_axes(mesh: MeshSpec) -> tuple[str, ...] | None:
    """All the axes with more than one device as one split, where there are several: a dim split
    over it is cut into one piece per device."""
    axes = split_axes(mesh)
    return axes if len(axes) >= 2 else None


def spec_name(spec: Spec) -> str:
    """``"replicated"`` or e.g. ``"split[d0@data,d1@model]"`` (``d0@data.model``: over both)."""
    parts = [f"d{d}@{'.'.join(entry_axes(a))}" for d, a in enumerate(spec) if a is not None]
    return f"split[{','.join(parts)}]" if parts else "replicated"


def candidate_specs(shape: Sequence[int], mesh: MeshSpec) -> list[Spec]:
    """Replicated, each axis on each dim it divides, and on a 2-D mesh the first axis on dim 0
    with the last axis on any other dim (batch by data, heads or features by model) and dim 0
    over all axes (batch by every device)."""
    rank, axes, every = len(shape), split_axes(mesh), all_axes(mesh)
    specs: list[Spec] = [(None,) * rank]
    for axis in axes:
        for d in range(rank):
            if divides(shape, d, axis, mesh):
                specs.append(tuple(axis if i == d else None for i in range(rank)))
    if len(axes) >= 2 and rank >= 2 and divides(shape, 0, axes[0], mesh):
        for d in range(1, rank):
            if divides(shape, d, axes[-1], mesh):
                specs.append(tuple(axes[0] if i == 0 else axes[-1] if i == d else None for i in range(rank)))
    if every is not None and rank >= 1 and divides(shape, 0, every, mesh):
        specs.append((every, *(None,) * (rank - 1)))
    return specs


def all_specs(shape: Sequence[int], mesh: MeshSpec) -> list[Spec]:
    """The layouts an input may take: those of :func:`candidate_specs`."""
    return candidate_specs(shape, mesh)


def broadcast_spec(spec: Spec, out_shape: Sequence[int], in_shape: Sequence[int]) -> Spec:
    """The operand spec of an elementwise op: right-aligned, broadcast (size-1) dims replicated."""
    offset = len(out_shape) - len(in_shape)
    if offset < 0:
        return (None,) * len(in_shape)
    return tuple(
        spec[i + offset] if in_shape[i] == out_shape[i + offset] else None for i in range(len(in_shape))
    )


def priced_strategy(
    name: str,
    eqn: Any,
    mesh: MeshSpec,
    in_specs: Sequence[Spec],
    out_specs: Sequence[Spec],
    *,
    flops: float = 0.0,
    comm: float = 0.0,
    latency: float = 0.0,
    weight: int | None = None,
) -> Strategy:
    """One layout of ``eqn`` as a :class:`Strategy`, with its costs.

    Args:
      name: the strategy's name.
      eqn: the jaxpr equation.
      mesh: the mesh.
      in_specs: per invar (literals too), the spec the layout needs.
      out_specs: per outvar, the spec the layout produces.
      flops: the equation's FLOPs; compute is FLOPs over the devices sharing them (the
        product of the axes any spec uses) over peak FLOP/s. A memory-bound equation (no
        FLOPs) computes nothing here: the strategy graph charges the outputs XLA's fusion
        writes to memory (:mod:`autopar._src.fusion`), which depends on who reads them.
      comm: seconds of the collectives the layout issues.
      latency: of ``comm``, the seconds that do not depend on the bytes (:func:`collective_latency`).
      weight: index of the operand (a parameter) whose share counts towards memory with the outputs.
    """
    outs = sum(share_bytes(v, s, mesh) for v, s in zip(eqn.outvars, out_specs, strict=True))
    shards = math.prod(mesh.size(a) for a in spec_axes(*in_specs, *out_specs))
    compute = flops / shards / mesh.peak_flops
    memory = outs + (share_bytes(eqn.invars[weight], in_specs[weight], mesh) if weight is not None else 0.0)
    return Strategy(
        name=name,
        compute_cost=compute,
        communication_cost=comm,
        latency_cost=latency,
        memory_bytes=memory,
        output_specs=tuple(tuple(s) for s in out_specs),
        input_specs=tuple(tuple(s) for s in in_specs),
    )


def replicated_strategies(eqn: Any, mesh: MeshSpec) -> tuple[Strategy, ...]:
    """The one strategy of an equation without sharding rules: everything replicated."""
    in_specs = [(None,) * len(shape_of(v)) for v in eqn.invars]
    out_specs = [(None,) * len(shape_of(v)) for v in eqn.outvars]
    seconds = cost.eqn_flops(eqn) / mesh.peak_flops
    base = priced_strategy("replicated", eqn, mesh, in_specs, out_specs)
    return (dataclasses.replace(base, compute_cost=base.compute_cost + seconds),)


def collective_latency(kind: Collective, axis: Axes, mesh: MeshSpec) -> float:
    """The part of :func:`collective_cost` that does not depend on the bytes: its ring's steps."""
    return collective_cost(kind, 0.0, axis, mesh)


def collective_cost(kind: Collective, nbytes: float, axis: Axes, mesh: MeshSpec) -> float:
    """Seconds of a ring all-reduce or reduce-scatter of ``nbytes`` per device over ``axis``
    (or over several axes together)."""
    bandwidth, latency = mesh.link(axis)
    emulated = kind == "reducescatter" and mesh.emulated_reduce_scatter
    fn = all_reduce_cost if kind == "allreduce" or emulated else reduce_scatter_cost
    return fn(nbytes, mesh.size(axis), bandwidth=bandwidth, latency=latency)
