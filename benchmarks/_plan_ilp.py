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

Gradients are accumulated over the microbatches and reduced once per step on both sides. The
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


def ilp_costs(step, state, batch, spec, *, batch_size: int, num_microbatches: int, dtype: str):
    """``(autopar costs, Megatron costs, layer profile)`` of one microbatch count.

    ``state`` and ``batch`` are abstract; the batch is cut to ``batch_size / num_microbatches``.
    """
    import jax

    from autopar._src import cluster, layer_sharding, planner, planning, profile, trace

    rows = batch_size // num_microbatches
    num_state = len(jax.tree.leaves(state))
    batch_ids = tuple(range(num_state, num_state + len(jax.tree.leaves(batch))))
    traced = planning.trace_at(step, (state, batch), batch_ids, rows, trace.TraceOptions(num_layers=None))
    prof = profile.layer_profile(traced, batch_ids)
    layouts = megatron_layouts(state, batch)
    submeshes = cluster.submesh_shapes(spec)
    logical = [cluster.logical_shapes(m) for m in submeshes]
    q_max = max(len(q) for q in logical)
    free = np.full((prof.num_layers, len(submeshes), q_max), np.inf)
    pinned = free.copy()
    for k, q in priced_meshes(submeshes, logical, spec.devices_per_host):
        where = ([submeshes[k]], [[logical[k][q]]])
        common = dict(dtype=dtype, microbatches=num_microbatches)
        pinned[:, k, q] = layer_sharding.layer_latency(traced, spec, *where, fixed=layouts, **common)[:, 0, 0]
        free[:, k, q] = layer_sharding.layer_latency(traced, spec, *where, memory_like=layouts, **common)[
            :, 0, 0
        ]
    costs = [
        planner.stage_costs(prof, spec, num_microbatches=num_microbatches, sharded=s) for s in (free, pinned)
    ]
    return costs[0], costs[1], prof
