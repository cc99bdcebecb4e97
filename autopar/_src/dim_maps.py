"""Strategies of the equations that move, add or drop dims (reshape, transpose, broadcast,
slices, cumulative ops): a split of the operand survives where its dim maps to an output dim;
and of those that join, part or order values along one dim (concatenate, stack, split, sort,
top-k): a split survives on every other dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autopar._src.collectives import Axes, Spec
from autopar._src.layout_costs import (
    MeshSpec,
    broadcast_spec,
    candidate_specs,
    collective_cost,
    divides,
    priced_strategy,
    replicated_strategies,
    shape_of,
    share_bytes,
    spec_name,
    split_axes,
)
from autopar._src.sharding_ilp import Strategy

DIM_MAP_PRIMITIVES: frozenset[str] = frozenset(
    "reshape transpose broadcast_in_dim squeeze rev slice pad dynamic_slice "
    "dynamic_update_slice cumsum cumprod cummax cummin cumlogsumexp fft".split()
)
"""Primitives that move, add or drop dims, or work along some dims and leave the others alone
(``rev``, the cumulative ones, ``fft``); a split survives where a dim maps through."""


def _reshape_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> dict[int, int]:
    """Input dim -> output dim for the major non-trivial dim of each group of merged/split dims.

    Splitting the major dim of a group in blocks is the same as splitting the merged dim in blocks.
    """
    mapping: dict[int, int] = {}
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj = [i], [j]
        pi = in_shape[i] if i < len(in_shape) else 1
        pj = out_shape[j] if j < len(out_shape) else 1
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(in_shape):
                pi, i = pi * in_shape[i], i + 1
                gi.append(i - 1)
            elif j < len(out_shape):
                pj, j = pj * out_shape[j], j + 1
                gj.append(j - 1)
            else:
                return mapping
        majors_in = [d for d in gi if d < len(in_shape) and in_shape[d] > 1]
        majors_out = [d for d in gj if d < len(out_shape) and out_shape[d] > 1]
        if majors_in and majors_out:
            mapping[majors_in[0]] = majors_out[0]
    return mapping


def _dim_map(eqn: Any) -> tuple[dict[int, int], frozenset[int]] | None:
    """(input dim -> output dim where a split carries over, output dims free to split), or None."""
    name, p = eqn.primitive.name, eqn.params
    in_shape, out_shape = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    same = range(len(in_shape))
    if name == "transpose":
        return {d: j for j, d in enumerate(p["permutation"])}, frozenset()
    if name == "reshape":
        return None if p.get("dimensions") is not None else (_reshape_map(in_shape, out_shape), frozenset())
    if name == "squeeze":
        dims = {d % len(in_shape) for d in p["dimensions"]}
        return {d: j for j, d in enumerate(x for x in same if x not in dims)}, frozenset()
    if name == "broadcast_in_dim":
        bd = p["broadcast_dimensions"]
        mapping = {i: j for i, j in enumerate(bd) if in_shape[i] == out_shape[j]}
        return mapping, frozenset(range(len(out_shape))) - frozenset(mapping.values())
    if name in ("rev",):
        return {d: d for d in same if d not in p["dimensions"]}, frozenset()
    if name == "fft":  # over the trailing dims it transforms
        return {d: d for d in same if d < len(in_shape) - len(p["fft_lengths"])}, frozenset()
    if name.startswith("cum"):
        return {d: d for d in same if d != p["axis"] % len(in_shape)}, frozenset()
    if name in ("slice", "dynamic_slice", "dynamic_update_slice", "pad"):
        if name == "pad":
            keep = [tuple(c) == (0, 0, 0) for c in p["padding_config"]]
        else:  # dims the slice or update covers whole
            other = out_shape if name != "dynamic_update_slice" else shape_of(eqn.invars[1])
            keep = [in_shape[d] == other[d] for d in same]
        return {d: d for d in same if keep[d]}, frozenset()
    return None


def dim_map_strategies(eqn: Any, mesh: MeshSpec) -> tuple[Strategy, ...]:
    """Strategies of an equation of :data:`DIM_MAP_PRIMITIVES`: each split of its operand
    carried to the output dim it maps to (and back), else the dim wanted whole; a ``dynamic_slice``
    lookup of rows of a row-split table also gets a masked slice and an all-reduce."""
    mapped = _dim_map(eqn)
    if mapped is None:
        return replicated_strategies(eqn, mesh)
    forward, free = mapped
    backward = {j: i for i, j in forward.items()}
    in_shape, out_shape = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    pairs: dict[Spec, Spec] = {}
    for spec in candidate_specs(in_shape, mesh):
        out: list[Axes] = [None] * len(out_shape)
        kept = list(spec)
        for d, a in enumerate(spec):
            if a is not None and d in forward and divides(out_shape, forward[d], a, mesh):
                out[forward[d]] = a
            else:
                kept[d] = None  # the split cannot be mapped: this strategy wants that dim whole
        pairs.setdefault(tuple(out), tuple(kept))
    for spec in candidate_specs(out_shape, mesh):
        ins: list[Axes] = [None] * len(in_shape)
        out = list(spec)
        for j, a in enumerate(spec):
            if a is not None and j in backward and divides(in_shape, backward[j], a, mesh):
                ins[backward[j]] = a
            elif j not in free:
                out[j] = None
        pairs.setdefault(tuple(out), tuple(ins))
    result = []
    for out_spec, in_spec in pairs.items():
        others = [broadcast_spec(in_spec, in_shape, shape_of(v)) for v in eqn.invars[1:]]
        result.append(priced_strategy(spec_name(out_spec), eqn, mesh, [in_spec, *others], [out_spec]))
    axes, sliced = split_axes(mesh), [d for d in range(len(in_shape)) if d not in forward]
    if (
        eqn.primitive.name == "dynamic_slice"
        and axes
        and sliced
        and divides(in_shape, sliced[0], axes[-1], mesh)
    ):
        # take-style lookup of rows of a row-split table: masked slice + all-reduce
        axis, out_spec = axes[-1], (None,) * len(out_shape)
        in_spec = tuple(axis if d == sliced[0] else None for d in range(len(in_shape)))
        comm = collective_cost("allreduce", share_bytes(eqn.outvars[0], out_spec, mesh), axis, mesh)
        specs = [in_spec] + [(None,) * len(shape_of(v)) for v in eqn.invars[1:]]
        result.append(priced_strategy(f"vocab[{axis}]", eqn, mesh, specs, [out_spec], comm=comm, weight=0))
    return tuple(result)


WINDOW_PRIMITIVES: frozenset[str] = frozenset(
    "reduce_window_max reduce_window_min reduce_window_sum reduce_window "
    "select_and_scatter_add select_and_gather_add".split()
)
"""Pooling and its derivatives: windows slid over some dims; a split survives on the others."""


def windowed_strategies(eqn: Any, mesh: MeshSpec) -> tuple[Strategy, ...]:
    """Strategies of a pooling equation (:data:`WINDOW_PRIMITIVES`): each split of the result
    on a dim its windows leave alone (window and stride 1, no padding or dilation), e.g. the
    batch or the channels of a max pool, every array operand split alike (they share those
    dims' sizes); init values whole."""
    params = eqn.params
    rank = len(params["window_dimensions"])
    ones = (1,) * rank
    free = {
        d
        for d in range(rank)
        if params["window_dimensions"][d] == 1
        and params["window_strides"][d] == 1
        and tuple(params["padding"][d]) == (0, 0)
        and params.get("base_dilation", ones)[d] == 1
        and params.get("window_dilation", ones)[d] == 1
    }
    out_shape = shape_of(eqn.outvars[0])
    result = []
    for spec in candidate_specs(out_shape, mesh):
        if any(a is not None and d not in free for d, a in enumerate(spec)):
            continue
        ins = [spec if len(shape_of(v)) == rank else (None,) * len(shape_of(v)) for v in eqn.invars]
        result.append(priced_strategy(spec_name(spec), eqn, mesh, ins, [spec] * len(eqn.outvars)))
    return tuple(result)


ALONG_ONE_DIM_PRIMITIVES: frozenset[str] = frozenset("concatenate stack unstack split sort top_k".split())
"""Primitives that join, part or order their operands along one dim and leave the others alone."""


def _along(eqn: Any) -> tuple[int, int]:
    """``(the dim the equation works along, the rank of the values that have it)``."""
    p = eqn.params
    ranks = [len(shape_of(v)) for v in (*eqn.invars, *eqn.outvars)]
    rank = max(ranks)
    axis = p["dimension"] if "dimension" in p else p.get("axis", -1)  # a top_k without one: the last
    return axis % rank, rank


def along_one_dim_strategies(eqn: Any, mesh: MeshSpec) -> tuple[Strategy, ...]:
    """Strategies of an equation of :data:`ALONG_ONE_DIM_PRIMITIVES`: each split of the dims it
    leaves alone, the same on every operand and result (``stack`` adds the dim its operands
    lack, ``unstack`` drops it from its results), the dim it works along whole.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mesh = MeshSpec(axis_names=("data",), axis_sizes=(8,), bandwidth=(1e11,), latency=(1e-6,),
      ...                 peak_flops=1e14, memory_bandwidth=1e12)
      >>> x = jnp.ones((8, 4))
      >>> (eqn,) = jax.make_jaxpr(lambda a: jnp.concatenate([a, a], 1))(x).jaxpr.eqns
      >>> [s.input_specs for s in along_one_dim_strategies(eqn, mesh)]
      [((None, None), (None, None)), (('data', None), ('data', None))]
    """
    axis, rank = _along(eqn)
    full = next(shape_of(v) for v in (*eqn.invars, *eqn.outvars) if len(shape_of(v)) == rank)
    rest = full[:axis] + full[axis + 1 :]

    def placed(spec: Spec, v: Any) -> Spec:
        return spec[:axis] + (None,) + spec[axis:] if len(shape_of(v)) == rank else spec

    return tuple(
        priced_strategy(
            spec_name(placed(spec, eqn.outvars[0])),
            eqn,
            mesh,
            [placed(spec, v) for v in eqn.invars],
            [placed(spec, v) for v in eqn.outvars],
        )
        for spec in candidate_specs(rest, mesh)
    )
