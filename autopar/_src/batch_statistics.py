"""Statistics of the batch inside the loss function, computed from the whole batch.

The loss function runs once per microbatch and the microbatches' losses are averaged. That is
the whole batch's loss when the loss is a mean of per-example terms; it is not when those terms
are weighed by a figure of the batch itself: a masked mean's token count (``sum(l * m) /
sum(m)``: a microbatch holding more padding than another would count as much), inputs
standardised by ``x.mean(0)``, scaled by ``x.max()``. Such a figure depends on the batch alone,
not on what is differentiated, so it can be computed once per step from the whole batch, before
the pipeline, and handed to every microbatch in place of its own: each microbatch then computes
its share of ``jax.jit``'s loss.

A *statistic* is a value of the loss function's forward, at its top level, that

- depends on the batch's leaves, and otherwise only on what every microbatch shares (literals,
  the step's constants, its arguments outside the batch, e.g. a class-weight table in the
  state): not on the differentiated inputs (a batch leaf among them too), what the step makes
  from the batch with random draws, random draws or the backward's cotangents;
- has no dim per example (the two traces, at one microbatch and at the whole batch, give it one
  shape);
- is read by an equation that makes something else (where the batch's figure meets the model
  or the examples), a layer boundary, or the region's outputs.

Its value at the whole batch comes from the twins of the equations that make it in the step
traced at the whole batch, reading the batch's leaves joined from the microbatches. A sum over
the examples (degree one in :mod:`~autopar._src.batch_scaling`) is handed over divided by the
number of microbatches, so the microbatch sees what its share of the batch would sum to, and the
average of the microbatches' losses is the whole batch's: for the masked mean, each microbatch
computes ``num_microbatches * sum_j(l * m) / sum(m)``. One of degree ``d`` is divided by
``num_microbatches ** d`` likewise (``1 / sum(m)`` multiplied); a mean, a maximum or one
example's value (degree zero) is handed over as it is, integers and booleans too (``n > 0``).
An integer one of another degree (``jnp.bincount(y)``) has no integer share, and one made where
the check does not follow how it scales (a loop whose carries neither add up nor settle) none
known: both are errors. One whose degree is not a whole number (``sqrt(sum(m))``) is made by each
microbatch from the shares of the statistics it is made from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence, Set
from typing import Any

import jax
import numpy as np

from autopar._src import (
    batch_scaling,
    compat,
    dependence,
    layers,
    nested_figures,
    region_outputs,
    whole_batch,
)
from autopar._src.batch_scaling import Found
from autopar._src.program import Key, Op
from autopar._src.trace import TracedStep

_DRAWS = ("random_", "threefry")
"""Prefixes of the primitives that draw random values: a draw at the whole batch's shape is
another than at one microbatch's."""


@dataclasses.dataclass(frozen=True)
class Statistics:
    """The loss function's statistics of the batch and how to make them once per step."""

    values: Mapping[Any, Key]
    """Each statistic (a variable of the region's jaxpr at one microbatch) -> the once-per-step
    key of the value each microbatch reads in its place."""
    ops: tuple[Op, ...]
    """The once-per-step ops making those values, in order: the batch's leaves joined, the
    twins at the whole batch, the division of sums by the number of microbatches."""
    shares: Mapping[Any, float] = dataclasses.field(default_factory=dict)
    """The statistics each microbatch reads a share of (of degree other than 0: a count), and
    their degrees (:mod:`~autopar._src.share_scaling`)."""
    wholes: Mapping[Any, Key] = dataclasses.field(default_factory=dict)
    """Each statistic -> the once-per-step key of the whole batch's value (a share's before
    the division): what the loss function returns when it returns the statistic itself."""
    unshared: frozenset[Any] = frozenset()
    """Integer counts of the batch the loss function returns and reads nowhere else: the whole
    batch's value is returned; no microbatch reads a share."""


NONE = Statistics({}, ())


def find(step: TracedStep, whole: TracedStep, batch_vars: Set[Any], nmb: int) -> Statistics:
    """The statistics of the grad region of ``step`` (traced at one of ``nmb`` microbatches;
    ``whole``: at the whole batch, with the same cuts), see the module's docstring.
    ``batch_vars``: the step's batch leaves; what the step makes from them alone before the region
    counts as the batch too. Where the two regions' equations differ, none."""
    at, at_whole = step.region_index(), whole.region_index()
    assert at is not None and at_whole is not None, "statistics of a gradient region"
    region = step.jaxpr.eqns[at]
    rj = region.params["info"].jaxpr
    rw = whole.jaxpr.eqns[at_whole].params["info"].jaxpr
    inputs, twin_inputs = [*rj.constvars, *rj.invars], [*rw.constvars, *rw.invars]
    if len(inputs) != len(twin_inputs) or not _same(rj.eqns, rw.eqns):
        return NONE
    outer = dict(zip(inputs, region.invars, strict=True))
    pre = before_region(step, whole, batch_vars, nmb)
    info = region.params["info"]
    differentiated = set(rj.invars[len(rj.invars) - info.num_grads :])
    free = [v for v in inputs if v not in differentiated]
    from_batch = {v for v in free if not compat.is_literal(outer[v]) and outer[v] in pre.batch_only}
    moved = [v for v in differentiated if not compat.is_literal(outer[v]) and outer[v] in pre.batch_only]
    if not from_batch and not moved:
        return NONE
    # The same for every microbatch, and not differentiated: constants, a class-weight table in
    # the state (the model's parameters are differentiated; what the step makes from the batch
    # otherwise, with random draws, is the microbatch's).
    fixed = {v for v in free if compat.is_literal(outer[v]) or outer[v] in pre.fixed}
    bound = set(inputs) - from_batch - fixed  # depends on more than the batch
    tainted = set(from_batch)  # depends on the batch
    twin = dict(zip(inputs, twin_inputs, strict=True))
    # Made by an equation at the top level, not a boundary, but for an integer or boolean figure
    # carried across one as it is (a count cast to float in a later stage: the cast's result is
    # the statistic, its degree followed across).
    made: set[Any] = set()

    for e, t in zip(rj.eqns, rw.eqns, strict=True):
        twin.update((v, w) for v, w in zip(e.outvars, t.outvars, strict=True) if not compat.is_dropvar(v))
        grow(e, bound, drawn=True)
        grow(e, tainted, drawn=False)
        if layers.is_boundary(e):
            made.update(v for a, v in zip(e.invars, e.outvars, strict=True) if _integral(a) and a in made)
        else:
            made.update(e.outvars)

    nested_figures.require_none(rj.eqns, rw.eqns, tainted, bound, nmb)

    def is_statistic(a: Any) -> bool:
        return (
            not compat.is_literal(a)
            and (a in made or a in from_batch)
            and a in tainted
            and a not in bound
            and a.aval.shape == twin[a].aval.shape
        )

    def whole_shape(a: Any) -> tuple[int, ...] | None:
        return tuple(twin[a].aval.shape) if a in twin else None

    # Where a statistic meets anything else: the model, the examples, another layer.
    found: dict[Any, None] = {}
    for e in rj.eqns:
        if layers.is_boundary(e):
            found.update((a, None) for a in e.invars if is_statistic(a) and not _integral(a))
        elif not all(is_statistic(v) for v in e.outvars if not compat.is_dropvar(v)):
            found.update((a, None) for a in batch_scaling.reads_as_figure(e, whole_shape) if is_statistic(a))
    # One the loss function returns comes back as the whole batch's, an integer count too; one
    # returned and read nowhere as a figure needs no share, so it may be an integer of any degree.
    origins = [region_outputs.before_boundaries(rj, a) for a in rj.outvars]
    returned = {a for a in origins if is_statistic(a) and a not in found}
    found.update((a, None) for a in origins if is_statistic(a))

    # The same before the region: a figure there that meets the examples (x.mean(0) in x - x.mean(0)).
    def is_statistic_before(a: Any) -> bool:
        return (
            not compat.is_literal(a)
            and a in pre.batch_only
            and a not in batch_vars
            and a.aval.shape == pre.twin[a].aval.shape
        )

    def whole_before(a: Any) -> tuple[int, ...] | None:
        return tuple(pre.twin[a].aval.shape) if a in pre.twin else None

    found_before: dict[Any, None] = {}
    for e in step.jaxpr.eqns[:at]:
        if not all(is_statistic_before(v) for v in e.outvars if not compat.is_dropvar(v)):
            found_before.update(
                (a, None) for a in batch_scaling.reads_as_figure(e, whole_before) if is_statistic_before(a)
            )
    # A differentiated input made from the batch before the region (the weights moved along the
    # gradient of the batch's loss: sharpness-aware minimisation's ascent), a mean or a figure of
    # the whole batch (degree 0), is made once per step from the whole batch, as jax.jit makes it,
    # and every microbatch differentiates at it; the region's analysis takes it as the model's.
    found_before.update(
        (o, None)
        for v in differentiated
        if not compat.is_literal(o := outer[v])
        and is_statistic_before(o)
        and not _scaled(pre.scalings.get(o))
    )
    if not found and not found_before:
        return NONE
    # Boundaries pass values on as they are (a count made before a cut, cast after it).
    theirs = {id(e): t for e, t in zip(rj.eqns, rw.eqns, strict=True) if not layers.is_boundary(e)}
    scalings = {**pre.scalings, **batch_scaling.scalings(rj.eqns, theirs, tainted, nmb, pre.given)}
    # A figure whose degree is not a whole number (``sqrt(sum(m))``) has no share of the whole
    # batch's figure that scales like the microbatch's: the figures it is made from are statistics
    # in its place, and each microbatch makes it from their shares.
    making = {v: (e, is_statistic) for e in rj.eqns if not layers.is_boundary(e) for v in e.outvars}
    making.update((v, (e, is_statistic_before)) for e in step.jaxpr.eqns[:at] for v in e.outvars)
    degrees = {}
    pending = [*found, *found_before]
    while pending:
        v = pending.pop()
        s = scalings.get(v)
        if s is not None and s.unknown:
            raise _unfollowed(v, s.origin, nmb)
        degree = 0.0 if s is None or s.extreme else s.degree
        if not float(degree).is_integer():
            e, figure = making.get(outer.get(v, v), (None, is_statistic))
            pending.extend(a for a in (e.invars if e is not None else ()) if figure(a))
            continue
        if degree and not batch_scaling.is_float(v) and v not in returned:
            raise _integer_count(v, s.origin if s is not None else None, nmb)
        degrees[v] = degree
    if not degrees:
        return NONE
    unshared = {v for v in returned if degrees[v] and not batch_scaling.is_float(v)}
    return _made_once(step, whole, {**pre.twin, **twin}, degrees, nmb, pre.fixed, unshared)


def _scaled(s: batch_scaling.Scaling | None) -> bool:
    """Whether a value that scales as ``s`` has a share other than itself (a sum: degree 1)."""
    return s is not None and (s.unknown or (not s.extreme and s.degree != 0))


@dataclasses.dataclass(frozen=True)
class Before:
    """What the step makes from the batch before its grad region, where the two traces have the
    same equations there (see :func:`before_region`)."""

    batch_only: frozenset[Any]
    """The batch's leaves and what is made from them alone, without random draws
    (a mask from the labels, a count of its tokens)."""
    scalings: Found
    """How those values scale with the batch (:func:`~autopar._src.batch_scaling.scalings`)."""
    twin: Mapping[Any, Any]
    """Their variables at the whole batch."""
    given: Found
    """The scalings of the region's inputs (variables of its jaxpr)."""
    fixed: frozenset[Any] = frozenset()
    """The step's values before the region that every microbatch shares: its constants, the
    arguments outside the batch, what is made from them alone."""


def before_region(step: TracedStep, whole: TracedStep, batch_vars: Set[Any], nmb: int) -> Before:
    """:class:`Before` of ``step`` (traced at one of ``nmb`` microbatches; ``whole``: at the whole
    batch)."""
    at, at_whole = step.region_index(), whole.region_index()
    if at is None or at != at_whole or not _same(step.jaxpr.eqns[:at], whole.jaxpr.eqns[:at]):
        return Before(frozenset(batch_vars), {}, {}, {})
    batch_only = set(batch_vars)
    pairs = list(zip(step.jaxpr.eqns[:at], whole.jaxpr.eqns[:at], strict=True))
    twin = dict(zip(step.arg_vars, whole.arg_vars, strict=True))
    derived = step.derived(set(batch_vars))
    # Shared by the microbatches: the arguments outside the batch, the constants that are the
    # same at both batch sizes (a class-weight table), what the step makes from them alone.
    fixed = set(twin) - derived
    if len(step.const_bindings) == len(whole.const_bindings):
        for (v, x), (w, y) in zip(step.const_bindings, whole.const_bindings, strict=True):
            twin[v] = w
            if _same_value(x, y):
                fixed.add(v)
    shaped = set()  # made from literals alone, but at the batch's size (an element count)
    for e, t in pairs:
        twin.update((v, w) for v, w in zip(e.outvars, t.outvars, strict=True) if not compat.is_dropvar(v))
        read = [a for a in e.invars if not compat.is_literal(a)]
        if all(a in fixed for a in read) and str(e) == str(t):
            fixed.update(v for v in e.outvars if not compat.is_dropvar(v))
        elif draws(e) or not all(a in batch_only or a in fixed or a in shaped for a in read):
            continue
        elif any(a in derived for a in read):
            batch_only.update(e.outvars)
        else:
            shaped.update(e.outvars)
    found = batch_scaling.scalings([e for e, _ in pairs], {id(e): t for e, t in pairs}, derived, nmb)
    region = step.jaxpr.eqns[at]
    rj = region.params["info"].jaxpr
    outer = zip([*rj.constvars, *rj.invars], region.invars, strict=True)
    given = {v: found[o] for v, o in outer if not compat.is_literal(o) and o in found}
    return Before(frozenset(batch_only), found, twin, given, frozenset(fixed))


def unread(step: TracedStep, stats: Statistics) -> set[Any]:
    """The values the step passes to its grad region that no microbatch reads once the
    statistics are read in place of their own (a token count made before the loss function),
    or whose outputs are replaced by the whole batch's (an integer count it returns), and the
    statistics made before the region."""
    region = step.jaxpr.eqns[step.region_index()]
    rj = region.params["info"].jaxpr
    if not stats.values and not stats.unshared:
        return set()
    replaced = {*stats.values, *stats.unshared}
    origins = {v: region_outputs.before_boundaries(rj, v) for v in rj.outvars if not compat.is_literal(v)}
    needed = {v for v, o in origins.items() if compat.is_literal(o) or o not in replaced}
    for e in reversed(rj.eqns):
        if any(v in needed for v in e.outvars if not compat.is_dropvar(v)):
            needed.update(a for a in e.invars if not compat.is_literal(a) and a not in replaced)
    outer = zip([*rj.constvars, *rj.invars], region.invars, strict=True)
    return {o for v, o in outer if v not in needed and not compat.is_literal(o)} | replaced


def _same(mine: Sequence[Any], theirs: Sequence[Any]) -> bool:
    """Whether two traces pair equation for equation (an ``unstack`` of the rows has as many
    results as rows: not at both batch sizes)."""
    return len(mine) == len(theirs) and all(
        e.primitive is t.primitive and (len(e.invars), len(e.outvars)) == (len(t.invars), len(t.outvars))
        for e, t in zip(mine, theirs, strict=True)
    )


def _same_value(x: Any, y: Any) -> bool:
    """Whether two constants of the step's traces hold the same value (PRNG keys: the same
    object)."""
    if x is y:
        return True
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        return False
    return bool(np.shape(x) == np.shape(y) and np.array_equal(np.asarray(x), np.asarray(y)))


def _integral(a: Any) -> bool:
    """Whether ``a`` is an integer or boolean variable."""
    return not compat.is_literal(a) and not batch_scaling.is_float(a)


def _unfollowed(v: Any, origin: Any, nmb: int) -> ValueError:
    return ValueError(
        f"The loss function reads a figure of the batch ({v.aval.str_short()}) made at "
        f"{compat.source_line(origin)} ({str(origin).splitlines()[0]!r}), where autopar cannot "
        f"tell how it scales with the batch (a loop whose carries neither add up nor settle). With "
        f"num_microbatches={nmb} each microbatch would make its own from its examples, not the "
        "whole batch's. Make it with jnp reductions (jnp.sum of a mask), pass it to the step "
        "outside the batch, or use num_microbatches=1."
    )


def _integer_count(v: Any, origin: Any, nmb: int) -> ValueError:
    return ValueError(
        f"The loss function reads an integer figure of the batch ({v.aval.str_short()}, a count "
        f"over its examples made at {compat.source_line(origin)}: "
        f"{str(origin).splitlines()[0]!r}). With num_microbatches={nmb} it is made once from the "
        "whole batch and each microbatch reads its share, which is no integer. Cast it to float "
        "where it is made (jnp.bincount(y, length=n).astype(jnp.float32)), or use "
        "num_microbatches=1."
    )


def grow(e: Any, values: set[Any], drawn: bool) -> None:
    """Adds to ``values`` the outputs of ``e`` (a loss function's equation) made from them: a
    layer boundary's one for one, and, where ``drawn``, all of a random draw's or a cotangent
    seed's (values the model makes that are no function of the batch's)."""
    if e.primitive is layers.cotangent_seed_p or (not layers.is_boundary(e) and draws(e)):
        if drawn:
            values.update(e.outvars)
        return
    reads = [not compat.is_literal(a) and a in values for a in e.invars]
    flags = reads if layers.is_boundary(e) else dependence.eqn_depends(e, reads)
    values.update(e.outvars if flags is None else [v for v, f in zip(e.outvars, flags, strict=True) if f])


def draws(e: Any) -> bool:
    """Whether ``e`` or an equation in its bodies draws random values."""
    return e.primitive.name.startswith(_DRAWS) or any(draws(q) for b in compat.bodies(e) for q in b.eqns)


def _made_once(
    step: TracedStep,
    whole: TracedStep,
    twin: Mapping[Any, Any],
    degrees: Mapping[Any, float],
    nmb: int,
    fixed: Set[Any],
    unshared: Set[Any],
) -> Statistics:
    """The ops making each statistic of ``degrees`` once per step (see :class:`Statistics`):
    the twins of the equations that make it, in the region and before it, from the batch's
    leaves joined and the values of ``fixed`` (the step's, shared by the microbatches).
    ``twin``: the step's variables at one microbatch -> at the whole batch. ``unshared``: the
    integer counts the loss function only returns: made whole, no share."""
    region = whole.jaxpr.eqns[whole.region_index()]
    rw = region.params["info"].jaxpr
    outer = dict(zip([*rw.constvars, *rw.invars], region.invars, strict=True))  # region inputs
    shared = {twin[v]: v for v in fixed if v in twin}  # -> the microbatches' variable

    def name(a: Any) -> Any:  # a region input is the value the step passes in
        a = outer.get(a, a)
        return shared.get(a, a)

    needed = {twin[v] for v in degrees}
    chain = []
    for t in [*reversed(rw.eqns), None, *reversed(whole.jaxpr.eqns[: whole.region_index()])]:
        if t is None:  # on to the equations before the region
            needed = {name(a) for a in needed}
        elif any(w in needed for w in t.outvars if not compat.is_dropvar(w)):
            chain.append(t)
            needed.update(a for a in t.invars if not compat.is_literal(a) and name(a) not in fixed)
    ops = []
    for v, w in zip(step.arg_vars, whole.arg_vars, strict=True):
        if w in needed:  # a batch leaf: its microbatches joined
            join = whole_batch.joined_leaf(v, w, nmb)
            if join is None:
                return NONE
            ops.append(join)
    for t in reversed(chain):
        ins = tuple(a if compat.is_literal(a) else (name(a), None) for a in t.invars)
        outs = tuple(None if compat.is_dropvar(w) else (w, None) for w in t.outvars)
        ops.append(Op(kind="eqn", eqn=t, ins=ins, outs=outs))
    values: dict[Any, Key] = {}
    shares = {}
    wholes = {v: (name(twin[v]), None) for v in degrees}
    for v, degree in degrees.items():
        if v in unshared:  # each microbatch makes its own, which nothing reads
            continue
        if degree == 0.0:
            values[v] = (name(twin[v]), None)
            continue
        shares[v] = degree
        share = compat.Var(v.aval)
        scale = float(nmb) ** degree
        ops.append(
            Op(kind="acc", mode="mean", ins=((name(twin[v]), None),), outs=((share, None),), divisor=scale)
        )
        values[v] = (share, None)
    return Statistics(values, tuple(ops), shares, wholes, frozenset(unshared))
