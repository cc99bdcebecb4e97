"""Device calibration: measure this machine's devices and describe them as a :class:`ClusterSpec`.

Every figure the cost model reads from a spec is timed on the real devices: peak
FLOP/s per dtype (a square matmul on one device), memory bandwidth (an elementwise
pass over a large array), the time each kernel costs beyond its work
(:mod:`autopar._src.kernel_time`) and the intra-host link (an all-reduce over all devices,
solved for latency and bandwidth with the same ring model the planner uses).
What one host cannot measure (links between hosts) and what the runtime does not
report (memory size on some platforms) comes from a *base* spec.

Example:
  >>> spec = calibrate(quick=True)
  >>> spec.save("cluster.json")
  >>> print(report.cluster_table(spec))  # autopar._src.report
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autopar._src import cluster as cluster_mod
from autopar._src import kernel_time
from autopar._src.cluster import REQUIRED_DTYPES, ClusterSpec, DeviceSpec

_MIB = 2**20

# Timer floor: no device operation completes faster than this, so a smaller reading is timer noise
# and would otherwise turn into an infinite rate.
_MIN_SECONDS = 1e-7

# The mesh axis of the all-reduce.
_AXIS = "i"


class CalibrationError(RuntimeError):
    """A measurement gave a figure that cannot describe a device (not finite or not positive)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Effort:
    """How long and how large the measurements are."""

    min_seconds: float
    """Problem sizes grow until one timed call takes at least this long (or hits its maximum)."""
    repeats: int
    """Timed calls per throughput figure; the median is kept."""
    latency_repeats: int
    """Timed calls of the tiny all-reduce; the median is kept."""
    max_matmul_dim: int
    """Largest square matmul side."""
    max_stream_bytes: int
    """Largest array of the memory-bandwidth pass."""
    max_allreduce_bytes: int
    """Largest all-reduce message per device."""


_FULL = _Effort(
    min_seconds=0.05,
    repeats=10,
    latency_repeats=50,
    max_matmul_dim=16384,
    max_stream_bytes=1024 * _MIB,
    max_allreduce_bytes=256 * _MIB,
)
# Shorter calls and fewer repeats, up to the same sizes: a GPU needs the large problems to
# reach its peak (capped at 4096 and 64 MiB, an H200 read 365 TFLOP/s and 0.49 TB/s instead
# of 797 and 2.2), and slow devices stop growing them early anyway.
_QUICK = dataclasses.replace(_FULL, min_seconds=0.01, repeats=3, latency_repeats=10)


def default_base(device: jax.Device) -> ClusterSpec:
    """The preset a calibration of ``device`` falls back on for what it cannot measure.

    The preset named in the device kind (:func:`autopar._src.cluster.preset_name_for`),
    ``"cpu"`` on the CPU platform, and otherwise ``"h100"`` as a generic accelerator:
    accelerators report their memory size, so only the inter-host link figures of the
    fallback are used there.
    """
    return cluster_mod.preset(cluster_mod.preset_name_for(device) or "h100")


def calibrate(
    devices: Sequence[jax.Device] | None = None,
    *,
    quick: bool = False,
    progress: bool = True,
    base: ClusterSpec | None = None,
) -> ClusterSpec:
    """Measures ``devices`` and returns a one-host-per-process spec describing them.

    Peak FLOP/s per dtype and memory bandwidth are timed per device while all of them work at
    once (devices that share a host's cores, like XLA's simulated CPU devices, get their share);
    the intra-host link on an all-reduce over all of them. With a single device, and for links between
    hosts, the base spec's figures are kept; memory size comes from the runtime when it
    reports one, else from the base spec.

    Args:
      devices: devices to measure (default ``jax.devices()``); only this process's are used.
      quick: shorter timed calls and fewer repeats (seconds instead of a minute or so).
      progress: show a progress bar on stderr.
      base: spec to take unmeasured figures from (default :func:`default_base`).

    Returns:
      A spec with ``num_hosts = jax.process_count()`` and ``devices_per_host`` the number of
      local devices measured.

    Raises:
      ValueError: if no local device is given, one is given twice, or they differ in kind.
      CalibrationError: if a measurement is not a positive finite number.
    """
    local = _local_devices(jax.devices() if devices is None else devices)
    first = local[0]
    base = default_base(first) if base is None else base
    if not isinstance(base, ClusterSpec):
        raise ValueError(f"calibrate: base must be a ClusterSpec, got {type(base).__name__}")
    effort = _QUICK if quick else _FULL
    # Problem sizes stay well inside the device so that calibration never runs it out of memory.
    memory_bytes = _memory_bytes(first, base)
    room = memory_bytes // 8

    results: dict[str, float] = {}
    steps: list[tuple[str, Callable[[], float]]] = [
        (f"{dtype} matmul", functools.partial(_peak_flops, local, dtype, effort, room))
        for dtype in REQUIRED_DTYPES
    ]
    steps.append(("memory bandwidth", lambda: _bandwidth(local, effort, room)))
    steps.append(
        (
            "kernel time",
            lambda: kernel_time.measure(
                local,
                peak_flops=results["float32 matmul"],
                memory_bandwidth=results["memory bandwidth"],
                repeats=effort.repeats,
            ),
        )
    )
    if len(local) > 1:
        steps.append(("link latency", lambda: _allreduce_latency(local, effort)))
        steps.append(
            ("link bandwidth", lambda: _allreduce_bandwidth(local, effort, room, results["link latency"]))
        )
    _run_steps(steps, results, progress=progress)

    if len(local) > 1:
        latency, intra_bandwidth = results["link latency"], results["link bandwidth"]
    else:
        latency, intra_bandwidth = base.intra_host_latency, base.intra_host_bandwidth
    kind = str(first.device_kind)
    return ClusterSpec(
        name=f"{jax.process_count()}x{len(local)}x{kind.replace(' ', '-')}-calibrated",
        num_hosts=jax.process_count(),
        devices_per_host=len(local),
        device=DeviceSpec(
            name=kind,
            peak_flops=tuple((dtype, results[f"{dtype} matmul"]) for dtype in REQUIRED_DTYPES),
            memory_bandwidth=results["memory bandwidth"],
            memory_bytes=memory_bytes,
            kernel_time=results["kernel time"],
        ),
        intra_host_bandwidth=intra_bandwidth,
        intra_host_latency=latency,
        # A measured intra-host link slower than the base's inter-host one would make the spec
        # claim hosts talk faster than devices inside a host; cap the unmeasured figure instead.
        inter_host_bandwidth=min(base.inter_host_bandwidth, intra_bandwidth),
        inter_host_latency=base.inter_host_latency,
    )


def _local_devices(devices: Sequence[jax.Device]) -> list[jax.Device]:
    given = list(devices)
    if len({d.id for d in given}) != len(given):
        raise ValueError(f"calibrate: a device is given twice in {given}")
    me = jax.process_index()
    local = [d for d in given if d.process_index == me]
    if not local:
        raise ValueError(
            f"calibrate needs at least one device of this process (index {me}), got {given}; "
            "pass devices from jax.local_devices()"
        )
    kinds = sorted({(d.platform, str(d.device_kind)) for d in local})
    if len(kinds) > 1:
        raise ValueError(
            f"calibrate: devices must be identical, got kinds {kinds}; calibrate each kind separately"
        )
    return local


def _memory_bytes(device: jax.Device, base: ClusterSpec) -> int:
    # The CPU runtime reports no memory statistics (memory_stats() is None); the base spec's
    # figure stands in for it there.
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if isinstance(limit, int | np.integer) and limit > 0:
        return int(limit)
    return base.device.memory_bytes


@contextlib.contextmanager
def _progress_bar(enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        yield bar


def _run_steps(
    steps: Sequence[tuple[str, Callable[[], float]]], results: dict[str, float], *, progress: bool
) -> None:
    """Runs the measurement steps in order into ``results``, under a progress bar when asked."""
    with _progress_bar(progress) as bar:
        task = bar.add_task("calibrating", total=len(steps)) if bar is not None else None
        for name, step in steps:
            if bar is not None:
                bar.update(task, description=f"calibrating: {name}")
            results[name] = _checked(name, step())
            if bar is not None:
                bar.advance(task)


def _checked(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise CalibrationError(
            f"calibration step {name!r} measured {value!r}, expected a positive finite number; "
            "the device may be busy or the timer unreliable, run it again"
        )
    return value


def _median_seconds(call: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``call`` after one warm-up call, floored at :data:`_MIN_SECONDS`."""
    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    if not math.isfinite(median):
        raise CalibrationError(f"timer gave a non-finite reading {median!r}")
    return max(median, _MIN_SECONDS)


def _grown(
    make_call: Callable[[int], Callable[[], Any]],
    sizes: Sequence[int],
    *,
    min_seconds: float,
    repeats: int,
) -> tuple[int, float]:
    """Grows the problem through ``sizes`` until a call takes ``min_seconds``; returns (size, median)."""
    if not sizes:
        raise ValueError("calibrate: no problem size fits the device memory")
    for i, size in enumerate(sizes):
        call = make_call(size)
        jax.block_until_ready(call())  # compiles
        start = time.perf_counter()
        jax.block_until_ready(call())
        # Small problems measure dispatch and caches rather than the hardware; only a call long
        # enough (or the largest allowed) is timed in earnest.
        if time.perf_counter() - start >= min_seconds or i == len(sizes) - 1:
            return size, _median_seconds(call, repeats)
    raise AssertionError("unreachable")


def _doublings(start: int, stop: int) -> list[int]:
    sizes = []
    while start <= stop:
        sizes.append(start)
        start *= 2
    return sizes


def _filled(shape: tuple[int, ...], dtype: Any, sharding: Any) -> jax.Array:
    # Made on the device itself (no host copy) and cheaply: random numbers cost far more than the
    # timed work on CPUs. 0.5 keeps the largest matmul's sums well inside float16's range, and
    # the values are arguments, not constants, so the compiler cannot fold the work away.
    return jax.jit(lambda: jnp.full(shape, 0.5, dtype), out_shardings=sharding)()


def _peak_flops(devices: Sequence[jax.Device], dtype: str, effort: _Effort, room: int) -> float:
    """Per-device FLOP/s of square ``dtype`` matmuls running on all ``devices`` at once.

    Devices of one host may share its resources (XLA's simulated CPU devices share the
    cores): what one device gets while the others work too is what a sharded step sees.
    """
    itemsize = jnp.dtype(dtype).itemsize
    # Two operands and the result must fit in the room left for calibration.
    dims = [n for n in _doublings(256, effort.max_matmul_dim) if 3 * n * n * itemsize <= room] or [256]
    # Default precision, as the user's step gets: on GPUs float32 may then run on tensor cores.
    matmul = jax.jit(jnp.matmul)
    sharding = NamedSharding(Mesh(np.asarray(devices), (_AXIS,)), P(_AXIS))

    def make_call(n: int) -> Callable[[], Any]:
        a = _filled((len(devices), n, n), dtype, sharding)
        b = _filled((len(devices), n, n), dtype, sharding)
        return lambda: matmul(a, b)

    n, seconds = _grown(make_call, dims, min_seconds=effort.min_seconds, repeats=effort.repeats)
    return 2 * n**3 / seconds


def _bandwidth(devices: Sequence[jax.Device], effort: _Effort, room: int) -> float:
    """Per-device bytes read plus written per second by an elementwise pass over a large float32
    array on each of ``devices`` at once."""
    sizes = [s for s in _doublings(16 * _MIB, effort.max_stream_bytes) if 2 * s <= room] or [16 * _MIB]
    # Donating the input lets each pass write over it: a fresh output buffer every call would
    # add allocation (page faults on CPU) to what should be one read and one write.
    stream = jax.jit(lambda x: x * 0.5 + 1.0, donate_argnums=0)

    sharding = NamedSharding(Mesh(np.asarray(devices), (_AXIS,)), P(_AXIS))

    def make_call(num_bytes: int) -> Callable[[], Any]:
        cell = [_filled((len(devices) * (num_bytes // 4),), jnp.float32, sharding)]

        def call() -> jax.Array:
            cell[0] = stream(cell[0])
            return cell[0]

        return call

    with warnings.catch_warnings():
        # Without donation the pass still reads and writes the array once; the figure only gets
        # a little pessimistic, which is no reason to fail.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        num_bytes, seconds = _grown(make_call, sizes, min_seconds=effort.min_seconds, repeats=effort.repeats)
    return 2 * num_bytes / seconds


def _shard_map() -> Callable[..., Any]:
    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map

    return shard_map


def _allreduce_call(devices: Sequence[jax.Device], num_bytes: int) -> Callable[[], Any]:
    """An all-reduce of ``num_bytes`` (per device) of float32 over a 1-D mesh of ``devices``."""
    mesh = Mesh(np.asarray(devices), (_AXIS,))
    per_device = max(num_bytes // 4, 1)
    x = _filled((per_device * len(devices),), jnp.float32, NamedSharding(mesh, P(_AXIS)))
    fn = jax.jit(_shard_map()(lambda v: jax.lax.psum(v, _AXIS), mesh=mesh, in_specs=P(_AXIS), out_specs=P()))
    return lambda: fn(x)


def _allreduce_latency(devices: Sequence[jax.Device], effort: _Effort) -> float:
    """Per-step latency of the ring model, from a one-element all-reduce."""
    seconds = _median_seconds(_allreduce_call(devices, 4), effort.latency_repeats)
    # A ring all-reduce of a negligible message is 2 (n - 1) latency-bound steps.
    return max(seconds / (2 * (len(devices) - 1)), _MIN_SECONDS)


def _allreduce_bandwidth(devices: Sequence[jax.Device], effort: _Effort, room: int, latency: float) -> float:
    """Link bandwidth of the ring model, from all-reduces of growing messages and the latency."""
    n = len(devices)
    fixed = 2 * (n - 1) * latency
    # Messages double until one costs clearly more than the fixed latency.
    sizes = [s for s in _doublings(256 * 2**10, effort.max_allreduce_bytes) if 2 * s <= room] or [256 * 2**10]
    timed: list[tuple[int, float]] = []
    for size in sizes:
        timed.append((size, _median_seconds(_allreduce_call(devices, size), effort.repeats)))
        if timed[-1][1] >= max(effort.min_seconds, 10 * fixed):
            break
    return ring_bandwidth([b for b, _ in timed], [t for _, t in timed], n, fixed)


def ring_bandwidth(num_bytes: Sequence[float], seconds: Sequence[float], n: int, fixed: float) -> float:
    """The link bandwidth of ring all-reduces of ``num_bytes`` per device over ``n`` devices that
    took ``seconds``, ``fixed`` of which is latency.

    Time grows by ``2 (n - 1) / n`` bytes over the bandwidth per byte of the message: the slope
    is the Theil-Sen estimate (the median of the pairwise slopes), so a size that falls off a
    cache, or one latency-bound reading, does not move it. Noise can leave no positive slope (a
    single size, or messages all latency-bound): the largest message then gives the figure, its
    transfer time floored at half its total, which keeps it finite and within 2x of the
    latency-free lower bound.
    """
    ring = 2 * (n - 1) / n
    if len(num_bytes) > 1:
        slope = float(scipy.stats.theilslopes(seconds, num_bytes).slope)
        if slope > 0 and math.isfinite(slope):
            return ring / slope
    transfer = max(seconds[-1] - fixed, 0.5 * seconds[-1])
    return ring * num_bytes[-1] / transfer
