"""How the grad region's outputs (the loss, its aux outputs, the gradients) become one value per
step from the microbatches' values: a running sum divided once per step, the first microbatch's
value for what cannot be averaged, or, for an output with a value per example (an aux output,
or the gradient of a batch input), the
microbatches' values concatenated. A sum of values made in several tasks (the gradient of a
weight tied across stages) has a running sum per task, added up once per step
(:class:`SplitSum`).

Accumulator keys are ``(var, ("acc", j))``: the running sum (or kept value) after microbatch
``j`` (:mod:`autopar._src.program`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence, Set
from typing import Any

import numpy as np

from autopar._src import (
    batch_scaling,
    batch_statistics,
    compat,
    dependence,
    layers,
    partial_chains,
    twin_traces,
)
from autopar._src.program import Op
from autopar._src.trace import TracedStep


@dataclasses.dataclass(frozen=True)
class Joined:
    """The whole batch's value of a per-example region output: ``var`` (of the whole batch's
    shape), its microbatches' values joined along ``axis``."""

    var: Any
    axis: int


def named(index: int, num_aux: int) -> str:
    """How errors name the grad region's output ``index`` (after the value: aux, then gradients)."""
    return (
        f"Aux output {index - 1}"
        if index <= num_aux
        else f"The gradient of differentiated leaf {index - 1 - num_aux}"
    )


def joined_outputs(step: TracedStep, per_example: Mapping[int, int], nmb: int) -> dict[Any, Joined]:
    """:class:`Joined` of each per-example output of the grad region (``per_example``: index
    into its outputs -> batch dim). Code after the region that reads one runs at the whole batch
    (:mod:`~autopar._src.whole_batch`)."""
    at = step.region_index()
    assert at is not None, "per-example outputs come from a gradient region"
    region = step.jaxpr.eqns[at]
    joined = {}
    for i, axis in per_example.items():
        ov = region.outvars[i]
        shape = list(ov.aval.shape)
        shape[axis] *= nmb
        var = compat.Var(ov.aval.update(shape=tuple(shape)))
        joined[ov] = Joined(var=var, axis=axis)
    return joined


def accumulator_ends(
    ov: Any, nmb: int, joined: Joined | None = None, *, gradient: bool = False
) -> tuple[list[Op], list[Op]]:
    """Once-per-step ops that start (zeros) and finish (mean, or concatenation for a per-example
    output) a region output's sum. A ``gradient``'s sum is its value: each microbatch's backward
    starts from ``1 / nmb`` (:data:`~autopar._src.layers.cotangent_seed_p`)."""
    if nmb == 1:
        return [], []
    if joined is not None:
        parts = tuple((ov, ("acc", j)) for j in range(nmb))
        concat = Op(
            kind="acc",
            mode="concat",
            ins=parts,
            outs=((joined.var, None),),
            axis=joined.axis,
        )
        return [], [concat]
    last = (ov, ("acc", nmb - 1))
    if not batch_scaling.is_float(ov):
        # The first microbatch's: it reads the step's PRNG keys unfolded (microbatch_keys).
        return [], [Op(kind="acc", mode="copy", ins=((ov, ("acc", 0)),), outs=((ov, None),))]
    start = Op(kind="acc", mode="zeros", ins=(), outs=((ov, ("acc", -1)),), aval=ov.aval)
    finish = Op(kind="acc", mode="mean", ins=(last,), outs=((ov, None),), divisor=1 if gradient else nmb)
    return [start], [finish]


def accumulate(
    val: Any, ov: Any, j: int, nmb: int, per_example: bool = False, more: Sequence[Any] = ()
) -> Op:
    """The op that folds microbatch ``j``'s value of a region output (plus ``more`` values, of a
    :class:`SplitSum`'s part) into its sum.

    The same op for every microbatch, so all microbatches share one executable.
    Integers, booleans and keys cannot be averaged: the first microbatch's value is
    kept. A per-example output keeps every microbatch's value, to be concatenated.
    """
    if nmb == 1:
        return Op(kind="acc", mode="copy", ins=(val,), outs=((ov, None),))
    if not batch_scaling.is_float(ov) or per_example:
        return Op(kind="acc", mode="copy", ins=(val,), outs=((ov, ("acc", j)),))
    return Op(kind="acc", mode="add", ins=((ov, ("acc", j - 1)), val, *more), outs=((ov, ("acc", j)),))


@dataclasses.dataclass(frozen=True)
class SplitSum:
    """A float region output that adds up values made in different tasks (the gradient of a
    weight tied across stages). The sum is linear, so each task keeps a running sum of its own
    values over the microbatches and the tasks' finished sums (means, for aux outputs) are added
    once per step: nothing crosses stages per microbatch, and each running sum is a gradient the
    driver may defer."""

    output: Any
    """The region output (an outer variable)."""
    parts: tuple[tuple[tuple[Any, ...], Any], ...]
    """Per task: the values it adds (of the region's jaxpr) and the fresh variable that names
    their running sum and its mean."""
    adds: tuple[Any, ...]
    """The additions of the values, which no microbatch runs."""

    def combine(self) -> Op:
        """The once-per-step op that adds the parts' finished sums into the output."""
        return Op(
            kind="acc",
            mode="sum",
            ins=tuple((acc, None) for _, acc in self.parts),
            outs=((self.output, None),),
        )


def split_sums(
    region_jaxpr: Any, outputs: Sequence[tuple[Any, Any]], made_in: Mapping[Any, Any]
) -> dict[Any, SplitSum]:
    """The :class:`SplitSum` of every float output in ``outputs`` (``(value, region output)``
    pairs) whose value is a tree of additions, each read only by the next, over values made in
    more than one task (``made_in``: a value's ``(stage, pass)``), by output."""
    producer = {v: e for e in region_jaxpr.eqns for v in e.outvars}
    reads = Counter(a for e in region_jaxpr.eqns for a in e.invars if not compat.is_literal(a))
    reads.update(a for a in region_jaxpr.outvars if not compat.is_literal(a))
    found: dict[Any, SplitSum] = {}
    for rv, ov in outputs:
        if compat.is_literal(rv) or not batch_scaling.is_float(rv):
            continue
        adds, values = _addition_tree(rv, producer, reads)
        if not adds or not all(v in made_in for v in values):
            continue
        by_task: dict[Any, list[Any]] = {}
        for v in values:
            by_task.setdefault(made_in[v], []).append(v)
        if len(by_task) > 1:
            parts = tuple((tuple(vs), compat.Var(vs[0].aval)) for vs in by_task.values())
            found[ov] = SplitSum(output=ov, parts=parts, adds=tuple(adds))
    return found


def _addition_tree(
    value: Any, producer: Mapping[Any, Any], reads: Counter[Any]
) -> tuple[list[Any], list[Any]]:
    """The additions that make ``value``, each read only by the next (operands first), and the
    values they add (a value added twice, twice)."""
    adds: list[Any] = []
    values: list[Any] = []

    def expand(v: Any) -> None:
        e = producer.get(v)
        if e is not None and reads[v] == 1 and partial_chains.joins(e, e.invars):
            for a in e.invars:
                expand(a)
            adds.append(e)
        else:  # as often as it is added
            values.append(v)

    expand(value)
    return adds, values


def require_combinable(
    step: TracedStep,
    whole: TracedStep,
    batch_ids: Sequence[int],
    per_example: Mapping[int, int],
    nmb: int,
    whole_figures: Set[Any] = frozenset(),
) -> None:
    """Checks that every aux output reduced over the batch can be combined from microbatches:
    an integer, boolean or key one (the first microbatch's) reads nothing of the examples, and
    none reads the batch's shape (an examples-seen counter in a module's state). ``whole`` is
    the step traced at the whole batch, compared equation by equation (layer boundaries aside).
    ``whole_figures``: statistics of the batch (:mod:`~autopar._src.batch_statistics`): an aux
    output that is one of them is the whole batch's (the inputs' maximum, which every microbatch
    reads whole, or a token count, returned as made once per step): not checked.

    Raises:
      ValueError: naming the aux output and the source line.
    """
    at = step.region_index()
    region = step.jaxpr.eqns[at]
    num_aux = region.params["info"].num_aux
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
                f"Aux output {i - 1} of the loss function is the constant {_value(a)} for one of "
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
                f"Aux output {i - 1} of the loss function ({rv.aval.str_short()}) is computed from the "
                f"examples, but a {rv.aval.dtype} value cannot be averaged over microbatches (with "
                f"num_microbatches={nmb} it would be one microbatch's). Return it as a float mean, or "
                "per example (concatenated), or use num_microbatches=1."
            )
        combined.setdefault(rv, i)
    means: set[Any] = set()  # averaged outputs that are means, batch-size literals and all
    if twin:
        loss = {} if compat.is_literal(rj.outvars[0]) else {rj.outvars[0]: 0}
        _refuse_pairs(rj, twin, {**loss, **combined}, nmb)
        # How the values the step passes in scale (a token count made before the loss function).
        # One extreme (the batch's maximum) is the whole batch's in every microbatch, as a
        # statistic (batch_statistics): a constant to them.
        before = batch_statistics.before_region(step, whole, {step.arg_vars[i] for i in batch_ids}, nmb)
        given = {v: s for v, s in before.given.items() if not s.extreme}
        means = _require_means(rj, twin, tainted, {**loss, **combined}, nmb, given)
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
            f"Aux output {i - 1} of the loss function ({rj.outvars[i].aval.str_short()}) reads the "
            f"batch's shape (at {compat.source_line(e)}: {str(e).splitlines()[0]!r} for one of "
            f"num_microbatches={nmb}, {str(other).splitlines()[0]!r} for the batch), e.g. an "
            "examples-seen counter in a module's state; with microbatches it would count one "
            "microbatch. Pass the count to the step as an argument, or use num_microbatches=1."
        )


def _require_means(
    rj: Any,
    twin: Mapping[int, Any],
    tainted: set[Any],
    averaged: Mapping[Any, int],
    nmb: int,
    given: batch_scaling.Found,
) -> set[Any]:
    """Checks that the loss and the averaged aux outputs are means over the examples, which
    averaging over microbatches gives exactly (see :mod:`~autopar._src.batch_scaling`; ``given``:
    the scalings of the region's inputs); returns the float ones found to be."""
    found = batch_scaling.scalings(rj.eqns, twin, tainted, nmb, given)
    for rv, i in averaged.items():
        scaling = found.get(rv) if batch_scaling.is_float(rv) else None
        if scaling is None or scaling.unknown:
            continue
        what = "The loss" if i == 0 else f"Aux output {i - 1} of the loss function"
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
        grows = (
            f"a sum over the examples ({where}): averaged over num_microbatches={nmb} microbatches "
            f"it would come back divided by {nmb}"
            if scaling.degree == 1
            else f"proportional to the batch size to the power {scaling.degree:g} ({where}): "
            "averaged over microbatches it would not be the whole batch's value"
        )
        also = ", and so would the gradients" if i == 0 else ""
        raise ValueError(
            f"{what} ({rv.aval.str_short()}) is {grows}{also}. Divide it by the batch size "
            f"(jnp.mean rather than jnp.sum) or, for a sum over padded tokens, by their count (the "
            f"masked mean sum(l * m) / sum(m), which is the whole batch's with microbatches), "
            f"return one value per example, {fix}"
        )
    return {rv for rv in averaged if batch_scaling.is_float(rv) and found.get(rv) is None}


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


def _refuse_pairs(rj: Any, twin: Mapping[int, Any], averaged: Mapping[Any, int], nmb: int) -> None:
    """Raises if the loss or an averaged aux output is made from a float value that pairs the
    examples with each other (``img @ txt.T``, ``x[:, None] - x[None]``: two dims per example,
    where each of the equation's operands has at most one), as a contrastive loss's in-batch
    negatives do: each microbatch would pair only its own examples."""
    for rv, i in averaged.items():
        for outer in reversed(_slice(rj.eqns, {rv})):  # _slice lists them last first
            other = twin.get(id(outer))
            e = None if other is None else _pairing(outer, other, nmb)
            if e is not None:
                what = "The loss" if i == 0 else f"Aux output {i - 1} of the loss function"
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


def before_boundaries(jaxpr: Any, atom: Any) -> Any:
    """What ``atom`` of ``jaxpr`` is before the layer boundaries (identities) it went through."""
    made = {v: (e, k) for e in jaxpr.eqns if layers.is_boundary(e) for k, v in enumerate(e.outvars)}
    while not compat.is_literal(atom) and atom in made:
        e, k = made[atom]
        atom = e.invars[k]
    return atom


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
