"""Spec entries, ring collective costs and the resharding cost between two layouts.

Pure functions over specs, shapes and per-axis alpha-beta links (no devices, no JAX): they price
the collectives of the sharding strategies and the edges of the sharding ILP.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

Axes = str | tuple[str, ...] | None
"""What one dim of a :data:`Spec` is split over: a mesh axis, several (major first, as in a
``PartitionSpec``), or nothing."""
Spec = tuple[Axes, ...]
"""A PartitionSpec as a tuple: per tensor dim, the mesh axis or axes it is split over, or None."""


def entry_axes(entry: Axes) -> tuple[str, ...]:
    """The mesh axes of one spec entry, major first: ``()``, ``("data",)``, ``("data", "model")``."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _ring(num_bytes: float, num_devices: int, bandwidth: float, latency: float, steps: int) -> float:
    if num_devices < 1 or num_bytes < 0 or not bandwidth > 0 or latency < 0:
        raise ValueError(
            f"need num_devices >= 1, num_bytes >= 0, bandwidth > 0 and latency >= 0; got num_devices="
            f"{num_devices}, num_bytes={num_bytes}, bandwidth={bandwidth}, latency={latency}"
        )
    n = num_devices
    return steps * ((n - 1) / n * num_bytes / bandwidth + (n - 1) * latency)


def all_gather_cost(num_bytes: float, num_devices: int, *, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-gather; ``num_bytes`` is the gathered buffer each device ends with."""
    return _ring(num_bytes, num_devices, bandwidth, latency, 1)


def reduce_scatter_cost(num_bytes: float, num_devices: int, *, bandwidth: float, latency: float) -> float:
    """Seconds of a ring reduce-scatter; ``num_bytes`` is the full buffer each device starts with."""
    return _ring(num_bytes, num_devices, bandwidth, latency, 1)


def all_reduce_cost(num_bytes: float, num_devices: int, *, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-reduce (reduce-scatter then all-gather) of ``num_bytes`` per device."""
    return _ring(num_bytes, num_devices, bandwidth, latency, 2)


def all_to_all_cost(num_bytes: float, num_devices: int, *, bandwidth: float, latency: float) -> float:
    """Seconds of an all-to-all; ``num_bytes`` is each device's buffer (the same size before and after)."""
    return _ring(num_bytes, num_devices, bandwidth, latency, 1)


def _placements(
    spec: Sequence[Axes], shape: tuple[int, ...], mesh_axes: Mapping[str, int], what: str
) -> dict[str, tuple[int, tuple[str, ...]]]:
    """Mesh axis -> (the dim it splits, the axes before it on that dim)."""
    if len(spec) > len(shape):
        raise ValueError(f"{what}={tuple(spec)} has more entries than the array has dims (shape {shape})")
    named = {
        axis: (dim, axes[:k])
        for dim, entry in enumerate(spec)
        for axes in [entry_axes(entry)]
        for k, axis in enumerate(axes)
    }
    count = sum(len(entry_axes(entry)) for entry in spec)
    if any(axis not in mesh_axes for axis in named) or len(named) < count:
        raise ValueError(f"{what}={tuple(spec)} must name distinct axes of the mesh {dict(mesh_axes)}")
    return named


def resharding_cost(
    src_spec: Sequence[Axes],
    dst_spec: Sequence[Axes],
    shape: tuple[int, ...],
    itemsize: int,
    mesh_axes: Mapping[str, int],
    bandwidth: Mapping[str, float],
    latency: Mapping[str, float],
) -> float:
    """Seconds to turn an array sharded as ``src_spec`` into one sharded as ``dst_spec``.

    A dim may be split over several axes, major first (missing trailing dims are replicated).
    An axis stays where ``dst_spec`` has it on the same dim after the same axes. The others,
    by dim and minor axis first: an axis that ``dst_spec`` lacks is all-gathered; then an axis
    that moves is moved with an all-to-all if its new dim holds just the axes ``dst_spec``
    puts before it, else all-gathered (and sliced again below). An axis that only
    ``dst_spec`` has is a local slice, free. The collectives are priced with the per-axis
    ``bandwidth`` (bytes/s) and ``latency`` (s) by the ring formulas of
    :func:`all_gather_cost` and :func:`all_to_all_cost`, on the per-device buffer at that point
    (for an all-gather, the gathered one).

    Example:
      >>> resharding_cost(("x", None), (None, None), (4, 4), 4, {"x": 2}, {"x": 1e9}, {"x": 0.0})
      3.2e-08
    """
    src = _placements(src_spec, shape, mesh_axes, "src_spec")
    dst = _placements(dst_spec, shape, mesh_axes, "dst_spec")
    missing = sorted(set(src) - (set(bandwidth) & set(latency)))
    if missing:
        raise ValueError(
            f"bandwidth and latency need an entry for every mesh axis of src_spec; missing {missing}"
        )
    per_device = math.prod(shape) * itemsize / math.prod(mesh_axes[axis] for axis in src)
    layout: dict[int, list[str]] = {}
    for axis, (dim, _) in sorted(src.items(), key=lambda item: len(item[1][1])):
        layout.setdefault(dim, []).append(axis)
    seconds = 0.0
    order = sorted((a for a in src if dst.get(a) != src[a]), key=lambda a: (src[a][0], -len(src[a][1])))
    for axis in [a for a in order if a not in dst] + [a for a in order if a in dst]:
        n, link = mesh_axes[axis], {"bandwidth": bandwidth[axis], "latency": latency[axis]}
        layout[src[axis][0]].remove(axis)
        if axis in dst and layout.get(dst[axis][0], []) == list(dst[axis][1]):
            seconds += all_to_all_cost(per_device, n, **link)
            layout.setdefault(dst[axis][0], []).append(axis)
        else:
            per_device *= n
            seconds += all_gather_cost(per_device, n, **link)
    return seconds
