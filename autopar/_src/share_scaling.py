"""Whether the loss function uses the statistics' shares so that microbatches average to
``jax.jit``'s loss.

A statistic of the batch of degree ``d`` (:mod:`~autopar._src.batch_statistics`: a token count
has degree 1) is handed to each microbatch as its share, the whole batch's value divided by
``num_microbatches ** d``: ``mu ** d`` times it, with ``mu = 1 / num_microbatches``. Where the
loss is a sum over the microbatch's examples of terms that are each ``mu ** -1`` times the term
the whole batch's step computes (a masked mean ``sum(l * m) / n``, a class-balanced loss
``sum(l / n[y])``), the average of the microbatches' losses is the whole batch's. That holds
where every value made from a share is a *monomial* in ``mu`` (``mu ** h`` times a value that
does not depend on ``mu``: products, quotients, gathers, sums and casts of monomials are), or a
sum of monomials read only linearly. It fails where a share meets anything nonlinearly: a
constant added and then divided by (``l / (n[y] + 1)``), compared with a constant other than 0
(``n > 3``), a transcendental function (``exp(loss)``, a perplexity). Those are refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar._src import batch_scaling, compat, fusion, layers
from autopar._src.batch_statistics import Statistics
from autopar._src.trace import TracedStep

MIXED = "mixed"
"""A sum of monomials of different degrees (``l.mean() + sum(l * m) / n``): read linearly only."""

_LAYOUT = fusion.LAYOUT_PRIMITIVES | {"broadcast_in_dim", "transpose", "slice", "rev"}
_KEEP = _LAYOUT | {
    "neg",
    "abs",
    "copy",
    "copy_p",
    "convert_element_type",
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "cumsum",
    "cummax",
    "cummin",
    "reduce_precision",
    "real",
    "imag",
    "conj",
}
"""Primitives whose results scale as their (first) operand: ``c * x`` for ``c`` in ``x``."""
_PLACING = {"gather": (0,), "dynamic_slice": (0,), "scatter": (0, 2), "dynamic_update_slice": (0, 1)}
"""Primitives that place their data operands' values (by position here) at their other operands
(indices, starts), keeping their scaling."""
_SUMMING = frozenset({"add", "sub", "add_any", "concatenate", "stack", "pad"})
_ORDERING = frozenset({"max", "min", "clamp"})
_COMPARING = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
_INVARIANT = frozenset({"sign", "argmax", "argmin"})
"""Primitives whose results do not change when their operand is scaled by a positive number."""
_POWERS = {"integer_pow": None, "square": 2.0, "sqrt": 0.5, "rsqrt": -0.5}


ZERO = "zero"
"""Zeros made from no share (``jnp.zeros``, a scatter-add's start): of every degree."""


class Nonlinear(Exception):
    """An equation applies something other than a monomial's rules to a value made from a share."""


def require_linear_in_shares(step: TracedStep, stats: Statistics, averaged: Sequence[int]) -> None:
    """Raises if an averaged output of the grad region of ``step`` (``averaged``: their indices;
    the loss is 0) is made from a statistic's share otherwise than as a monomial's rules allow
    (see the module's docstring): ``exp(loss)`` of a masked mean, a perplexity, ``n > 3``.

    Raises:
      ValueError: naming the output, the equation and its source line.
    """
    if not stats.shares:
        return
    region = step.jaxpr.eqns[step.region_index()]
    rj = region.params["info"].jaxpr
    # Every statistic is read in place of what the microbatch makes: a share, or the whole
    # batch's value (of degree 0).
    given = {v: stats.shares.get(v, 0.0) for v in stats.values}
    for v, o in zip([*rj.constvars, *rj.invars], region.invars, strict=True):
        if not compat.is_literal(o) and o in stats.values:  # made before the region
            given[v] = stats.shares.get(o, 0.0)
    _, refused = degrees(rj.eqns, given)
    if not refused:
        return
    for i in averaged:
        needed = {rj.outvars[i]} - {a for a in rj.outvars[i : i + 1] if compat.is_literal(a)}
        hit = None
        for e in reversed(rj.eqns):
            made = [k for k, v in enumerate(e.outvars) if v in needed]
            if not made:
                continue
            if layers.is_boundary(e):
                needed.update(e.invars[k] for k in made if not compat.is_literal(e.invars[k]))
                continue
            hit = e if id(e) in refused else hit
            needed.update(a for a in e.invars if not compat.is_literal(a))
        if hit is not None:
            what = region.params["info"].output_name(i)
            raise ValueError(
                f"{what} applies {hit.primitive.name} (at {compat.source_line(hit)}) to a value made "
                "with a figure of the whole batch (a token count, made once per step): each "
                "microbatch holds its share of that figure, and only products, quotients and sums "
                "of the shares with the examples' values average to jax.jit's value, not a constant "
                "added to a share, a share compared with a constant other than 0 or a nonlinear "
                "function (exp of a masked mean). Return the value itself and apply the function "
                "after the step (perplexity = exp(loss)), or use num_microbatches=1."
            )


def degrees(eqns: Sequence[Any], given: Mapping[Any, Any]) -> tuple[dict[Any, Any], dict[int, Any]]:
    """The degree in ``mu`` of each value of ``eqns`` made from a share (``given``: the shares'
    degrees): a float for a monomial, :data:`MIXED` for a sum of them. Returns them and the
    equations that combine them otherwise (``id`` -> the equation), whose results are left out.
    What the backward's cotangent seed makes is skipped."""
    found: dict[Any, Any] = dict(given)
    refused: dict[int, Any] = {}
    backward: set[Any] = set()
    for e in eqns:
        ins = [a for a in e.invars if not compat.is_literal(a)]
        outs = [v for v in e.outvars if not compat.is_dropvar(v)]
        if e.primitive is layers.cotangent_seed_p or any(a in backward for a in ins):
            backward.update(outs)
            continue
        if outs and all(v in given for v in outs):  # read in place of what this makes
            continue
        if _zeros(e, found):
            found.update((v, ZERO) for v in outs)
            continue
        if not any(a in found and found[a] != ZERO for a in ins):
            continue
        if layers.is_boundary(e):  # an identity per value
            found.update(
                (v, found[a])
                for a, v in zip(e.invars, e.outvars, strict=True)
                if not compat.is_literal(a) and a in found
            )
            continue
        try:
            made = _eqn(e, found)
        except Nonlinear:
            refused[id(e)] = e
            continue
        found.update(zip(e.outvars, made, strict=True))
    return found, refused


def _zeros(e: Any, found: Mapping[Any, Any]) -> bool:
    """Whether ``e`` makes zeros from zeros alone (``jnp.zeros``: a literal 0 broadcast)."""
    return (
        e.primitive.name in _LAYOUT | {"convert_element_type"}
        and bool(e.invars)
        and all(_zero(found, a) for a in e.invars)
    )


def _of(found: Mapping[Any, Any], a: Any) -> Any:
    """``a``'s degree: 0 for what is made from no share (a literal, the model's values) and for
    zeros."""
    d = 0.0 if compat.is_literal(a) else found.get(a, 0.0)
    return 0.0 if d == ZERO else d


def _zero(found: Mapping[Any, Any], a: Any) -> bool:
    """Whether ``a`` is a literal 0 or zeros."""
    if not compat.is_literal(a):
        return found.get(a) == ZERO
    try:
        return float(compat.literal_value(a)) == 0.0
    except (TypeError, ValueError):  # arrays
        return False


def _alike(found: Mapping[Any, Any], operands: Sequence[Any]) -> Any:
    """The one degree of ``operands`` (zeros have every degree), :data:`MIXED` where they
    differ."""
    ds = {_of(found, a) for a in operands if not _zero(found, a)}
    if MIXED in ds or len(ds) > 1:
        return MIXED
    return ds.pop() if ds else 0.0


def _alike_in(walked: Sequence[tuple[Mapping[Any, Any], Sequence[Any]]], k: int) -> Any:
    """The one degree of the ``k``-th results of a ``cond``'s branches (``walked``: each branch's
    degrees and results), :data:`MIXED` where they differ."""
    ds = {_of(inner, outs[k]) for inner, outs in walked if not _zero(inner, outs[k])}
    if MIXED in ds or len(ds) > 1:
        return MIXED
    return ds.pop() if ds else 0.0


def _monomial(found: Mapping[Any, Any], operands: Sequence[Any]) -> float:
    d = _alike(found, operands)
    if d == MIXED:
        raise Nonlinear
    return float(d)


def _eqn(e: Any, found: Mapping[Any, Any]) -> list[Any]:
    name, ins = e.primitive.name, e.invars
    n = len(e.outvars)
    if name in ("mul", "dot_general"):
        a, b = _of(found, ins[0]), _of(found, ins[1])
        return [MIXED if MIXED in (a, b) else a + b] * n
    if name == "div":
        a, b = _of(found, ins[0]), _of(found, ins[1])
        if b == MIXED:
            raise Nonlinear
        return [MIXED if a == MIXED else a - b] * n
    if name in _SUMMING:
        return [_alike(found, ins)] * n
    if name == "select_n":
        if _of(found, ins[0]) != 0.0:
            raise Nonlinear
        return [_alike(found, ins[1:])] * n
    if name in _ORDERING:
        return [_monomial(found, ins)] * n
    if name in _COMPARING:
        _monomial(found, ins)
        return [0.0] * n
    if name in _INVARIANT:
        _monomial(found, ins[:1])
        return [0.0] * n
    if name in _POWERS:
        power = _POWERS[name]
        power = float(e.params["y"]) if power is None else power
        return [_monomial(found, ins[:1]) * power] * n
    data = _PLACING.get("scatter" if name.startswith("scatter") else name)
    if data is not None:
        if any(_of(found, a) != 0.0 for k, a in enumerate(ins) if k not in data):
            raise Nonlinear
        return [_alike(found, [ins[k] for k in data])] * n
    if name == "convert_element_type" and not batch_scaling.is_float(e.outvars[0]):
        if _of(found, ins[0]) != 0.0:
            raise Nonlinear  # a share cast to an integer: rounded
        return [0.0] * n
    if name in _KEEP:
        return [_of(found, ins[0])] * n
    if name == "sort":  # the keys' order is their order scaled
        keys = ins[: e.params.get("num_keys", 1)]
        _monomial(found, keys)
        return [_of(found, a) for a in ins]
    body = compat.operand_body(e)  # a nested jit, a remat, a custom_jvp/vjp primal
    if body is not None:
        inner, refused = degrees(body.eqns, {v: _of(found, a) for v, a in zip(body.invars, ins, strict=True)})
        if refused:
            raise Nonlinear
        return [_of(inner, v) for v in body.outvars]
    branches = compat.cond_branches(e)
    if branches is not None and _of(found, ins[0]) == 0.0 and not any(c for _, c in branches):
        # A cond on what no share scales (or a comparison with 0): each branch's results.
        walked = []
        for body, _ in branches:
            inner, refused = degrees(
                body.eqns, {v: _of(found, a) for v, a in zip(body.invars, ins[1:], strict=True)}
            )
            if refused:
                raise Nonlinear
            walked.append((inner, body.outvars))
        return [_alike_in(walked, k) for k in range(n)]
    # Anything else (a transcendental function, a loop): only of values no share scales.
    if any(_of(found, a) != 0.0 for a in ins):
        raise Nonlinear
    return [0.0] * n
