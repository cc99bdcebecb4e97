"""Candidate sharding strategies per jaxpr equation, for the intra-op ILP.

Alpa's intra-operator strategy generation over public ``jax.extend.core`` jaxprs. Each
equation gets a few candidate layouts (batch split, Megatron column/row split, replicate,
...) priced with an alpha-beta model per mesh axis; :mod:`autopar._src.strategy_graph`
joins them into the ILP's graph. A spec is a tuple with, per tensor dim, the mesh axis the
dim is split over (or, for a batch split over every device of a 2-D mesh, all its axes), or
``None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from autopar._src import compat, cost
from autopar._src.collectives import Axes, entry_axes
from autopar._src.dim_maps import (
    ALONG_ONE_DIM_PRIMITIVES,
    DIM_MAP_PRIMITIVES,
    WINDOW_PRIMITIVES,
    along_one_dim_strategies,
    dim_map_strategies,
    windowed_strategies,
)
from autopar._src.layout_costs import (
    Collective,
    MeshSpec,
    all_axes,
    broadcast_spec,
    candidate_specs,
    collective_cost,
    collective_latency,
    divides,
    priced_strategy,
    replicated_strategies,
    shape_of,
    share_bytes,
    spec_axes,
    spec_name,
    split_axes,
)
from autopar._src.sharding_ilp import Strategy

ELEMENTWISE_PRIMITIVES: frozenset[str] = frozenset(
    "abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil "
    "clamp clz complex conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp "
    "exp2 expm1 floor ge gt igamma igamma_grad_a igammac imag integer_pow is_finite le lgamma log "
    "log1p log2 logistic lt max min mul mulhi ne neg nextafter not one_minus_square or polygamma "
    "population_count pow real reduce_precision rem round rsqrt select_n shift_left "
    "shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient sub tan "
    "tanh xor zeta".split()
)
"""Primitives whose output follows its operands dim by dim (size-1 dims broadcast); jax 0.12
adds ``log2`` and ``one_minus_square`` (``tanh``'s derivative)."""
GENERATED_ELEMENTWISE: frozenset[str] = frozenset({"threefry2x32", "iota"})
"""Laid out as elementwise primitives too: threefry's two results of one shape, and ``iota``,
whose every device makes its own part (a microbatch's dropout bits are threefry of iotas,
:mod:`~autopar._src.microbatch_draws`); so is ``random_bits`` from one key, which JAX counts so
that XLA splits it."""
REDUCTION_PRIMITIVES: frozenset[str] = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin".split()
)
"""Primitives that reduce their operand over ``params["axes"]``."""


class _Piece(NamedTuple):
    """One split of a multi-operand strategy: which dims go onto one mesh axis."""

    in_dims: tuple[tuple[int, int], ...]
    """``(operand index, dim)`` pairs split over the axis."""
    out_dim: int | None
    """Output dim split over the axis, if any."""
    collective: Collective | None = None
    """Collective over the axis that finishes partial results (``reducescatter`` splits ``out_dim``)."""


def _from_pieces(
    eqn: Any,
    mesh: MeshSpec,
    pieces: dict[str, _Piece],
    plans: Sequence[tuple[tuple[str, Axes], ...]],
    *,
    flops: float = 0.0,
    weight: int | None = None,
) -> tuple[Strategy, ...]:
    """One strategy per plan whose pieces exist, divide their dims and use distinct dims and axes."""
    shapes = [shape_of(v) for v in eqn.invars]
    out_shape = shape_of(eqn.outvars[0])
    result = []
    for plan in plans:
        if any(p not in pieces for p, _ in plan) or len(spec_axes(tuple(a for _, a in plan))) < sum(
            len(entry_axes(a)) for _, a in plan
        ):
            continue
        ins: list[list[Axes]] = [[None] * len(s) for s in shapes]
        out: list[Axes] = [None] * len(out_shape)
        ok, collectives = True, []
        for piece_name, axis in plan:
            piece = pieces[piece_name]
            for k, d in piece.in_dims:
                ok = ok and ins[k][d] is None and divides(shapes[k], d, axis, mesh)
                ins[k][d] = axis
            if piece.out_dim is not None:
                ok = ok and out[piece.out_dim] is None and divides(out_shape, piece.out_dim, axis, mesh)
                out[piece.out_dim] = axis
            if piece.collective is not None:
                collectives.append((piece.collective, axis, piece.out_dim))
        if not ok:
            continue
        comm = latency = 0.0
        for kind, axis, out_dim in collectives:
            partial = tuple(None if d == out_dim else a for d, a in enumerate(out))
            comm += collective_cost(kind, share_bytes(eqn.outvars[0], partial, mesh), axis, mesh)
            latency += collective_latency(kind, axis, mesh)
        name = "+".join(f"{p}[{'.'.join(entry_axes(a))}]" for p, a in plan) or "replicated"
        specs = [tuple(s) for s in ins]
        result.append(
            priced_strategy(
                name, eqn, mesh, specs, [tuple(out)], flops=flops, comm=comm, latency=latency, weight=weight
            )
        )
    return tuple(result)


ROW = ("row_allreduce", "row_reducescatter")
"""The pieces that split a contracted dim and finish its partial sums."""


def _standard_plans(
    mesh: MeshSpec, batch: str, model_pieces: Sequence[str], reductions: Sequence[str] = ()
) -> list[tuple[tuple[str, Axes], ...]]:
    """The splits a strategy may combine, over a mesh's axes.

    Replicated; ``batch`` over each axis; each model piece over the last axis, and each of the
    ``reductions`` (pieces that finish partial sums: a contracted batch, in a weight gradient)
    over each axis. On a 2-D mesh also ``batch`` over the first axis with each model piece over
    the last, each reduction over the first axis with each other model piece over the last (the
    gradient of a tensor-parallel layer under data parallelism), and ``batch`` and each model
    piece over all axes at once.
    """
    axes, every = split_axes(mesh), all_axes(mesh)
    plans: list[tuple[tuple[str, Axes], ...]] = [()]
    plans += [((batch, a),) for a in axes]
    if axes:
        plans += [((p, axes[-1]),) for p in model_pieces]
        plans += [((r, a),) for r in reductions for a in axes[:-1]]
    if every is not None:
        plans += [((batch, axes[0]), (p, axes[-1])) for p in model_pieces if p != "row_reducescatter"]
        plans += [
            ((r, axes[0]), (p, axes[-1])) for r in reductions for p in model_pieces if p not in reductions
        ]
        plans += [((p, every),) for p in (batch, *model_pieces)]
    return list(dict.fromkeys(plans))


def _dot_general(eqn: Any, mesh: MeshSpec) -> tuple[Strategy, ...]:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lrank, rrank = len(shape_of(eqn.invars[0])), len(shape_of(eqn.invars[1]))
    out_rank = len(shape_of(eqn.outvars[0]))
    lfree = [d for d in range(lrank) if d not in lc and d not in lb]
    rfree = [d for d in range(rrank) if d not in rc and d not in rb]
    pieces: dict[str, _Piece] = {}
    if lb:  # batched matmul (e.g. attention): split the leading batch dim of both
        pieces["batch"] = _Piece(((0, lb[0]), (1, rb[0])), 0)
    if lfree:  # data parallel: the leading non-contracting dim of lhs (under a batched
        # matmul, e.g. the tokens' groups of a mixture of experts' per-expert matmul)
        pieces["batch" if not lb else "rows"] = _Piece(((0, lfree[0]),), len(lb))
    if len(lb) >= 2:
        pieces["heads"] = _Piece(((0, lb[1]), (1, rb[1])), 1)
    if rfree:  # Megatron column split: output's last dim, no communication
        pieces["column"] = _Piece(((1, rfree[-1]),), out_rank - 1)
    if lc:  # row split: partial sums, then all-reduce or reduce-scatter onto the batch dim
        pieces["row_allreduce"] = _Piece(((0, lc[0]), (1, rc[0])), None, "allreduce")
        rs_dim = pieces["batch"].out_dim if "batch" in pieces else out_rank - 1
        if out_rank:
            pieces["row_reducescatter"] = _Piece(((0, lc[0]), (1, rc[0])), rs_dim, "reducescatter")
    plans = _standard_plans(mesh, "batch", ("heads", "column", *ROW), ROW)
    if "rows" in pieces:
        plans += [p for p in _standard_plans(mesh, "rows", ("column", *ROW), ROW) if p not in plans]
    return _from_pieces(eqn, mesh, pieces, plans, flops=cost.eqn_flops(eqn), weight=1)


def _ragged_dot(eqn: Any, mesh: MeshSpec) -> tuple[Strategy, ...]:
    """``lax.ragged_dot`` (a dropless mixture of experts' grouped matmul) and its derivatives.

    The rows of a group are contiguous (``group_sizes`` counts them), so the ragged dim stays
    whole outside a contraction; the other free dims split as Megatron's columns, and a
    contraction (over the features, or over the ragged rows in the weight gradient, whose
    output leads with the groups) leaves partial sums.
    """
    dims = eqn.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = dims.dot_dimension_numbers
    ragged, groups = tuple(dims.lhs_ragged_dimensions), tuple(dims.rhs_group_dimensions)
    lrank, rrank = len(shape_of(eqn.invars[0])), len(shape_of(eqn.invars[1]))
    lfree = [d for d in range(lrank) if d not in (*lc, *lb)]
    rfree = [d for d in range(rrank) if d not in (*rc, *rb, *groups)]
    lead = 1 if any(d in lc for d in ragged) else 0  # the weight gradient's groups
    if lead + len(lb) + len(lfree) + len(rfree) != len(shape_of(eqn.outvars[0])):
        return replicated_strategies(eqn, mesh)
    out_rank = len(shape_of(eqn.outvars[0]))
    pieces: dict[str, _Piece] = {}
    if rfree:
        pieces["column"] = _Piece(((1, rfree[-1]),), out_rank - 1)
    kept = [d for d in lfree if d not in ragged]
    if kept:
        pieces["lhs_column"] = _Piece(((0, kept[-1]),), lead + len(lb) + lfree.index(kept[-1]))
    if lc:
        pieces["row_allreduce"] = _Piece(((0, lc[0]), (1, rc[0])), None, "allreduce")
        pieces["row_reducescatter"] = _Piece(((0, lc[0]), (1, rc[0])), out_rank - 1, "reducescatter")
    plans = _standard_plans(mesh, "batch", ("column", "lhs_column", *ROW), ROW)
    return _from_pieces(eqn, mesh, pieces, plans, flops=cost.eqn_flops(eqn), weight=1)


def _conv(eqn: Any, mesh: MeshSpec) -> tuple[Strategy, ...]:
    dn, p = eqn.params["dimension_numbers"], eqn.params
    pieces: dict[str, _Piece] = {}
    if p.get("batch_group_count", 1) == 1:
        pieces["batch"] = _Piece(((0, dn.lhs_spec[0]),), dn.out_spec[0])
        if p.get("feature_group_count", 1) == 1:
            pieces["channel"] = _Piece(((1, dn.rhs_spec[0]),), dn.out_spec[1])
            # Input features split (Megatron's row-parallel convolution; in a weight gradient,
            # whose input features are the batch, data parallelism): partial sums, then an
            # all-reduce or a reduce-scatter onto the output features.
            contracted = ((0, dn.lhs_spec[1]), (1, dn.rhs_spec[1]))
            pieces["row_allreduce"] = _Piece(contracted, None, "allreduce")
            pieces["row_reducescatter"] = _Piece(contracted, dn.out_spec[1], "reducescatter")
    plans = _standard_plans(mesh, "batch", ("channel", *ROW), ROW)
    return _from_pieces(eqn, mesh, pieces, plans, flops=cost.eqn_flops(eqn), weight=1)


def _gather(eqn: Any, mesh: MeshSpec) -> tuple[Strategy, ...]:
    dn, table_shape = eqn.params["dimension_numbers"], shape_of(eqn.invars[0])
    out_rank, idx_rank = len(shape_of(eqn.outvars[0])), len(shape_of(eqn.invars[1]))
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]
    pieces: dict[str, _Piece] = {}
    if dn.operand_batching_dims:  # take_along_axis: operand and indices share a leading batch dim
        if tuple(dn.operand_batching_dims[:1]) != (0,) or tuple(dn.start_indices_batching_dims[:1]) != (0,):
            return replicated_strategies(eqn, mesh)
        if batch_out:
            pieces["batch"] = _Piece(((0, 0), (1, 0)), batch_out[0])
        return _from_pieces(eqn, mesh, pieces, _standard_plans(mesh, "batch", ()), weight=0)
    if idx_rank >= 2 and batch_out:  # indices' leading batch dim; the table stays whole
        pieces["indices"] = _Piece(((1, 0),), batch_out[0])
    if (
        tuple(dn.collapsed_slice_dims) == (0,)
        and tuple(dn.start_index_map) == (0,)
        and tuple(eqn.params["slice_sizes"]) == (1, *table_shape[1:])
        and len(table_shape) >= 2
    ):  # embedding lookup: rows (vocab) split with masked lookup + all-reduce, or columns split
        pieces["vocab"] = _Piece(((0, 0),), None, "allreduce")
        pieces["embed"] = _Piece(((0, len(table_shape) - 1),), dn.offset_dims[-1])
    # An operand dim taken whole (e.g. the rows of ``x[:, 0]``) maps to an offset dim of the output.
    kept = [d for d in range(len(table_shape)) if d not in dn.collapsed_slice_dims]
    for i, d in enumerate(kept):
        whole = eqn.params["slice_sizes"][d] == table_shape[d] and d not in dn.start_index_map
        if whole and table_shape[d] > 1 and i < len(dn.offset_dims) and "indices" not in pieces:
            pieces["indices"] = _Piece(((0, d),), dn.offset_dims[i])
            break
    plans = _standard_plans(mesh, "indices", ("vocab", "embed"))
    return _from_pieces(eqn, mesh, pieces, plans, weight=0)


def _scatter_add(eqn: Any, mesh: MeshSpec) -> tuple[Strategy, ...]:
    dn = eqn.params["dimension_numbers"]
    table_shape, upd_shape = shape_of(eqn.invars[0]), shape_of(eqn.invars[2])
    upd_batch = [d for d in range(len(upd_shape)) if d not in dn.update_window_dims]
    if dn.operand_batching_dims:  # the transpose of take_along_axis: one shared batch dim
        if (
            tuple(dn.operand_batching_dims[:1]) != (0,)
            or tuple(dn.scatter_indices_batching_dims[:1]) != (0,)
            or not upd_batch
        ):
            return replicated_strategies(eqn, mesh)
        pieces = {"batch": _Piece(((0, 0), (1, 0), (2, upd_batch[0])), 0)}
        return _from_pieces(eqn, mesh, pieces, _standard_plans(mesh, "batch", ()))
    if not (
        tuple(dn.inserted_window_dims) == (0,)
        and tuple(dn.scatter_dims_to_operand_dims) == (0,)
        and not dn.operand_batching_dims
        and len(table_shape) >= 2
        and upd_batch
        and len(shape_of(eqn.invars[1])) >= 2
    ):
        return replicated_strategies(eqn, mesh)
    batch = ((1, 0), (2, upd_batch[0]))
    pieces = {  # the embedding gradient: updates split by batch, or the table by rows or columns
        "batch_allreduce": _Piece(batch, None, "allreduce"),
        "rows": _Piece(((0, 0),), 0),
        "batch_reducescatter": _Piece(batch, 0, "reducescatter"),
        "embed": _Piece(((0, len(table_shape) - 1), (2, dn.update_window_dims[-1])), len(table_shape) - 1),
    }
    reductions = ("batch_allreduce", "batch_reducescatter")
    plans = _standard_plans(mesh, "batch_allreduce", ("rows", "batch_reducescatter", "embed"), reductions)
    return _from_pieces(eqn, mesh, pieces, plans)


def _elementwise(eqn: Any, mesh: MeshSpec) -> tuple[Strategy, ...]:
    out_shape = shape_of(eqn.outvars[0])
    return tuple(
        priced_strategy(
            spec_name(spec),
            eqn,
            mesh,
            [broadcast_spec(spec, out_shape, shape_of(v)) for v in eqn.invars],
            [spec] * len(eqn.outvars),
        )
        for spec in candidate_specs(out_shape, mesh)
    )


def _reduction(eqn: Any, mesh: MeshSpec) -> tuple[Strategy, ...]:
    reduced = set(eqn.params["axes"])
    # argmax/argmin combine (value, index) pairs: twice the bytes of the result.
    factor = 2.0 if eqn.primitive.name in ("argmax", "argmin") else 1.0
    result = []
    for spec in candidate_specs(shape_of(eqn.invars[0]), mesh):
        out_spec = tuple(a for d, a in enumerate(spec) if d not in reduced)
        split = [a for d, a in enumerate(spec) if d in reduced and a is not None]
        nbytes = factor * share_bytes(eqn.outvars[0], out_spec, mesh)
        comm = sum(collective_cost("allreduce", nbytes, a, mesh) for a in split)
        latency = sum(collective_latency("allreduce", a, mesh) for a in split)
        name = spec_name(spec) + ("+allreduce" if split else "")
        result.append(priced_strategy(name, eqn, mesh, [spec], [out_spec], comm=comm, latency=latency))
    return tuple(result)


def elementwise_call(eqn: Any) -> bool:
    """Whether ``eqn`` runs bodies (``custom_jvp`` activations, nested ``jit``, ``cond`` branches)
    that are elementwise.

    Every result has one shape, every operand that shape or is a scalar (a ``cond``'s index),
    and every equation of the bodies (recursively) is elementwise or broadcasts a scalar.
    """
    bodies = compat.sub_jaxprs(eqn) or [b for b, _ in compat.cond_branches(eqn) or ()]
    if not bodies or not eqn.outvars:
        return False
    out_shape = shape_of(eqn.outvars[0])
    if any(shape_of(v) != out_shape for v in eqn.outvars):
        return False
    if any(shape_of(v) not in (out_shape, ()) for v in eqn.invars):
        return False
    for body in bodies:
        for inner in body.eqns:
            scalar_broadcast = inner.primitive.name == "broadcast_in_dim" and shape_of(inner.invars[0]) == ()
            if not (
                inner.primitive.name in ELEMENTWISE_PRIMITIVES or scalar_broadcast or elementwise_call(inner)
            ):
                return False
    return True


def eqn_strategies(eqn: Any, mesh: MeshSpec) -> tuple[Strategy, ...]:
    """Candidate strategies of one jaxpr equation on ``mesh``, in a fixed order, replicated first.

    Covers ``dot_general`` (batch, Megatron column and row splits, 2-D combinations),
    ``ragged_dot_general`` (column and row splits), ``conv_general_dilated`` (batch,
    output-channel and input-channel splits), elementwise primitives,
    reductions, dim-moving primitives (reshape, transpose, broadcast, squeeze, slices, ...),
    those that work along one dim (concatenate, stack, split, sort, top-k),
    pooling (``reduce_window_*`` and its derivatives, split where the windows leave a dim alone),
    embedding-style ``gather`` / ``dynamic_slice`` / ``scatter-add``; any other equation
    gets the replicated strategy only. ``input_specs`` has one spec per invar (literals too).

    Example:
      >>> mesh = MeshSpec(axis_names=("data",), axis_sizes=(8,), bandwidth=(1e11,), latency=(1e-6,),
      ...                 peak_flops=1e14, memory_bandwidth=1e12)
      >>> (eqn,) = jax.make_jaxpr(jnp.tanh)(jnp.ones((8, 4))).jaxpr.eqns
      >>> [s.name for s in eqn_strategies(eqn, mesh)]
      ['replicated', 'split[d0@data]']
    """
    name = eqn.primitive.name
    if name == "dot_general":
        result = _dot_general(eqn, mesh)
    elif name == "conv_general_dilated":
        result = _conv(eqn, mesh)
    elif name == "ragged_dot_general":
        result = _ragged_dot(eqn, mesh)
    elif name == "gather":
        result = _gather(eqn, mesh)
    elif name in ("scatter-add", "scatter_add"):
        result = _scatter_add(eqn, mesh)
    elif (
        (name in ELEMENTWISE_PRIMITIVES and len(eqn.outvars) == 1)
        or name in GENERATED_ELEMENTWISE
        or (name == "bitcast_convert_type" and shape_of(eqn.invars[0]) == shape_of(eqn.outvars[0]))
        or (name == "random_bits" and not shape_of(eqn.invars[0]))  # from one key
        or elementwise_call(eqn)
    ):
        result = _elementwise(eqn, mesh)
    elif name in REDUCTION_PRIMITIVES and len(eqn.invars) == 1:
        result = _reduction(eqn, mesh)
    elif name in DIM_MAP_PRIMITIVES and eqn.invars:
        result = dim_map_strategies(eqn, mesh)
    elif name in ALONG_ONE_DIM_PRIMITIVES and eqn.invars:
        result = along_one_dim_strategies(eqn, mesh)
    elif name in WINDOW_PRIMITIVES:
        result = windowed_strategies(eqn, mesh)
    else:
        result = ()
    return result or replicated_strategies(eqn, mesh)
