"""What each forward layer costs, read off the traced step (no devices, no compile).

From the differentiated, marked loss: FLOPs of each layer's forward and backward, the
bytes its memory-bound equations move, bytes of the parameters it owns, bytes of the
activations its forward keeps for its backward (per microbatch), and bytes crossing the
boundary after it. From the whole step: how many bytes of state (optimizer moments, ...)
come with each byte of parameters, and the FLOPs of the code before the loss function that runs
per microbatch in a layer's forward (a frozen teacher's forward on the batch).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from autopar._src import compat, cost, expansion, fusion, layers, partition
from autopar._src.strategy_graph import GraphOp
from autopar._src.trace import TracedStep


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """Per-layer costs of one microbatch (arrays of length ``num_layers``)."""

    forward_flops: np.ndarray
    """FLOPs of heavy operations in each layer's forward."""
    backward_flops: np.ndarray
    """FLOPs of heavy operations in each layer's backward."""
    param_bytes: np.ndarray
    """Bytes of the parameters each layer reads first."""
    stash_bytes: np.ndarray
    """Bytes each layer's forward keeps for its backward, of values split over the batch."""
    stash_replicated_bytes: np.ndarray
    """Bytes each layer's forward keeps for its backward, of values not split over the batch."""
    boundary_bytes: np.ndarray
    """Bytes live across the cut after each layer (0 after the last)."""
    num_ops: np.ndarray
    """Equations in each layer's forward."""
    state_per_param: float
    """Bytes of other state (optimizer moments, ...) per byte of parameters."""
    dtype: str
    """Dtype most heavy FLOPs compute in (selects the device's peak FLOP/s)."""
    backward_peak_bytes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    """Largest value each layer's backward makes (per microbatch) if split over the batch."""
    backward_peak_replicated_bytes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    """Largest value each layer's backward makes (per microbatch) that is not split."""
    batch_bytes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    """Bytes of batch inputs each layer reads first, per microbatch."""
    param_layer: dict[Any, int] = dataclasses.field(default_factory=dict)
    """For each step input var that is a differentiated parameter: the layer that reads it first."""
    forward_traffic: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    """Bytes each layer's forward moves through device memory outside its heavy operations
    (:func:`autopar._src.fusion.op_traffic`, each layer's pass a task); empty: priced as none."""
    backward_traffic: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    """The same for each layer's backward."""
    fixed_traffic: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    """The part of each layer's forward plus backward traffic that does not grow with the
    microbatch (weight-sized values: casts of the weights, their gradients), read off a second
    trace at twice the rows (:func:`fixed_traffic`); it is moved again for every microbatch
    and by every data-parallel device. Empty: all traffic grows with the microbatch."""
    kernels: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    """Kernels each layer's forward plus backward launches per microbatch
    (:func:`autopar._src.fusion.op_kernels`), each priced at the device's
    :attr:`~autopar._src.cluster.DeviceSpec.kernel_time`. Empty: none."""

    before_flops: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    """FLOPs of the code before the grad region that each layer's forward task runs per
    microbatch (a frozen teacher's or encoder's forward on the batch, run in the forward of the
    first layer that reads what it makes); counted in :attr:`forward_flops` too. Empty: none."""
    shared_params: tuple[tuple[float, tuple[int, ...]], ...] = ()
    """Parameters the forwards of several layers read (a tied weight): their bytes and those
    layers, in order. :attr:`param_bytes` counts each on the first."""

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.forward_flops)

    @functools.cached_property
    def borrowed_bytes(self) -> np.ndarray:
        """``[i, j]``: bytes of the parameters that layers i..j read and an earlier layer reads
        first. A stage holding those layers keeps a copy of each and the running sum of its part
        of the gradient (:func:`autopar._src.region_outputs.split_sums`)."""
        n = self.num_layers
        first, last = np.arange(n)[:, None], np.arange(n)[None, :]
        out = np.zeros((n, n))
        for size, readers in self.shared_params:
            reads = np.zeros((n, n), dtype=bool)
            for r in readers[1:]:
                reads |= (first <= r) & (r <= last)
            out += size * (reads & (readers[0] < first))
        return out


def compute_dtype(flops_by_dtype: Mapping[str, float]) -> str:
    """The dtype most heavy FLOPs compute in (a complex one's parts), which selects the device's
    peak FLOP/s; float32 where there are none. Threefry's rounds of random bits (``uint32``, a
    dropout mask's) run on the vector units at no matmul peak, so they select nothing."""
    found: dict[str, float] = {}
    for dtype, flops in flops_by_dtype.items():
        if dtype == cost.RANDOM_BITS_DTYPE:
            continue
        kind = np.dtype(dtype)
        if np.issubdtype(kind, np.complexfloating):
            dtype = np.finfo(kind).dtype.name
        found[dtype] = found.get(dtype, 0.0) + flops
    return max(found, key=found.__getitem__) if found else "float32"


def layer_profile(
    step: TracedStep, batch_leaf_ids: tuple[int, ...], *, doubled: TracedStep | None = None
) -> LayerProfile:
    """Profiles the layers of a traced step's grad region.

    ``doubled``: the same step traced with twice the rows and the same layer cuts (see
    :func:`autopar._src.planning.step_profile`); it gives :attr:`LayerProfile.fixed_traffic`.

    Raises:
      ValueError: if the step has no grad region.
    """
    at, info, where = partition.layer_placement(step)
    rj = info.jaxpr
    num_layers = len(info.cuts) + 1
    fwd = np.zeros(num_layers)
    bwd = np.zeros(num_layers)
    ops = np.zeros(num_layers, dtype=np.int64)
    boundary = np.zeros(num_layers)
    made: dict[Any, int] = {}
    stash_vars: dict[tuple[Any, int], int] = {}
    first_reader: dict[Any, int] = {}
    readers: dict[Any, set[int]] = {}
    diff = set(rj.invars[len(rj.invars) - info.num_grads :])
    flops_by_dtype: dict[str, float] = {}
    rows = step.arg_vars[batch_leaf_ids[0]].aval.shape[0] if batch_leaf_ids else 0
    backward_peak = np.zeros(num_layers)
    backward_peak_rep = np.zeros(num_layers)
    traffic = {"F": np.zeros(num_layers), "B": np.zeros(num_layers)}
    graph_ops = expansion.region_ops(rj, where, num_layers)[0]
    moved_by_op = fusion.op_traffic(graph_ops)
    kernels = np.zeros(num_layers)
    for op, moved, launched in zip(graph_ops, moved_by_op, fusion.op_kernels(graph_ops), strict=True):
        traffic[op.task[1]][op.task[0]] += moved
        kernels[op.task[0]] += launched
    fixed = fixed_traffic(graph_ops, moved_by_op, doubled, num_layers) if doubled is not None else np.zeros(0)
    for eqn, (layer, pass_) in zip(rj.eqns, where, strict=True):
        if pass_ == "B":
            for v in eqn.outvars:
                if compat.is_dropvar(v):
                    continue
                if cost.splits_over_batch(v.aval, rows):
                    backward_peak[layer] = max(backward_peak[layer], cost.aval_bytes(v.aval))
                else:
                    backward_peak_rep[layer] = max(backward_peak_rep[layer], cost.aval_bytes(v.aval))
        by_dtype = cost.eqn_flops_by_dtype(eqn)
        for dtype, x in by_dtype.items():
            flops_by_dtype[dtype] = flops_by_dtype.get(dtype, 0.0) + x
        f = float(sum(by_dtype.values()))
        if pass_ == "F":
            fwd[layer] += f
            ops[layer] += 1
            if layers.is_boundary(eqn) and eqn.params["index"] < num_layers - 1:
                boundary[layer] += sum(cost.aval_bytes(v.aval) for v in eqn.outvars)
            for v in eqn.outvars:
                if not compat.is_dropvar(v):
                    made[v] = layer
        else:
            bwd[layer] += f
        for a in eqn.invars:
            if compat.is_literal(a):
                continue
            if a in diff and pass_ == "F":
                first_reader.setdefault(a, layer)
                readers.setdefault(a, set()).add(layer)
            # A backward reads what its own forward made, and activations received
            # from earlier layers (e.g. a stage's input, kept for the weight gradient):
            # both stay alive on the reading layer's stage until its backward.
            if pass_ == "B" and a in made and made[a] <= layer:
                stash_vars[(a, layer)] = layer
    params = np.zeros(num_layers)
    for v, layer in first_reader.items():
        params[layer] += cost.aval_bytes(v.aval)
    outer = dict(zip([*rj.constvars, *rj.invars], step.jaxpr.eqns[at].invars, strict=True))
    batch_vars = {step.arg_vars[i] for i in batch_leaf_ids}
    batch_layer: dict[Any, int] = {}
    for eqn, (layer, _) in zip(rj.eqns, where, strict=True):
        for a in eqn.invars:
            if (
                not compat.is_literal(a)
                and a in outer
                and not compat.is_literal(outer[a])
                and outer[a] in batch_vars
            ):
                batch_layer.setdefault(a, layer)
    batch_bytes = np.zeros(num_layers)
    for v, layer in batch_layer.items():
        batch_bytes[layer] += cost.aval_bytes(v.aval)
    param_layer = {outer[v]: layer for v, layer in first_reader.items() if not compat.is_literal(outer[v])}
    stash = np.zeros(num_layers)
    stash_rep = np.zeros(num_layers)
    for (v, _), layer in stash_vars.items():
        if cost.splits_over_batch(v.aval, rows):
            stash[layer] += cost.aval_bytes(v.aval)
        else:
            stash_rep[layer] += cost.aval_bytes(v.aval)
    before = _before_region_flops(step, at, outer, batch_vars, rj.eqns, where, num_layers)
    fwd += before
    state = sum(cost.aval_bytes(v.aval) for v in step.arg_vars if v not in batch_vars)
    total_params = float(params.sum())
    ratio = max(state / total_params - 1.0, 0.0) if total_params else 0.0
    return LayerProfile(
        forward_flops=fwd,
        backward_flops=bwd,
        param_bytes=params,
        shared_params=tuple(
            (float(cost.aval_bytes(v.aval)), tuple(sorted(layers_)))
            for v, layers_ in readers.items()
            if len(layers_) > 1
        ),
        stash_bytes=stash,
        stash_replicated_bytes=stash_rep,
        boundary_bytes=boundary,
        num_ops=ops,
        state_per_param=ratio,
        dtype=compute_dtype(flops_by_dtype),
        backward_peak_bytes=backward_peak,
        backward_peak_replicated_bytes=backward_peak_rep,
        batch_bytes=batch_bytes,
        param_layer=param_layer,
        forward_traffic=traffic["F"],
        backward_traffic=traffic["B"],
        fixed_traffic=fixed,
        kernels=kernels,
        before_flops=before,
    )


def _before_region_flops(
    step: TracedStep,
    at: int,
    outer: Mapping[Any, Any],
    batch_vars: set[Any],
    region_eqns: Sequence[Any],
    where: Sequence[tuple[int, str]],
    num_layers: int,
) -> np.ndarray:
    """Per layer, the FLOPs of the step's equations before its grad region (at ``at``) that read
    the batch, and so run per microbatch, in the forward task of the first layer that reads what
    they make, as :func:`~autopar._src.partition.build_program` places them (``outer``: the
    region's inner vars to the step's)."""
    first: dict[Any, int] = {}  # step var -> the first layer reading it
    for eqn, (layer, pass_) in zip(region_eqns, where, strict=True):
        for a in eqn.invars:
            if pass_ == "F" and not compat.is_literal(a) and a in outer and not compat.is_literal(outer[a]):
                first[outer[a]] = min(first.get(outer[a], layer), layer)
    eqns = step.jaxpr.eqns[:at]
    per_mb = set(batch_vars)
    for e in eqns:
        if any(not compat.is_literal(a) and a in per_mb for a in e.invars):
            per_mb.update(e.outvars)
    flops = np.zeros(num_layers)
    for e in reversed(eqns):
        readers = [first[v] for v in e.outvars if not compat.is_dropvar(v) and v in first]
        if not readers:
            continue  # made for the step's outputs alone, or once per step for the update
        layer = min(readers)
        for a in e.invars:
            if not compat.is_literal(a):
                first[a] = min(first.get(a, layer), layer)
        if any(v in per_mb for v in e.outvars):
            flops[layer] += cost.eqn_flops(e)
    return flops


def fixed_traffic(
    graph_ops: list[GraphOp], moved: list[float], doubled: TracedStep, num_layers: int
) -> np.ndarray:
    """Per layer, the bytes of traffic that stay when the microbatch shrinks.

    Each op's traffic is ``fixed + rows * per_row``; with ``moved`` at ``rows`` and the same op's
    at ``2 * rows`` in ``doubled``, ``fixed = 2 * moved - moved_doubled``. Where the two traces
    differ in their ops (a step whose program depends on the batch size), nothing is known:
    all zeros, every byte taken to grow with the microbatch.
    """
    fixed = np.zeros(num_layers)
    _, info, where = partition.layer_placement(doubled)
    if len(info.cuts) + 1 != num_layers:
        return fixed
    ops2 = expansion.region_ops(info.jaxpr, where, num_layers)[0]
    if [(o.eqn.primitive.name, o.task) for o in ops2] != [(o.eqn.primitive.name, o.task) for o in graph_ops]:
        return fixed
    for op, m1, m2 in zip(graph_ops, moved, fusion.op_traffic(ops2), strict=True):
        fixed[op.task[0]] += min(max(2 * m1 - m2, 0.0), m1)
    return fixed
