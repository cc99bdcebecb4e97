"""Stage costs priced by the sharding ILP, for autopar and for Megatron-style grids alike.

For one microbatch count ``b`` the step is traced at one microbatch (``batch / b`` rows), cut
into layers and profiled. Each layer is then priced on every logical mesh twice by
:func:`autopar._src.layer_sharding.layer_latency`:

- **Megatron**: the parameters and optimizer state pinned to Megatron-LM's layouts
  (:func:`autopar.megatron_rules`, the model axis) and the batch to the data axis; the ILP
  lays out the rest around them, as XLA's propagation does for a pjit program;
- **autopar**: every layout free, but each layer's inputs may take no more bytes per device
  than under Megatron's layouts (so the stage DP's memory model, which divides the state by
  the tensor-parallel degree, holds for both).

Gradients are accumulated over the microbatches and reduced once per step on both sides, with
every collective that finishes a gradient paid once (``gradients="megatron"``, Megatron-LM's
accounting; autopar's driver defers only the all-reduces of partial sums, see
``autopar._src.deferred``). The
stage DP then plans autopar on the first costs and the grids are read off the second; the
memory arrays are the same analytic ones.

Only power-of-two submeshes and tensor-parallel degrees up to one host are priced: the grids
use no others, and each mesh costs seconds of HiGHS time per distinct layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def megatron_layouts(state: Any, batch: Any) -> dict[int, tuple[Any, ...]]:
    """Step argument index -> Megatron layout (over ``("data", "model")``) of every leaf."""
    import jax
    from jax.sharding import PartitionSpec

    from autopar import megatron_rules, rule_specs

    specs = rule_specs(megatron_rules(), (state, batch))
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return {i: tuple(s) for i, s in enumerate(leaves)}


def priced_meshes(submeshes, logical, devices_per_host: int) -> list[tuple[int, int]]:
    """``(submesh, logical)`` indices this comparison prices."""
    return [
        (k, q)
        for k, (hosts, devices) in enumerate(submeshes)
        if (hosts * devices) & (hosts * devices - 1) == 0
        for q, (_, tp) in enumerate(logical[k])
        if tp <= devices_per_host
    ]


def trace_microbatch(
    step, state, batch, *, batch_size: int, num_microbatches: int, num_layers=None, rescaled: bool = False
):
    """``(traced step, layer profile)`` of one microbatch (``batch_size / num_microbatches`` rows),
    cut into ``num_layers`` layers (None: as many as the first automatic clustering chooses).
    With ``rescaled`` (costs scaled to other microbatch sizes) the profile also has its fixed
    traffic, from a second trace (:func:`autopar._src.planning.step_profile`)."""
    import jax

    from autopar._src import planning, profile, trace

    num_state = len(jax.tree.leaves(state))
    batch_ids = tuple(range(num_state, num_state + len(jax.tree.leaves(batch))))
    rows = batch_size // num_microbatches
    traced = planning.trace_at(
        step, (state, batch), batch_ids, rows, trace.TraceOptions(num_layers=num_layers)
    )
    if rescaled:
        return traced, planning.step_profile(step, (state, batch), batch_ids, rows, traced)
    return traced, profile.layer_profile(traced, batch_ids)


def step_bound(traced, spec, *, num_microbatches: int, dtype: str) -> float:
    """A lower bound on the step seconds of any plan on ``spec``'s devices under the ILP's costs.

    Every layout of an equation on ``n`` devices costs at least ``1 / n`` of its cost on one
    device (compute is divided by at most the devices sharing it, memory-bound work by at most
    the devices its output is split over), and a pipeline's step takes at least its
    microbatches times its slowest stage's latency, which is at least the sum of the stages'
    work over the devices. So no plan is faster than one device's forward and backward of the
    whole step times ``num_microbatches / N``: perfect scaling with free communication.
    """
    return float(one_device(traced, spec, num_microbatches=num_microbatches, dtype=dtype).sum()) * (
        num_microbatches / spec.num_devices
    )


def one_device(traced, spec, *, num_microbatches: int, dtype: str) -> np.ndarray:
    """Each layer's seconds of one microbatch's forward and backward on one device (the ILP on a
    1x1 mesh)."""
    from autopar._src import layer_sharding

    return layer_sharding.layer_latency(
        traced, spec, [(1, 1)], [[(1, 1)]], dtype=dtype, microbatches=num_microbatches, gradients="megatron"
    )[:, 0, 0]


def ilp_costs(
    step, state, batch, spec, *, batch_size: int, num_microbatches: int, dtype: str, num_layers=None
):
    """``(autopar costs, Megatron costs, layer profile, traced step)`` of one microbatch count.

    ``state`` and ``batch`` are abstract; the batch is cut to ``batch_size / num_microbatches``.
    """
    from autopar._src import cluster, layer_sharding, planner

    traced, prof = trace_microbatch(
        step, state, batch, batch_size=batch_size, num_microbatches=num_microbatches, num_layers=num_layers
    )
    layouts = megatron_layouts(state, batch)
    submeshes = cluster.submesh_shapes(spec)
    logical = [cluster.logical_shapes(m) for m in submeshes]
    q_max = max(len(q) for q in logical)
    free = np.full((prof.num_layers, len(submeshes), q_max), np.inf)
    pinned = free.copy()
    for k, q in priced_meshes(submeshes, logical, spec.devices_per_host):
        where = ([submeshes[k]], [[logical[k][q]]])
        common = dict(dtype=dtype, microbatches=num_microbatches, gradients="megatron")
        pinned[:, k, q] = layer_sharding.layer_latency(traced, spec, *where, fixed=layouts, **common)[:, 0, 0]
        free[:, k, q] = layer_sharding.layer_latency(traced, spec, *where, memory_like=layouts, **common)[
            :, 0, 0
        ]
    costs = [
        planner.stage_costs(prof, spec, num_microbatches=num_microbatches, sharded=s) for s in (free, pinned)
    ]
    return costs[0], costs[1], prof, traced
