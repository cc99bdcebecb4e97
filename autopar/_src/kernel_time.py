"""The time a device spends on each kernel beyond the kernel's work.

A step of a microbatch runs the same kernels however small the microbatch is: each launches,
ramps up and drains, which the FLOPs and memory traffic the cost model prices do not cover.
On one H200, splitting a GPT-350M step of 8 sequences into 4 microbatches made it 1.6x slower
while its FLOPs and traffic grew by a few percent. :func:`measure` times a chain of small
kernels and keeps what their work does not explain (:attr:`DeviceSpec.kernel_time`).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

KERNELS_PER_LINK = 2
"""Kernels of one link of the chain, ``tanh(x @ w)``: the matmul, and the elementwise loop
that reads its output (a matmul's output cannot fuse into what reads it)."""
WORK_SECONDS = 1e-6
"""A chain link's matmul does about this much work at the device's float32 peak: kernels
of that size are those whose count, not their work, sets the time of a small microbatch."""
LINKS = (64, 192)
"""Lengths of the two chains timed: their difference cancels the call's own dispatch."""


def link_size(peak_flops: float) -> int:
    """The power-of-two side ``n`` of the chain's ``n x n`` matmuls, near :data:`WORK_SECONDS`
    of work at ``peak_flops``, in [16, 1024]."""
    n = (peak_flops * WORK_SECONDS / 2) ** (1 / 3)
    return int(min(max(2 ** round(math.log2(max(n, 1.0))), 16), 1024))


def measure(devices: list[jax.Device], *, peak_flops: float, memory_bandwidth: float, repeats: int) -> float:
    """Seconds per kernel on each of ``devices``, all running a chain at once, beyond its FLOPs
    over ``peak_flops`` (float32) and its traffic over ``memory_bandwidth`` (per device, measured
    the same way), floored at 0.1 us.

    The model prices a link as its matmul's FLOPs and the elementwise output written and read
    back once (:mod:`autopar._src.fusion`); the time the two chains differ by, less that, over
    their kernels, is the figure.
    """
    n = link_size(peak_flops)
    per_link = 2 * n**3 / peak_flops + 2 * 4 * n * n / memory_bandwidth
    seconds = [_chain_seconds(devices, n, links, repeats) for links in LINKS]
    extra = (seconds[1] - seconds[0]) / (LINKS[1] - LINKS[0]) - per_link
    return max(extra / KERNELS_PER_LINK, 1e-7)


def _chain_seconds(devices: list[jax.Device], n: int, links: int, repeats: int) -> float:
    """Median seconds of one call of a ``links``-long chain of ``tanh(x @ w_i)`` on each of
    ``devices``."""

    def chain(x: jax.Array, ws: list[jax.Array]) -> jax.Array:
        # Unrolled, not a loop: a loop adds its own bookkeeping between the links.
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    mesh = Mesh(np.asarray(devices), ("i",))
    # One n x n block per device. Separate weights, each its own argument: distinct values, so
    # no two links are the same computation, and slices of one array would make every matmul a
    # fusion of its own that a GPU compiler tunes apart (minutes for the longer chain).
    x = jax.device_put(jnp.full((len(devices), n, n), 0.5, jnp.float32), NamedSharding(mesh, P("i")))
    ws = [
        jax.device_put(jnp.full((n, n), 1.0 / n + i * 1e-6, jnp.float32), NamedSharding(mesh, P()))
        for i in range(links)
    ]
    fn: Any = jax.jit(chain)
    jax.block_until_ready(fn(x, ws))
    times = []
    for _ in range(max(repeats, 3)):
        start = time.perf_counter()
        jax.block_until_ready(fn(x, ws))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
