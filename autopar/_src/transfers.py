"""Moving arrays between submeshes without a trip through host memory.

``jax.device_put`` from one mesh to another is a device-to-device copy only when every
block the destination needs is a block the source already holds; otherwise JAX gathers the
array on the host. A :class:`Route` makes every copy between two layouts with identical
per-device blocks (the same list of blocks, device by device in mesh order, when both meshes
have as many devices; every destination block a source block otherwise):

1. reshard on the source mesh to the ``send`` layout (a collective inside one ``jit``),
2. ``device_put`` from ``send`` to ``recv`` (block for block),
3. reshard on the destination mesh from ``recv`` to the layout wanted there.

Candidates: the destination's layout built on the source mesh (reshard first, send its
blocks), the source's layout built on the destination mesh (send, then reshard), and flat
layouts that cut one dim into as many blocks as both meshes can hold. The cheapest by bytes
moved (the block that crosses, plus the blocks each reshard touches) wins.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from autopar._src import cost

WIRE_AXES = ("wire", "copies")
"""Axis names of the flat layouts a transfer may use."""


@dataclasses.dataclass(frozen=True, eq=False)
class Route:
    """How one array goes from ``src`` to ``dst``."""

    src: NamedSharding
    """Layout on the source mesh."""
    send: NamedSharding
    """Layout on the source mesh that is copied (``src`` when no reshard is needed first)."""
    recv: NamedSharding
    """Layout it arrives in on the destination mesh, block for block the same as ``send``."""
    dst: NamedSharding
    """Layout wanted on the destination mesh (``recv`` when no reshard is needed after)."""
    cost: float
    """Bytes moved per device: the block that crosses plus the blocks the reshards touch."""

    @property
    def reshard_before(self) -> bool:
        """Whether the source reshards before the copy."""
        return not _same_layout(self.src, self.send)

    @property
    def reshard_after(self) -> bool:
        """Whether the destination reshards after the copy."""
        return not _same_layout(self.recv, self.dst)


def blocks(sharding: NamedSharding, shape: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    """The block of an array of ``shape`` on each device of the mesh, in mesh order."""
    index_map = sharding.devices_indices_map(shape)
    return [
        tuple(s.indices(n)[:2] for s, n in zip(index_map[d], shape, strict=True))
        for d in sharding.mesh.devices.flat
    ]


def same_blocks(a: NamedSharding, b: NamedSharding, shape: tuple[int, ...]) -> bool:
    """Whether ``a`` and ``b`` put the same block on the k-th device of their meshes, for every k."""
    return blocks(a, shape) == blocks(b, shape)


def _same_layout(a: NamedSharding, b: NamedSharding) -> bool:
    return a is b or (a.mesh == b.mesh and a.spec == b.spec)


def _block_bytes(sharding: NamedSharding, shape: tuple[int, ...], itemsize: int) -> float:
    return float(math.prod(sharding.shard_shape(shape))) * itemsize


def _flat(mesh: Mesh | AbstractMesh, pieces: int, dim: int | None, rank: int) -> NamedSharding:
    assert isinstance(mesh, Mesh), "routes are planned between concrete meshes"
    grid = mesh.devices.reshape(pieces, -1)
    spec: list[str | None] = [None] * rank
    if dim is not None:
        spec[dim] = WIRE_AXES[0]
    return NamedSharding(Mesh(grid, WIRE_AXES), PartitionSpec(*spec))


def plan_route(src: NamedSharding, dst: NamedSharding, shape: tuple[int, ...], itemsize: int) -> Route:
    """The cheapest route for an array of ``shape`` from ``src`` to ``dst`` (see the module doc)."""
    n_src, n_dst = src.mesh.devices.size, dst.mesh.devices.size
    candidates: list[tuple[NamedSharding, NamedSharding]] = []
    if n_src == n_dst and same_blocks(src, dst, shape):
        candidates.append((src, dst))
    if dict(src.mesh.shape) == dict(dst.mesh.shape) and list(src.mesh.shape) == list(dst.mesh.shape):
        candidates.append((NamedSharding(src.mesh, dst.spec), dst))
        candidates.append((src, NamedSharding(dst.mesh, src.spec)))
    common = math.gcd(n_src, n_dst)
    for pieces in sorted({p for p in range(1, common + 1) if common % p == 0}, reverse=True):
        dims = [d for d in range(len(shape)) if shape[d] % pieces == 0 and shape[d] >= pieces]
        if pieces == 1:
            candidates.append((_flat(src.mesh, 1, None, len(shape)), _flat(dst.mesh, 1, None, len(shape))))
        elif dims:
            d = max(dims, key=lambda k: shape[k])
            candidates.append(
                (_flat(src.mesh, pieces, d, len(shape)), _flat(dst.mesh, pieces, d, len(shape)))
            )
            break

    def cost(send: NamedSharding, recv: NamedSharding) -> float:
        total = _block_bytes(send, shape, itemsize)
        if not _same_layout(src, send):
            total += max(_block_bytes(src, shape, itemsize), _block_bytes(send, shape, itemsize))
        if not _same_layout(recv, dst):
            total += max(_block_bytes(recv, shape, itemsize), _block_bytes(dst, shape, itemsize))
        return total

    send, recv = min(candidates, key=lambda c: cost(*c))
    return Route(src=src, send=send, recv=recv, dst=dst, cost=cost(send, recv))


class Resharder:
    """Cached identity ``jit``\\ s that lay an array out anew on the mesh it lives on."""

    def __init__(self) -> None:
        self._fns: dict[tuple[Any, ...], Callable[[Any], Any]] = {}

    def __call__(self, x: Any, target: NamedSharding) -> Any:
        key = (target, tuple(x.shape), str(x.dtype))
        if key not in self._fns:
            self._fns[key] = jax.jit(lambda a: a, out_shardings=target)
        out = self._fns[key](x)
        if target.mesh.devices.flat[0].platform == "cpu":
            # XLA's CPU collectives (jaxlib 0.10) can wait forever when relayouts (all-gathers)
            # dispatched one behind another run in different orders on different devices: the
            # process aborts after 40 s. Each finishes before the next is dispatched.
            out.block_until_ready()
        return out

    def move(self, x: Any, route: Route) -> Any:
        """Sends ``x`` (laid out as ``route.src``) along ``route``; asynchronous like ``device_put``."""
        if route.reshard_before:
            x = self(x, route.send)
        x = copy_blocks(x, route.recv)
        return self(x, route.dst) if route.reshard_after else x


def copy_blocks(x: jax.Array, recv: NamedSharding) -> jax.Array:
    """``x`` copied onto ``recv``'s devices, every block from a device that holds it.

    With one process this is ``jax.device_put``. With several (``jax.distributed``), JAX moves
    whole arrays only between device sets of different processes with the same layout, so
    every process runs the same copies block by block: a block whose source and destination
    devices are both its own is copied device to device, one that crosses processes is sent
    with JAX's cross-host transfer (every process takes part in each, in the same order), and
    each process assembles the blocks its devices received.
    """
    if jax.process_count() == 1:
        return jax.device_put(x, recv)
    shape = tuple(x.shape)
    held: dict[tuple[tuple[int, int], ...], list[Any]] = {}
    for device, index in x.sharding.devices_indices_map(shape).items():
        held.setdefault(_block_key(index, shape), []).append(device)
    mine = jax.process_index()
    local = {shard.device: shard.data for shard in x.addressable_shards}
    received = []
    wanted = recv.devices_indices_map(shape)
    for device in recv.mesh.devices.flat:
        index = wanted[device]
        sources = held[_block_key(index, shape)]
        # A source on the destination's own process needs no cross-host transfer.
        src = next((d for d in sources if d.process_index == device.process_index), sources[0])
        if src.process_index == device.process_index:
            if device.process_index == mine:
                received.append(jax.device_put(local[src], device))
            continue
        block = local[src] if src.process_index == mine else _remote(x, src, index)
        moved = jax.device_put(block, jax.sharding.make_single_device_sharding(device))
        if device.process_index == mine:
            # Wait for the block: computations queued on what has not arrived yet fill XLA's
            # queue of computations in flight, and the process could then wait for ever to
            # dispatch the work the other process waits for. What this process dispatched
            # before runs meanwhile.
            received.append(moved.block_until_ready())
    return jax.make_array_from_single_device_arrays(shape, recv, received, dtype=x.dtype)


def put(values: list[Any], shardings: list[NamedSharding]) -> list[Any]:
    """``jax.device_put(values, shardings)``. With several processes JAX puts an array that this
    process holds on its own devices (one the caller made, like a NumPy array given to every
    process) only onto devices of this process, so such an array goes through host memory."""
    if jax.process_count() == 1:
        return jax.device_put(values, shardings)
    out = []
    for x, target in zip(values, shardings, strict=True):
        if isinstance(x, jax.Array) and x.is_fully_addressable and not target.is_fully_addressable:
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                data = jax.device_put(np.asarray(jax.random.key_data(x)), target)
                out.append(jax.random.wrap_key_data(data, impl=jax.random.key_impl(x)))
                continue
            x = np.asarray(x)
        out.append(jax.device_put(x, target))
    return out


def _block_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _remote(x: jax.Array, device: Any, index: tuple[slice, ...]) -> jax.Array:
    """A stand-in for the block of ``x`` that another process holds on ``device``."""
    block = tuple(len(range(*s.indices(n))) for s, n in zip(index, x.shape, strict=True))
    return jax.make_array_from_single_device_arrays(
        block, jax.sharding.make_single_device_sharding(device), [], dtype=x.dtype
    )


def place(x: Any, target: NamedSharding, resharder: Resharder) -> Any:
    """``x`` laid out as ``target``: resharded on its devices, routed between meshes, or put from host."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(x, jax.Array) or not isinstance(sharding, NamedSharding):
        return jax.device_put(x, target)
    if sharding == target:
        return x
    if sharding.mesh.devices.size == target.mesh.devices.size and list(sharding.mesh.devices.flat) == list(
        target.mesh.devices.flat
    ):
        return resharder(x, target)
    return resharder.move(x, plan_route(sharding, target, tuple(x.shape), cost.itemsize(x.dtype)))
