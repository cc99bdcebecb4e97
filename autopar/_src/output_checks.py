"""Checks that the grad region's outputs can be made from the microbatches' values: the loss and
the aux outputs averaged over microbatches are means over the examples (not sums, extremes, or
terms scaled by a figure over the whole batch that is no mean), none pairs the examples with each
other, and an integer aux output or one reading the batch's shape is refused.
(:mod:`~autopar._src.region_outputs` makes them; :mod:`~autopar._src.batch_scaling` follows how
values scale with the batch.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

import numpy as np

from autopar._src import (
    batch_scaling,
    batch_statistics,
    compat,
    dependence,
    fixed_counts,
    layers,
    twin_traces,
)
from autopar._src.region_outputs import before_boundaries
from autopar._src.trace import TracedStep


def require_combinable(
    step: TracedStep,
    whole: TracedStep,
    batch_ids: Sequence[int],
    per_example: Mapping[int, int],
    nmb: int,
    whole_figures: Set[Any] = frozenset(),
    read_whole: Set[Any] = frozenset(),
) -> frozenset[int]:
    """Checks that every aux output reduced over the batch can be combined from microbatches:
    an integer, boolean or key one (the first microbatch's) reads nothing of the examples, and
    none reads the batch's shape (an examples-seen counter in a module's state). ``whole`` is
    the step traced at the whole batch, compared equation by equation (layer boundaries aside).
    ``whole_figures``: statistics of the batch (:mod:`~autopar._src.batch_statistics`): an aux
    output that is one of them is the whole batch's (the inputs' maximum, which every microbatch
    reads whole, or a token count, returned as made once per step): not checked. ``read_whole``:
    those every microbatch reads whole (the inputs' maximum or median, not a count it reads a
    share of): constants to the means check.

    Returns the indices among the region's outputs of those that are sums over the examples
    (``losses.sum()``), which the microbatches' values add up to: summed, not averaged.

    Raises:
      ValueError: naming the aux output and the source line.
    """
    at = step.region_index()
    region = step.jaxpr.eqns[at]
    num_aux = region.params["info"].num_aux
    name = region.params["info"].output_name
    rj = region.params["info"].jaxpr
    outer = step.derived({step.arg_vars[i] for i in batch_ids})
    tainted = {
        v
        for v, o in zip([*rj.constvars, *rj.invars], region.invars, strict=True)
        if not compat.is_literal(o) and o in outer
    }
    whole_rj = whole.jaxpr.eqns[whole.region_index()].params["info"].jaxpr
    theirs = [e for e in whole_rj.eqns if not layers.is_boundary(e)]
    for i in range(1, 1 + num_aux):  # a constant made from the batch's shape (its size)
        a, b = before_boundaries(rj, rj.outvars[i]), before_boundaries(whole_rj, whole_rj.outvars[i])
        if compat.is_literal(a) and compat.is_literal(b) and str(a) != str(b):
            raise ValueError(
                f"{name(i)} is the constant {_value(a)} for one of "
                f"num_microbatches={nmb} microbatches and {_value(b)} for the batch: it is made from the "
                "batch's shape (its size, say), and with microbatches it would be one microbatch's. "
                "Compute it outside the step, or use num_microbatches=1."
            )
    mine = [e for e in rj.eqns if not layers.is_boundary(e)]
    twin = twin_traces.twin_equations(mine, theirs, nmb)
    # tainted: made from the examples (or of a per-example shape); unsure: maybe (a while loop).
    unsure: set[Any] = set()

    def reads(e: Any, values: set[Any]) -> list[bool]:
        return [not compat.is_literal(a) and a in values for a in e.invars]

    for e in rj.eqns:
        if layers.is_boundary(e):  # an identity per value
            for seen in (tainted, unsure):
                seen.update(v for v, r in zip(e.outvars, reads(e, seen), strict=True) if r)
            continue
        other = twin.get(id(e))
        if other is not None:
            tainted.update(
                v for v, w in zip(e.outvars, other.outvars, strict=True) if v.aval.shape != w.aval.shape
            )
        out = dependence.eqn_depends(e, reads(e, tainted))
        if out is not None:
            tainted.update(v for v, f in zip(e.outvars, out, strict=True) if f)
        if out is None or any(reads(e, unsure)):
            unsure.update(e.outvars)
    combined: dict[Any, int] = {}  # aux outputs reduced over the batch: their index
    for i in range(1, 1 + num_aux):
        rv = rj.outvars[i]
        origin = before_boundaries(rj, rv)  # a constant (a literal) comes through boundaries too
        if i in per_example or compat.is_literal(origin) or origin in whole_figures:
            continue
        if not batch_scaling.is_float(rv) and rv in tainted:
            raise ValueError(
                f"{name(i)} ({rv.aval.str_short()}) is computed from the "
                f"examples, but a {rv.aval.dtype} value cannot be averaged over microbatches (with "
                f"num_microbatches={nmb} it would be one microbatch's). Return it as a float mean, or "
                "per example (concatenated), or use num_microbatches=1."
            )
        combined.setdefault(rv, i)
    means: set[Any] = set()  # averaged outputs that are means, batch-size literals and all
    summed: set[Any] = set()  # outputs that are sums over the examples: added up
    if twin:
        loss = {} if compat.is_literal(rj.outvars[0]) else {rj.outvars[0]: 0}
        _refuse_pairs(rj, twin, {**loss, **combined}, nmb, name)
        _refuse_roots_of_the_batch_size(rj, twin, nmb)
        # How the values the step passes in scale (a token count made before the loss function).
        # One extreme (the batch's maximum) is the whole batch's in every microbatch, as a
        # statistic (batch_statistics): a constant to them.
        before = batch_statistics.before_region(step, whole, {step.arg_vars[i] for i in batch_ids}, nmb)
        given = {v: s for v, s in before.given.items() if not s.extreme}
        # The model's values: the differentiated inputs, and what the step draws before the region.
        drawn = step.derived(
            {v for e in step.jaxpr.eqns[:at] if batch_statistics.draws(e) for v in e.outvars}
        )
        model = [*rj.invars[len(rj.invars) - region.params["info"].num_grads :]]
        model += [
            v
            for v, o in zip([*rj.constvars, *rj.invars], region.invars, strict=True)
            if not compat.is_literal(o) and o in drawn
        ]
        means, summed = _require_means(
            rj, twin, tainted, {**loss, **combined}, nmb, given, model, name, read_whole
        )
    touched = tainted | unsure
    for e in _slice(rj.eqns, set(combined)):  # one pass for all of them
        other = twin.get(id(e))
        if (
            other is None
            or any(reads(e, touched))
            or any(v in touched for v in e.outvars)
            or str(e) == str(other)
        ):
            continue
        reader = next(
            (
                k
                for rv, k in combined.items()
                if e in _slice(rj.eqns, {rv})
                and not (rv in means and batch_scaling.sized_by_batch(e, other, nmb))
            ),
            None,
        )
        if reader is None:  # a count of the batch's elements that a mean divides by (jnp.var)
            continue
        i = reader
        raise ValueError(
            f"{name(i)} ({rj.outvars[i].aval.str_short()}) reads the "
            f"batch's shape (at {compat.source_line(e)}: {str(e).splitlines()[0]!r} for one of "
            f"num_microbatches={nmb}, {str(other).splitlines()[0]!r} for the batch), e.g. an "
            "examples-seen counter in a module's state; with microbatches it would count one "
            "microbatch. Pass the count to the step as an argument, or use num_microbatches=1."
        )
    return frozenset(
        i for i in range(1 + num_aux) if not compat.is_literal(rj.outvars[i]) and rj.outvars[i] in summed
    )


def _require_divisors_of_the_batch(
    rj: Any,
    twin: Mapping[int, Any],
    found: batch_scaling.Found,
    averaged: Mapping[Any, int],
    nmb: int,
    model: Set[Any],
) -> None:
    """Checks that the loss and the averaged aux outputs divide by no sum over the examples of
    what the model computes or draws (``jnp.nanmean``'s count of the values that are not NaN, a
    batch dice's sum of the predictions): each microbatch would divide by its own. Sums of the
    batch alone (a masked mean's token count) are made once per step; means (a literal count)
    divide alike in every microbatch. ``model``: the values the model computes or draws."""
    for e in _slice(rj.eqns, set(averaged)):
        if e.primitive.name != "div" or compat.is_literal(e.invars[1]) or e.invars[1] not in model:
            continue
        scaling = found.get(e.invars[1])
        if scaling is None or scaling.unknown or scaling.extreme or not scaling.degree:
            continue
        origin, other = scaling.origin, twin.get(id(scaling.origin))
        if other is None or not any(
            not compat.is_literal(a) and a in model and twin_traces.per_example_dims(a, b, nmb)
            for a, b in zip(origin.invars, other.invars, strict=True)
        ):
            continue  # a sum of the batch alone (a token count) or a batch size, scaled by the model
        if fixed_counts.is_fixed_share(rj.eqns, twin, e.invars[1], nmb):
            continue  # every draw's the same (MAE's count of masked patches)
        raise ValueError(
            f"The loss function divides by a sum over the examples of what the model computes or "
            f"draws (at {compat.source_line(e)}: {str(e).splitlines()[0]!r}; the sum at "
            f"{compat.source_line(origin)}: {str(origin).splitlines()[0]!r}), such as the count of "
            "jnp.nanmean over values the model makes NaN or a dice loss's sums over the batch: with "
            f"num_microbatches={nmb} each microbatch would divide by its own, so neither the loss nor "
            "its gradients would be the whole batch's. Divide by a count of the batch alone "
            "(jnp.mean(l, where=m) or sum(l * m) / sum(m), with m from the labels), make the ratio "
            "per example, or use num_microbatches=1."
        )


def _model_values(rj: Any, model_inputs: Sequence[Any]) -> set[Any]:
    """The values of ``rj`` made from ``model_inputs`` (the region's inputs that are the model's
    or drawn), from draws or from the backward's cotangents."""
    model = set(model_inputs)
    for e in rj.eqns:
        batch_statistics.grow(e, model, drawn=True)
    return model


def _require_means(
    rj: Any,
    twin: Mapping[int, Any],
    tainted: set[Any],
    averaged: Mapping[Any, int],
    nmb: int,
    given: batch_scaling.Found,
    model_inputs: Sequence[Any],
    name: Callable[[int], str],
    read_whole: Set[Any] = frozenset(),
) -> tuple[set[Any], set[Any]]:
    """Checks that the loss and the averaged aux outputs are means over the examples, which
    averaging over microbatches gives exactly (see :mod:`~autopar._src.batch_scaling`; ``given``:
    the scalings of the region's inputs), dividing by no sum over the examples of the model's
    values (``model_inputs``: the region's inputs that are the model's or drawn; ``read_whole``:
    the statistics every microbatch reads whole, constants here); returns the float ones found
    to be, and those that are sums over the examples of terms per example (``Scaling.sum``)."""
    found = batch_scaling.scalings(rj.eqns, twin, tainted, nmb, given, read_whole)
    model = _model_values(rj, model_inputs)
    summed: set[Any] = set()
    for rv, i in averaged.items():
        scaling = found.get(rv) if batch_scaling.is_float(rv) else None
        if scaling is None or scaling.unknown:
            continue
        what = name(i)
        where = f"at {compat.source_line(scaling.origin)}: {str(scaling.origin).splitlines()[0]!r}"
        fix = "or use num_microbatches=1."
        if scaling.extreme and _meets_examples(rj, twin, scaling.origin):
            raise ValueError(
                f"{what} ({rv.aval.str_short()}) is made from the examples' values scaled by a "
                f"{scaling.origin.primitive.name} over the whole batch ({where}), such as a "
                "per-tensor quantization scale: with "
                f"num_microbatches={nmb} each microbatch would take it over its own examples. Take "
                f"it per example (over the example's own dims: a per-row or per-token scale), {fix}"
            )
        if scaling.extreme:
            raise ValueError(
                f"{what} ({rv.aval.str_short()}) is reduced over the examples by "
                f"{scaling.origin.primitive.name} ({where}), not by a mean, so averaging it over "
                f"num_microbatches={nmb} microbatches would not give the whole batch's value. Return "
                f"one value per example (concatenated), compute it outside the step, {fix}"
            )
        inner = _scaled_terms(scaling, found)
        if inner is not None and not any(v in model for v in inner.origin.outvars):
            made = f"at {compat.source_line(inner.origin)}: {str(inner.origin).splitlines()[0]!r}"
            raise ValueError(
                f"{what} ({rv.aval.str_short()}) reduces over the examples ({where}) terms that "
                f"depend on a figure of the batch alone ({made}) through a power that is no whole "
                "number or another nonlinear function, such as class-balanced weights 1/sqrt(n) or "
                f"effective numbers (1 - b) / (1 - b**n) of label counts: with num_microbatches={nmb} "
                "each microbatch reads its share of the count, so the weights would not be the whole "
                "batch's. Weigh by the count itself (sum(l / n[y]) / C), pass the weights in the batch "
                f"(made in the data pipeline), {fix}"
            )
        if inner is not None:
            made = f"at {compat.source_line(inner.origin)}: {str(inner.origin).splitlines()[0]!r}"
            raise ValueError(
                f"{what} ({rv.aval.str_short()}) reduces over the examples ({where}) terms that "
                f"depend on a figure over the whole batch that is no mean ({made}): a norm over the "
                "batch of what the model computes, such as an adaptive ODE solver's error norm. With "
                f"num_microbatches={nmb} each microbatch "
                "would make it from its own examples, so neither the loss nor its gradients would be "
                "the whole batch's. Make it per example (jax.vmap the computation over the "
                f"examples), {fix}"
            )
        if scaling.degree == 1 and scaling.sum:
            summed.add(rv)
            continue
        grows = (
            f"a sum over the examples ({where}): averaged over num_microbatches={nmb} microbatches "
            f"it would come back divided by {nmb}"
            if scaling.degree == 1
            else f"proportional to the batch size to the power {scaling.degree:g} ({where}): "
            "averaged over microbatches it would not be the whole batch's value"
        )
        also = ", and so would the gradients" if i == 0 else ""
        raise ValueError(
            f"{what} ({rv.aval.str_short()}) is {grows}{also}. Divide it by the batch size as "
            "the step sees it (jnp.mean rather than jnp.sum, or x.shape[0], not a constant of the "
            "configuration: each microbatch holds fewer examples) or, for a sum over padded "
            "tokens, by their count (the masked mean sum(l * m) / sum(m), which is the whole "
            "batch's with microbatches), "
            f"return one value per example, {fix}"
        )
    _require_divisors_of_the_batch(rj, twin, found, averaged, nmb, model)
    return {rv for rv in averaged if batch_scaling.is_float(rv) and found.get(rv) is None}, summed


def _refuse_roots_of_the_batch_size(rj: Any, twin: Mapping[int, Any], nmb: int) -> None:
    """Raises if an equation of the loss function reads a literal that is the square root of a
    figure of the batch's size, or its reciprocal (``1 / np.sqrt(x.size)``, LSQ's gradient scale):
    at one microbatch it is ``sqrt(num_microbatches)`` times another than at the whole batch, so
    what it scales (a gradient, where it is taken under ``stop_gradient`` and added back) is not
    ``jax.jit``'s whatever the microbatches' results are combined by."""
    root = math.sqrt(nmb)
    for e in rj.eqns:
        other = twin.get(id(e))
        if other is None:
            continue
        for a, b in zip(e.invars, other.invars, strict=True):
            if not (compat.is_literal(a) and compat.is_literal(b)):
                continue
            try:
                x, y = float(compat.literal_value(a)), float(compat.literal_value(b))
            except (TypeError, ValueError):  # arrays, keys
                continue
            if x == 0 or x == y or not any(math.isclose(y / x, r, rel_tol=1e-3) for r in (root, 1 / root)):
                continue
            raise ValueError(
                f"The loss function reads a square root of the batch's size (at "
                f"{compat.source_line(e)}: {str(e).splitlines()[0]!r} for one of "
                f"num_microbatches={nmb}, {str(other).splitlines()[0]!r} for the batch), such as "
                "LSQ's gradient scale 1 / sqrt(x.size): with microbatches it would be the "
                "microbatch's, and what it scales (a gradient taken under stop_gradient) would not be "
                "the whole batch's. Take it from the sizes of an example's dims (x[0].size), pass it "
                "in, or use num_microbatches=1."
            )


def _meets_examples(rj: Any, twin: Mapping[int, Any], origin: Any) -> bool:
    """Whether what ``origin`` (an equation of ``rj`` reducing over the batch) makes is read by
    an equation of ``rj`` together with a value that holds the examples (its shape follows the
    batch: it differs from its twin's) into a float value."""
    made = set(origin.outvars)
    for e in rj.eqns:
        if not any(not compat.is_literal(a) and a in made for a in e.invars):
            continue
        other = twin.get(id(e))
        if other is not None and any(
            a.aval.shape != b.aval.shape for a, b in zip(e.invars, other.invars, strict=True)
        ):
            if any(batch_scaling.is_float(v) for v in e.outvars):
                return True
            continue  # compared with them: where a maximum sits (its derivative's mask)
        made.update(  # the figure carried on, before it meets them (``keepdims``, a scale)
            v
            for k, v in enumerate(e.outvars)
            if not compat.is_dropvar(v)
            and (not v.aval.shape or (other is not None and v.aval.shape == other.outvars[k].aval.shape))
        )
    return False


def _scaled_terms(scaling: batch_scaling.Scaling, found: batch_scaling.Found) -> batch_scaling.Scaling | None:
    """The earliest figure over the batch that grows with it and that the terms reduced by
    ``scaling``'s equation already depend on (they are no example's own), or None where that
    equation reduces terms of the examples alone."""
    root, seen = None, set()
    current = scaling
    while id(current.origin) not in seen:
        seen.add(id(current.origin))
        inner = [
            found[a]
            for a in current.origin.invars
            if not compat.is_literal(a)
            and a in found
            and found[a].origin is not current.origin
            and not (found[a].extreme or found[a].unknown)
            and found[a].degree != 0
        ]
        if not inner:
            break
        current = root = inner[0]
    return root


def _refuse_pairs(
    rj: Any, twin: Mapping[int, Any], averaged: Mapping[Any, int], nmb: int, name: Callable[[int], str]
) -> None:
    """Raises if the loss or an averaged aux output is made from a float value that pairs the
    examples with each other (``img @ txt.T``, ``x[:, None] - x[None]``: two dims per example,
    where each of the equation's operands has at most one), as a contrastive loss's in-batch
    negatives do: each microbatch would pair only its own examples."""
    for rv, i in averaged.items():
        for outer in reversed(_slice(rj.eqns, {rv})):  # _slice lists them last first
            other = twin.get(id(outer))
            e = None if other is None else _pairing(outer, other, nmb)
            if e is not None:
                what = name(i)
                raise ValueError(
                    f"{what} ({rv.aval.str_short()}) pairs the examples with each other: at "
                    f"{compat.source_line(e)} ({str(e).splitlines()[0]!r}) every example meets "
                    "every other, as a contrastive loss's in-batch negatives do. With "
                    f"num_microbatches={nmb} each microbatch would pair only its own examples, so "
                    "neither the loss nor its gradients would be the whole batch's. Use "
                    "num_microbatches=1."
                )


def _pairing(e: Any, other: Any, nmb: int) -> Any:
    """The float equation, ``e`` or one inside its body (a rematerialised call, a ``custom_jvp``
    or ``custom_vjp`` function), that makes two per-example dims from operands with at most one
    each (``other``: ``e``'s twin in the whole batch's trace); None if there is none."""
    body, twin_body = compat.operand_body(e), compat.operand_body(other)
    if body is not None and twin_body is not None:
        pairs = list(zip(body.eqns, twin_body.eqns, strict=False))
        if len(body.eqns) == len(twin_body.eqns) and all(q.primitive is r.primitive for q, r in pairs):
            return next((found for q, r in pairs if (found := _pairing(q, r, nmb)) is not None), None)
        return None
    if not any(batch_scaling.is_float(v) for v in e.outvars):
        return None
    dims = twin_traces.per_example_dims
    operands = [
        len(dims(a, b, nmb)) for a, b in zip(e.invars, other.invars, strict=True) if not compat.is_literal(a)
    ]
    made = max((len(dims(v, w, nmb)) for v, w in zip(e.outvars, other.outvars, strict=True)), default=0)
    return e if made >= 2 and max(operands, default=0) < 2 else None


def _value(literal: Any) -> Any:
    return np.asarray(compat.literal_value(literal)).tolist()


def _slice(eqns: Sequence[Any], roots: set[Any]) -> list[Any]:
    """The equations (layer boundaries aside) that the values ``roots`` are computed from."""
    needed, found = set(roots), []
    for e in reversed(eqns):
        if not any(v in needed for v in e.outvars if not compat.is_dropvar(v)):
            continue
        if layers.is_boundary(e):  # an identity per value
            needed.update(
                a
                for a, v in zip(e.invars, e.outvars, strict=True)
                if v in needed and not compat.is_literal(a)
            )
            continue
        needed.update(a for a in e.invars if not compat.is_literal(a))
        found.append(e)
    return found
