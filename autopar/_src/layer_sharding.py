"""The sharding ILP's seconds for each layer on each logical mesh: the stage DP's costs.

For every layer of the grad region (its forward and backward equations, one microbatch) and
every logical mesh ``(dp, tp)`` of every submesh the stage DP considers, the per-stage ILP
of :mod:`autopar._src.intra_op` is solved and its objective (compute, collectives and
resharding, in seconds) becomes the layer's latency there. A stage's latency is the sum over
its layers. Layers with the same equations on the same shapes (the blocks of a transformer)
share one solve, and solves are cached for the process, keyed by that structure and the mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from autopar._src import cluster as cluster_mod
from autopar._src import compat, layers, partition
from autopar._src.intra_op import logical_mesh
from autopar._src.layout_costs import MeshSpec
from autopar._src.sharding_ilp import solve_merged
from autopar._src.strategy_graph import GraphOp, graph_of
from autopar._src.trace import TracedStep

AXES = ("data", "model")
LAYER_TIME_LIMIT = 10.0
"""Seconds HiGHS may spend on one layer's problem."""

_CACHE: dict[tuple[Any, ...], float] = {}


def layer_ops(step: TracedStep) -> list[list[GraphOp]]:
    """Per layer, its forward and backward equations as graph ops (boundary markers are identities)."""
    _, info, where = partition.layer_placement(step)
    rj = info.jaxpr
    alias: dict[Any, Any] = {}

    def name(v: Any) -> Any:
        if compat.is_literal(v) or compat.is_dropvar(v):
            return None
        while v in alias:
            v = alias[v]
        return v

    result: list[list[GraphOp]] = [[] for _ in range(len(info.cuts) + 1)]
    for eqn, (layer, _) in zip(rj.eqns, where, strict=True):
        if layers.is_boundary(eqn):
            for a, v in zip(eqn.invars, eqn.outvars, strict=True):
                if name(a) is not None and not compat.is_dropvar(v):
                    alias[v] = name(a)
            continue
        result[layer].append(GraphOp(eqn, tuple(map(name, eqn.invars)), tuple(map(name, eqn.outvars))))
    return result


def _signature(ops: Sequence[GraphOp]) -> tuple[Any, ...]:
    """The structure of a layer: its equations' primitives, params and avals, and how they connect."""
    index: dict[Any, int] = {}

    def ref(n: Any) -> Any:
        return None if n is None else index.setdefault(n, len(index))

    return tuple(
        (
            op.eqn.primitive.name,
            str(sorted((k, str(v)) for k, v in op.eqn.params.items() if not compat.sub_jaxprs(op.eqn))),
            tuple(str(v.aval) for v in op.eqn.invars),
            tuple(str(v.aval) for v in op.eqn.outvars),
            tuple(ref(n) for n in op.ins),
            tuple(ref(n) for n in op.outs),
        )
        for op in ops
    )


def _objective(ops: Sequence[GraphOp], mesh: MeshSpec, time_limit: float) -> float:
    nodes, edges, _ = graph_of(ops, mesh)
    return solve_merged(nodes, edges, time_limit=time_limit)[0].objective


def layer_latency(
    step: TracedStep,
    spec: cluster_mod.ClusterSpec,
    submeshes: Sequence[tuple[int, int]],
    logical: Sequence[Sequence[tuple[int, int]]],
    *,
    dtype: str = "float32",
    time_limit: float = LAYER_TIME_LIMIT,
    platform: str = "",
) -> np.ndarray:
    """Seconds of one microbatch's forward and backward of each layer, ``[layer, submesh, logical]``.

    Entries for logical meshes a submesh does not have are ``inf``.
    """
    per_layer = layer_ops(step)
    signatures = [_signature(ops) for ops in per_layer]
    q_max = max(len(q) for q in logical)
    result = np.full((len(per_layer), len(submeshes), q_max), np.inf)
    for k, shapes in enumerate(logical):
        for q, shape in enumerate(shapes):
            mesh = logical_mesh(spec, tuple(shape), AXES, dtype, platform=platform)
            for i, ops in enumerate(per_layer):
                key = (signatures[i], mesh)
                if key not in _CACHE:
                    _CACHE[key] = _objective(ops, mesh, time_limit)
                result[i, k, q] = _CACHE[key]
    return result
