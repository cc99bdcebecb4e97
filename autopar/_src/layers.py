"""Forward layers: where to cut the loss jaxpr, and the boundary marker.

A *layer* is a contiguous run of equations of the (flattened) forward loss
jaxpr. Between layers autopar inserts a ``boundary`` equation: the identity on
every value live across the cut. Its JVP is the boundary on the tangents and its
transpose is a ``bwd`` boundary on the cotangents, so ``jax.value_and_grad``
mirrors every forward cut into the backward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from autopar._src import clustering, compat, cond_split, cost, remat_split, user_constraints

BoundaryKind = Literal["fwd", "bwd"]

boundary_p = compat.Primitive("autopar_boundary")
boundary_p.multiple_results = True
boundary_p.def_impl(lambda *args, index, kind: list(args))
boundary_p.def_abstract_eval(lambda *avals, index, kind: list(avals))


def _boundary_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, index: int, kind: str):
    primals_out = boundary_p.bind(*primals, index=index, kind=kind)
    live = [i for i, t in enumerate(tangents) if not compat.is_zero_cotangent(t)]
    tangents_out = list(tangents)
    if live:
        marked = boundary_p.bind(*[tangents[i] for i in live], index=index, kind=kind)
        for i, t in zip(live, marked, strict=True):
            tangents_out[i] = t
    return primals_out, tangents_out


def _boundary_transpose(cts: Sequence[Any], *args: Any, index: int, kind: str):
    del args
    cts = [compat.instantiate_zero(ct) if compat.is_zero_cotangent(ct) else ct for ct in cts]
    return boundary_p.bind(*cts, index=index, kind="bwd")


compat.register_identity_rules(boundary_p, _boundary_jvp, _boundary_transpose)


cotangent_seed_p = compat.Primitive("autopar_cotangent_seed")
"""The cotangent the backward starts from: ``scale`` in the loss's shape and dtype. ``scale`` is
1 as traced; the program of a step with ``m`` microbatches sets it to ``1 / m`` (see
:func:`with_seed_scale`), so every cotangent of a microbatch's backward is the one ``jax.jit``
computes for its examples from the whole batch's mean, and the gradients add up over the
microbatches. A cotangent is then the same however the batch is cut, also where the backward is
not linear in it (a ``custom_vjp`` that clips it)."""
cotangent_seed_p.def_abstract_eval(lambda *, shape, dtype, scale: compat.shaped_array(shape, dtype))
cotangent_seed_p.def_impl(lambda *, shape, dtype, scale: jnp.full(shape, scale, dtype))
compat.register_lowering_from_fun(
    cotangent_seed_p, lambda *, shape, dtype, scale: jnp.full(shape, scale, dtype)
)
compat.register_constant_rules(cotangent_seed_p)


def cotangent_seed(value: Any) -> Any:
    """The backward's starting cotangent for the loss ``value`` (ones, until scaled). It reads
    only the loss's shape and dtype, so the loss is not a value a microbatch's backward holds."""
    aval = compat.aval_of(value)
    return cotangent_seed_p.bind(shape=tuple(aval.shape), dtype=aval.dtype, scale=1.0)


def with_seed_scale(eqn: Any, scale: float) -> Any:
    """``eqn``, with its seed scaled to ``scale`` if it is the backward's :data:`cotangent_seed_p`."""
    if eqn.primitive is not cotangent_seed_p or scale == 1.0:
        return eqn
    return eqn.replace(params={**eqn.params, "scale": scale})


def is_boundary(eqn: Any) -> bool:
    """Whether ``eqn`` is a layer boundary marker."""
    return eqn.primitive is boundary_p


def _dead(jaxpr: Any) -> set[int]:
    """The ``id``s of the pure equations of ``jaxpr`` whose results nothing reads, nor the
    jaxpr's outputs."""
    live = {v for v in jaxpr.outvars if not compat.is_literal(v)}
    dead = set()
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            live.update(a for a in eqn.invars if not compat.is_literal(a))
        else:
            dead.add(id(eqn))
    return dead


def inline_calls(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    *,
    split_conds: bool = False,
    split_remats: float | None = None,
    caller: Any = None,
) -> list[Any]:
    """Evaluates ``jaxpr`` with every nested ``jit`` call inlined (use under tracing).

    An inlined equation keeps its source line; one that has none of the user's code (inside a
    library's ``jit``, ``jnp.roll``) gets the line of the outermost call that has one
    (``caller``: its traceback), which error messages name.

    With ``split_conds`` each ``cond`` is also split into one per independent group of its
    results (:func:`autopar._src.cond_split.split_cond`). The step's own sharding constraints
    are dropped, in bodies too (:mod:`autopar._src.user_constraints`). A rematerialised call with
    at least ``split_remats`` FLOPs is bound as segments that the loss can be cut between
    (:mod:`autopar._src.remat_split`). A pure equation whose results nothing reads is left out."""
    env: dict[Any, Any] = {}

    def read(a: Any) -> Any:
        return compat.literal_value(a) if compat.is_literal(a) else env[a]

    def run(body: Any, body_consts: Sequence[Any], *xs: Any) -> list[Any]:
        return inline_calls(body, body_consts, xs)

    for v, x in zip(list(jaxpr.constvars) + list(jaxpr.invars), list(consts) + list(args), strict=True):
        env[v] = x
    dead = _dead(jaxpr)
    for eqn in jaxpr.eqns:
        if id(eqn) in dead:  # ``jax.nn.logsumexp``'s unused ``sign``
            continue
        invals = [read(a) for a in eqn.invars]
        if user_constraints.is_constraint(eqn):
            outs = user_constraints.dropped(eqn, invals)
        elif compat.is_call(eqn):
            body, body_consts = compat.call_body(eqn)
            traceback = eqn.source_info.traceback
            outs = inline_calls(
                body,
                body_consts,
                invals,
                split_conds=split_conds,
                split_remats=split_remats,
                caller=caller if caller is not None or compat.user_frame(traceback) is None else traceback,
            )
        elif remat_split.should_split(eqn, split_remats):
            outs = remat_split.split(eqn, invals, lambda b, c, xs: inline_calls(b, c, xs))
        else:
            split = cond_split.split_cond(eqn, invals) if split_conds else None
            rebound = user_constraints.rebind(eqn, invals, run) if split is None else split
            outs = compat.bind_eqn(eqn, invals, caller) if rebound is None else rebound
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not compat.is_dropvar(v):
                env[v] = x
    return [read(a) for a in jaxpr.outvars]


def live_across(jaxpr: Any, cuts: Sequence[int]) -> list[list[Any]]:
    """For each cut position ``p`` (before equation ``p``), the vars defined by an
    equation before ``p`` and read at or after ``p`` (or returned)."""
    last_use = compat.last_reads(jaxpr)
    defined_at: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.outvars:
            if not compat.is_dropvar(v):
                defined_at[v] = i
    return [[v for v, d in defined_at.items() if d < p and last_use.get(v, -1) >= p] for p in cuts]


def _live_bytes_per_position(jaxpr: Any) -> np.ndarray:
    """Bytes live across a cut before each equation position 0..n."""
    n = len(jaxpr.eqns)
    diff = np.zeros(n + 2, dtype=np.float64)
    last_use = compat.last_reads(jaxpr)
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.outvars:
            if compat.is_dropvar(v) or v not in last_use:
                continue
            u = last_use[v]
            if u > i:
                b = cost.aval_bytes(v.aval)
                diff[i + 1] += b
                diff[u + 1] -= b
    return np.cumsum(diff)[: n + 1]


def choose_cuts(
    jaxpr: Any, num_layers: int | None
) -> tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]]:
    """Cuts the forward into ``num_layers`` layers: FLOPs of heavy operations
    balanced, then the fewest bytes live across the widest cut
    (:func:`autopar._src.clustering.cluster_layers`).

    ``num_layers=None`` lets the clustering choose how many layers, with
    :data:`~autopar._src.clustering.BYTES_FACTORS`'s first factor.

    Returns:
      ``(cuts, layer_flops, other_counts)``: ``num_layers - 1`` cut positions (a cut
      ``p`` is before equation ``p``), the FLOPs of each layer, and (when the count
      was chosen) the other layer counts of
      :func:`~autopar._src.clustering.candidate_layer_counts` (the other factors', then
      the unbalanced ones of :data:`~autopar._src.clustering.UNBALANCED_FACTORS`).

    Raises:
      ValueError: if the forward has fewer heavy equations than ``num_layers``.
    """
    flops = np.array([cost.eqn_flops(e) for e in jaxpr.eqns], dtype=np.float64)
    heavy = int(np.count_nonzero(flops))
    if heavy == 0 and num_layers in (None, 1):  # e.g. embeddings and elementwise work: one layer
        return (), (0.0,), ()
    if num_layers is not None and (num_layers < 1 or heavy < num_layers):
        raise ValueError(
            f"The loss function has {heavy} heavy operations (matmuls/convolutions) that can be cut "
            f"between, but {num_layers} layers were requested; use num_stages <= {max(heavy, 1)}. "
            "(Layers stacked inside one nn.scan or lax.scan cannot be cut.)"
        )
    live = _live_bytes_per_position(jaxpr)
    counts = (
        (num_layers,)
        if num_layers is not None
        else clustering.candidate_layer_counts(
            flops,
            live,
            bytes_factors=clustering.BYTES_FACTORS,
            unbalanced_factors=clustering.UNBALANCED_FACTORS,
        )
    )
    result = clustering.cluster_layers(flops, live, num_layers=counts[0])
    return result.cuts, result.layer_flops, counts[1:]


def layer_flops_for_cuts(jaxpr: Any, cuts: Sequence[int]) -> tuple[float, ...]:
    """FLOPs of each layer of ``jaxpr`` cut at ``cuts``.

    Raises:
      ValueError: if the cuts are not increasing positions inside the jaxpr.
    """
    n = len(jaxpr.eqns)
    bounds = [0, *cuts, n]
    if any(not a < b for a, b in zip(bounds[:-1], bounds[1:], strict=False)):
        raise ValueError(
            f"Layer cuts {tuple(cuts)} are not increasing positions in a loss of {n} "
            "equations; the plan does not match this step."
        )
    flops = [cost.eqn_flops(e) for e in jaxpr.eqns]
    return tuple(float(sum(flops[a:b])) for a, b in zip(bounds[:-1], bounds[1:], strict=False))


def eval_with_boundaries(
    jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], cuts: Sequence[int]
) -> list[Any]:
    """Evaluates a flat forward jaxpr, passing live values through a boundary at
    each cut and the outputs through a final boundary (use under tracing)."""
    env: dict[Any, Any] = {}

    def read(a: Any) -> Any:
        return compat.literal_value(a) if compat.is_literal(a) else env[a]

    for v, x in zip(list(jaxpr.constvars) + list(jaxpr.invars), list(consts) + list(args), strict=True):
        env[v] = x
    live = dict(zip(cuts, live_across(jaxpr, cuts), strict=True))
    later = compat.last_reads(jaxpr)
    i, n = 0, len(jaxpr.eqns)
    while i < n:
        if i in live:
            index = list(cuts).index(i)
            outs = boundary_p.bind(*[env[v] for v in live[i]], index=index, kind="fwd")
            env.update(zip(live[i], outs, strict=True))
        # A layer's segments of one rematerialised call are rematerialised together.
        end = remat_split.merge_run(jaxpr.eqns, i, cuts)
        if end > i:
            remat_split.merged(jaxpr, i, end, env, later, lambda body, c, xs: inline_calls(body, c, xs))
            i = end
            continue
        eqn = jaxpr.eqns[i]
        outs = compat.bind_eqn(eqn, [read(a) for a in eqn.invars])
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not compat.is_dropvar(v):
                env[v] = x
        i += 1
    results = [read(a) for a in jaxpr.outvars]
    # The final boundary separates the last layer's forward from its backward.
    results = [jax.numpy.asarray(r) for r in results]
    return list(boundary_p.bind(*results, index=len(cuts), kind="fwd"))
