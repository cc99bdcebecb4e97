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
from collections.abc import Mapping, Sequence
from typing import Any

from autopar._src import (
    batch_scaling,
    compat,
    layers,
    partial_chains,
)
from autopar._src.program import Op
from autopar._src.trace import TracedStep


@dataclasses.dataclass(frozen=True)
class Joined:
    """The whole batch's value of a per-example region output: ``var`` (of the whole batch's
    shape), its microbatches' values joined along ``axis``."""

    var: Any
    axis: int


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


def before_boundaries(jaxpr: Any, atom: Any) -> Any:
    """What ``atom`` of ``jaxpr`` is before the layer boundaries (identities) it went through."""
    made = {v: (e, k) for e in jaxpr.eqns if layers.is_boundary(e) for k, v in enumerate(e.outvars)}
    while not compat.is_literal(atom) and atom in made:
        e, k = made[atom]
        atom = e.invars[k]
    return atom
