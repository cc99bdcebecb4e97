"""How the loss function's batch-free values scale with the batch, from its two traces (at one
microbatch and at the whole batch): whether averaging a value over microbatches gives the
whole batch's value.

A mean over the examples (a sum divided by the batch size, which differs between the traces
as a literal: ``div b 4.0`` against ``div b 16.0``) has degree 0 and averages exactly; so does
a ratio of two sums (a masked mean, exact when the microbatches hold equal weights). A sum over
the examples has degree 1: averaged, it would come back divided by the number of microbatches.
A value reduced over the examples by anything but a sum (a ``max``, one example picked out) is
*extreme*: no average of the microbatches' values gives it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

import jax
import jax.numpy as jnp

from autopar._src import carry_updates, compat, layers, sums_over_examples

_SUMS = frozenset({"reduce_sum", "dot_general", "scatter-add"})
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
"""Besides nested ``jit``s and checkpoints, the equations whose body takes their operands and
gives their results one for one."""
_PLACING = {
    "gather": (1, 2),
    "scatter": (1, 2),
    "dynamic_slice": (1, None),
    "dynamic_update_slice": (2, None),
}
"""The operands, by position, that place a gather's, scatter's (any) or dynamic slice's results."""
_PICKS = frozenset({"dynamic_slice", "gather"})
"""Inside a loop over the examples, these read the iteration's example."""


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How a value scales with the batch size: as its ``degree``-th power, or not at all
    (``extreme``)."""

    degree: float
    origin: Any
    """The equation that reduced over the examples."""
    extreme: bool = False
    unknown: bool = False
    """Reduced over the examples where the check does not follow (a loop whose carries neither
    add up nor settle): neither it nor what is made from it is checked."""
    sum: bool = False
    """A sum over the examples of terms per example, every term of it (``losses.sum()``, sums
    of such sums, a loop's running sum from zero, any of them times or divided by what no
    example makes: ``0.5 * losses.sum() / C``): the microbatches' values add up to the whole
    batch's. A term added that is no such sum (a regulariser, a mean) is not."""


Found = dict[Any, Scaling]


def scalings(
    eqns: Sequence[Any],
    twin: Mapping[int, Any],
    tainted: set[Any],
    nmb: int,
    given: Found | None = None,
    fixed: Set[Any] = frozenset(),
) -> Found:
    """The values of ``eqns`` that are not batch-independent means: their :class:`Scaling`
    (``given``: their inputs', where these are not means either).

    Bodies (nested ``jit``s, ``custom_jvp``/``custom_vjp`` and ``checkpoint`` calls, ``cond``
    branches, ``scan`` and ``while`` loops) are followed into, their twins alongside.

    Args:
      eqns: the loss function's equations at one microbatch.
      twin: ``id(eqn)`` -> the same equation at the whole batch (layer boundaries aside).
      tainted: the values computed from the examples.
      nmb: the number of microbatches (the ratio of the traces' batch sizes).
      fixed: values every microbatch reads whole (figures of the batch alone, made once per
        step from the whole batch: :mod:`~autopar._src.batch_statistics`): constants to it.
    """
    found: Found = dict(given or {})
    _walk(eqns, twin, set(tainted), nmb, found, grow=False, iterating=False, fixed=fixed)
    return found


def _walk(
    eqns: Sequence[Any],
    twin: Mapping[int, Any],
    tainted: set[Any],
    nmb: int,
    found: Found,
    *,
    grow: bool,
    iterating: bool,
    fixed: Set[Any] = frozenset(),
) -> None:
    """Adds the scalings of ``eqns``' values to ``found`` (which holds their inputs'). ``grow``:
    inside a body, ``tainted`` grows by whatever reads it or changes shape between the traces.
    ``iterating``: the body of a loop over the examples."""
    for e in eqns:
        if layers.is_boundary(e):  # an identity per value
            for a, v in zip(e.invars, e.outvars, strict=True):
                if not compat.is_literal(a) and a in found:
                    found[v] = found[a]
            continue
        other = twin.get(id(e))
        if grow and (
            any(not compat.is_literal(a) and a in tainted for a in e.invars)
            or other is None
            or any(v.aval.shape != w.aval.shape for v, w in zip(e.outvars, other.outvars, strict=True))
        ):
            tainted.update(e.outvars)
        outs = _eqn(e, other, tainted, nmb, found, iterating) if other is not None else _untwinned(e, found)
        for v, scaling in zip(e.outvars, outs, strict=True):
            # Predicates (a guard on any(mask)) carry no magnitude.
            if (
                scaling is not None
                and not compat.is_dropvar(v)
                and (is_float(v) or _is_int(v))
                and v not in fixed
            ):
                found[v] = scaling


def _untwinned(e: Any, found: Found) -> list[Scaling | None]:
    """The scalings of an equation the whole batch's trace has not (an einsum's contraction in
    another order there): its operands' as an elementwise equation's, the unknown one first."""
    ins = [found[a] for a in e.invars if not compat.is_literal(a) and a in found]
    scaling = next((s for s in ins if s.unknown), None) or max(ins, key=lambda s: s.degree, default=None)
    return [None if scaling is None else dataclasses.replace(scaling, sum=False)] * len(e.outvars)


def _eqn(
    e: Any, other: Any, tainted: set[Any], nmb: int, found: Found, iterating: bool
) -> list[Scaling | None]:
    """The scaling of each of ``e``'s outputs."""
    n = len(e.outvars)
    ins = [
        found.get(a) if not compat.is_literal(a) else _literal(a, b, nmb, e)
        for a, b in zip(e.invars, other.invars, strict=True)
    ]
    unknown = next((s for s in ins if s is not None and s.unknown), None)
    if unknown is not None:
        return [unknown] * n
    name = e.primitive.name
    if compat.bodies(e) and not name.startswith("scatter"):
        through = _through(e, other, ins, tainted, nmb)
        if through is not None:
            return through
    extreme = next((s for s in ins if s is not None and s.extreme), None)
    scaling: Scaling | None
    if _reduces_batch(e, other, tainted):
        if name in _SUMS:
            summed = [ins[0], ins[2]] if name == "scatter-add" else ins  # not the indices
            degree = 1 + sum(s.degree for s in summed if s is not None)
            terms = name != "scatter-add" and all(s is None for s in ins)  # of terms per example
            scaling = extreme or (Scaling(degree, e, sum=terms) if degree else None)
        elif name == "reduce" and carry_updates.combiner(e) in ("add", "add_any"):  # lax.reduce(x, 0., add)
            scaling = extreme or Scaling(1 + sum(s.degree for s in ins if s is not None), e)
        elif name == "reduce" and carry_updates.combiner(e) in ("max", "min"):
            scaling = Scaling(0.0, e, extreme=True)
        elif iterating and name in _PICKS:
            scaling = ins[0]
        elif compat.bodies(e) and not name.startswith("scatter"):  # a body not followed
            scaling = Scaling(0.0, e, unknown=True)
        else:
            scaling = Scaling(0.0, e, extreme=True)
    elif extreme is not None:
        scaling = extreme
    else:
        magnitudes = [None if _is_index(e, a) else s for a, s in zip(e.invars, ins, strict=True)]
        degree = _degree(e, [0.0 if s is None else s.degree for s in magnitudes])
        origin = next((s.origin for s in magnitudes if s is not None), e)
        sums = [s is not None and s.sum for s in ins]
        free = [
            s is None and (compat.is_literal(a) or a not in tainted)
            for a, s in zip(e.invars, ins, strict=True)
        ]
        scaling = Scaling(degree, origin, sum=sums_over_examples.linear(e, sums, free)) if degree else None
    return [scaling] * n


def _through(
    e: Any, other: Any, ins: list[Scaling | None], tainted: set[Any], nmb: int
) -> list[Scaling | None] | None:
    """The scalings of the outputs of ``e``, an equation with bodies, from its bodies; None where
    they cannot be followed (a body that differs between the traces, an unknown kind)."""
    taint = [not compat.is_literal(a) and a in tainted for a in e.invars]
    carried = [v in tainted for v in e.outvars]  # a loop's carries, as they leave it
    branches, theirs = compat.cond_branches(e), compat.cond_branches(other)
    if branches is not None and theirs is not None:
        if any(c for _, c in branches) or any(c for _, c in theirs):
            return None
        per_branch = [
            _body(b, t, ins[1:], taint[1:], nmb) for (b, _), (t, _) in zip(branches, theirs, strict=True)
        ]
        if any(f is None for f in per_branch):
            return None
        return [
            _merge(
                *(
                    _get(f, b.outvars[k])
                    for f, (b, _) in zip(per_branch, branches, strict=True)
                    if f is not None
                )
            )
            for k in range(len(e.outvars))
        ]
    loop, their_loop = compat.scan_loop(e), compat.scan_loop(other)
    if loop is not None and their_loop is not None:
        if their_loop.length == loop.length:
            return _settle(loop, their_loop.body, ins, taint, carried, nmb, e.invars)
        if their_loop.length == loop.length * nmb:
            return _over_examples(loop, their_loop.body, ins, taint, e, nmb, e.invars)
        return None
    mine, their_while = compat.while_body(e), compat.while_body(other)
    if mine is not None and their_while is not None:
        (body, skip), (their_body, _) = mine, their_while
        num_carry = len(e.outvars)
        loop = compat.Loop(body, len(body.invars) - num_carry, num_carry, 0)
        count = batch_literals(e.params["cond_jaxpr"], other.params["cond_jaxpr"], nmb) or any(
            s is not None and s.origin is e for s in ins
        )  # the trip count follows the batch: a batch-size literal in the predicate or the carries
        if count:
            return _over_examples(loop, their_body, ins[skip:], taint[skip:], e, nmb, e.invars[skip:])
        return _settle(loop, their_body, ins[skip:], taint[skip:], carried, nmb, e.invars[skip:])
    if not (compat.is_call(e) or compat.remat_body(e) is not None or e.primitive.name in _CUSTOM):
        return None  # e.g. a lax.reduce's combiner: not a body over the operands
    body, their_body = compat.operand_body(e), compat.operand_body(other)
    if body is None or their_body is None:
        return None
    found = _body(body, their_body, ins, taint, nmb)
    return None if found is None else [_get(found, v) for v in body.outvars]


def _body(
    body: Any,
    theirs: Any,
    ins: Sequence[Scaling | None],
    taint: Sequence[bool],
    nmb: int,
    iterating: bool = False,
) -> Found | None:
    """The scalings in ``body`` (its twin ``theirs``) given its inputs'; None if the twins'
    equations differ."""
    if len(body.eqns) != len(theirs.eqns) or len(body.invars) != len(theirs.invars):
        return None
    if any(
        q.primitive is not r.primitive or (len(q.invars), len(q.outvars)) != (len(r.invars), len(r.outvars))
        for q, r in zip(body.eqns, theirs.eqns, strict=True)
    ):
        return None  # the same number of equations, but not the same ones
    tainted = {
        v
        for v, w, t in zip(body.invars, theirs.invars, taint, strict=True)
        if t or v.aval.shape != w.aval.shape
    }
    found = {v: s for v, s in zip(body.invars, ins, strict=True) if s is not None}
    twin = dict(zip(map(id, body.eqns), theirs.eqns, strict=True))
    _walk(body.eqns, twin, tainted, nmb, found, grow=True, iterating=iterating)
    return found


def _get(found: Found, atom: Any) -> Scaling | None:
    return None if compat.is_literal(atom) else found.get(atom)


def _settle(
    loop: compat.Loop,
    theirs: Any,
    ins: list[Scaling | None],
    taint: list[bool],
    carried: list[bool],
    nmb: int,
    operands: Sequence[Any],
) -> list[Scaling | None] | None:
    """A loop that runs as often for a microbatch as for the batch (a layer stack, chunks of the
    sequence): its carries' scalings grown to a fixed point over iterations (``carried``: which
    carries leave it computed from the examples; ``operands``: the atoms ``ins`` are of). A carry
    that adds up sums over the examples from zero is one."""
    carries = slice(loop.num_consts, loop.num_consts + loop.num_carry)
    ins, taint = list(ins), list(taint)
    taint[carries] = [a or b for a, b in zip(taint[carries], carried[: loop.num_carry], strict=True)]
    for _ in range(4):
        found = _body(loop.body, theirs, ins, taint, nmb)
        if found is None:
            return None
        outs = [_get(found, v) for v in loop.body.outvars]
        grown = [_merge(a, b) for a, b in zip(ins[carries], outs[: loop.num_carry], strict=True)]
        if [_kind(a) for a in grown] == [_kind(a) for a in ins[carries]]:
            return _running_sums(loop, outs, operands, found, per_example=False)
        ins[carries] = grown
    return None


def _over_examples(
    loop: compat.Loop,
    theirs: Any,
    ins: list[Scaling | None],
    taint: list[bool],
    e: Any,
    nmb: int,
    operands: Sequence[Any],
) -> list[Scaling | None] | None:
    """A loop whose trip count follows the batch (over its examples or chunks of them): a
    carry it adds to is a sum over the examples (of terms per example, from zero: one in the
    sense of :attr:`Scaling.sum`), one it takes a max or min of is extreme."""
    found = _body(loop.body, theirs, ins, taint, nmb, iterating=True)
    if found is None:
        return None
    links = carry_updates.Links(loop.body.eqns)
    outs: list[Scaling | None] = []
    for k, v in enumerate(loop.body.outvars[: loop.num_carry]):
        carried, init = loop.body.invars[loop.num_consts + k], ins[loop.num_consts + k]
        kind, terms, q = carry_updates.update(v, carried, links)
        step = _merge(*(_get(found, t) for t in terms))
        if kind == "same":
            outs.append(init)
        elif kind == "sum" and step is not None and (step.extreme or step.unknown):
            outs.append(step)
        elif kind == "sum":
            outs.append(_merge(init, Scaling(1 + (step.degree if step else 0.0), q)))
        elif kind == "extreme":
            outs.append(Scaling(0.0, q, extreme=True))
        else:
            outs.append(Scaling(0.0, e, unknown=True))
    outs += [_get(found, v) for v in loop.body.outvars[loop.num_carry :]]
    return _running_sums(loop, outs, operands, found, per_example=True)


def _running_sums(
    loop: compat.Loop, outs: list[Scaling | None], operands: Sequence[Any], found: Found, per_example: bool
) -> list[Scaling | None]:
    """``outs`` (a loop's results' scalings; ``found``: its body's) with its running sums from
    zero of terms per example (``per_example``: a loop over the examples) or of sums over them
    marked sums over the examples (:attr:`Scaling.sum`)."""

    def term(t: Any) -> bool:
        s = _get(found, t)
        return s is None if per_example else s is not None and s.sum

    degree_one = [s is not None and s.degree == 1 and not (s.extreme or s.unknown) for s in outs]
    sums = sums_over_examples.running_sums(loop, operands, degree_one, term)
    return [
        dataclasses.replace(s, sum=True) if s is not None and k in sums else s for k, s in enumerate(outs)
    ]


def batch_literals(cond: Any, theirs: Any, nmb: int) -> bool:
    """Whether a ``while``'s predicate compares with a batch-size literal (the twins' predicates
    differ in one that is the batch size's multiple)."""
    mine, their = compat.jaxpr_and_consts(cond)[0], compat.jaxpr_and_consts(theirs)[0]
    return any(
        _literal_degree(a, b, nmb)
        for q, r in zip(mine.eqns, their.eqns, strict=False)
        for a, b in zip(q.invars, r.invars, strict=False)
    )


def _merge(*scalings: Scaling | None) -> Scaling | None:
    """One scaling for a value that may be any of ``scalings`` (a cond's branches, a loop's
    iterations): an unknown or extreme one wins, then the largest degree."""
    known = [s for s in scalings if s is not None]
    for flag in ("unknown", "extreme"):
        hit = next((s for s in known if getattr(s, flag)), None)
        if hit is not None:
            return hit
    top = max(known, key=lambda s: abs(s.degree), default=None)
    if top is not None and top.sum and not (len(known) == len(scalings) and all(s.sum for s in known)):
        top = dataclasses.replace(top, sum=False)  # a sum only where every one is
    return top


def _kind(s: Scaling | None) -> tuple[float, bool, bool] | None:
    return None if s is None else (s.degree, s.extreme, s.unknown)


def _reduces_batch(e: Any, other: Any, tainted: set[Any]) -> bool:
    """Whether ``e`` reads a value with a dim per example and makes values without one."""
    grown = any(
        not compat.is_literal(a) and a in tainted and a.aval.shape != b.aval.shape
        for a, b in zip(e.invars, other.invars, strict=True)
    )
    same = all(v.aval.shape == w.aval.shape for v, w in zip(e.outvars, other.outvars, strict=True))
    return grown and same


def sized_by_batch(e: Any, other: Any, nmb: int) -> bool:
    """Whether ``e`` and its twin differ only in literals that are the batch size's multiples
    (``jnp.var``'s count of elements): what :func:`scalings` accounts for."""
    pairs = [
        (a, b)
        for a, b in zip(e.invars, other.invars, strict=True)
        if compat.is_literal(a) or compat.is_literal(b)
    ]
    degrees = [_literal_degree(a, b, nmb) for a, b in pairs]
    same = [
        compat.is_literal(a) and compat.is_literal(b) and str(a) == str(b)
        for (a, b), d in zip(pairs, degrees, strict=True)
        if not d
    ]
    return any(degrees) and all(same) and str(e.params) == str(other.params)


def _literal(a: Any, b: Any, nmb: int, e: Any) -> Scaling | None:
    """A literal operand of ``e`` (``b`` in its twin) that is a multiple of the batch size
    or of its reciprocal: that degree."""
    degree = _literal_degree(a, b, nmb)
    return Scaling(degree, e) if degree else None


def _literal_degree(a: Any, b: Any, nmb: int) -> float:
    """1 for a literal that is the batch size's multiple (``b`` is ``a`` times ``nmb``), -1 for
    its reciprocal's, 0 otherwise."""
    if not (compat.is_literal(a) and compat.is_literal(b)):
        return 0.0
    try:
        x, y = float(compat.literal_value(a)), float(compat.literal_value(b))
    except (TypeError, ValueError):  # arrays, keys
        return 0.0
    if x == 0 or x == y:
        return 0.0
    ratio = y / x
    # Loosely: a bfloat16 batch size is rounded.
    return (
        1.0
        if math.isclose(ratio, nmb, rel_tol=0.02)
        else -1.0
        if math.isclose(ratio, 1 / nmb, rel_tol=0.02)
        else 0.0
    )


def is_float(var: Any) -> bool:
    """Whether ``var`` holds floating-point (or complex) values."""
    return bool(jax.dtypes.issubdtype(var.aval.dtype, jnp.inexact))


def _is_int(var: Any) -> bool:
    return bool(jax.dtypes.issubdtype(var.aval.dtype, jnp.integer))


def reads_as_figure(e: Any, whole_shape: Callable[[Any], tuple[int, ...] | None]) -> list[Any]:
    """The operands of ``e`` that a figure of the batch could weigh or place its results by: all
    but ``ragged_dot``'s group sizes where its left operand's ragged rows are the examples' (their
    dim longer at the whole batch, ``whole_shape``: a value's shape there, None if unknown): the
    sizes count those rows (a dropless mixture of experts' tokens sorted by expert), which are
    the microbatch's, so the count is too; the whole batch's would misplace them."""
    if e.primitive.name == "ragged_dot_general":
        lhs = e.invars[0]
        whole = None if compat.is_literal(lhs) else whole_shape(lhs)
        ragged = e.params["ragged_dot_dimension_numbers"].lhs_ragged_dimensions
        if whole is not None and any(whole[d] != lhs.aval.shape[d] for d in ragged):
            return list(e.invars[:2])
    return list(e.invars)


def _is_index(e: Any, operand: Any) -> bool:
    """Whether ``operand`` of ``e`` is an index or a count that places its results (a gather's
    or scatter's indices, a dynamic slice's start, whatever its results' type; ``ragged_dot``'s
    group sizes) rather than scales them: an integer operand of an equation with float results
    that does not convert it."""
    if compat.is_literal(operand):
        return False
    name = e.primitive.name
    placing = _PLACING.get("scatter" if name.startswith("scatter") else name)
    if placing is not None and any(a is operand for a in e.invars[slice(*placing)]):
        return True
    return (
        (_is_int(operand) or operand.aval.dtype == jnp.bool_)
        and name != "convert_element_type"
        and any(is_float(v) for v in e.outvars)
    )


def _degree(e: Any, degrees: list[float]) -> float:
    """The degree of ``e``'s outputs from its operands' ``degrees``."""
    name = e.primitive.name
    if name == "mul" or name == "dot_general":
        return degrees[0] + degrees[1]
    if name == "div":
        return degrees[0] - degrees[1]
    if name == "integer_pow":
        return degrees[0] * e.params["y"]
    if name == "sqrt":
        return degrees[0] / 2
    if name == "rsqrt":
        return -degrees[0] / 2
    return max(degrees, key=abs, default=0.0)  # sums, casts, reshapes, ... keep what they read
