"""What microbatches need of a step: the gradient region's outputs that hold a value per
example, and the checks that the code around the loss function gives ``jax.jit``'s result when
the loss function runs once per microbatch.

Each check compares the step traced at one microbatch with the step traced at the whole batch
(:func:`autopar._src.planning.trace_at`, at the same cuts), equation by equation: what differs
only in dims ``num_microbatches`` times longer is per example; what else differs reads the
batch's shape. The checks of examples combined live in :mod:`~autopar._src.example_mixing`,
those of the region's outputs in :mod:`~autopar._src.region_outputs`, the statistics of the
batch in :mod:`~autopar._src.batch_statistics`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from typing import Any

from autopar._src import (
    batch_statistics,
    compat,
    example_mixing,
    example_order,
    output_checks,
    share_scaling,
    trace,
    twin_traces,
    whole_batch,
)
from autopar._src.strategies import ELEMENTWISE_PRIMITIVES


def per_example_outputs(
    step: trace.TracedStep,
    whole_batch: Callable[[], trace.TracedStep],
    *,
    batch_ids: Sequence[int],
    num_microbatches: int,
    drawn: Set[int] = frozenset(),
) -> tuple[dict[int, int], batch_statistics.Statistics, frozenset[int]]:
    """The outputs of the step's gradient region that hold a value per example, each with its
    batch dim: aux outputs such as the logits, and the gradients of batch inputs. Microbatches
    concatenate these along it (gradients divided by ``num_microbatches``, as the mean over
    microbatches is). The other outputs are reduced over the batch, and microbatches average
    them (integers, booleans and keys: the first microbatch's), or add them up where they are
    sums over the examples.

    ``step`` is traced at one microbatch; with several, ``whole_batch()`` gives the step traced
    at the whole batch (:func:`~autopar._src.planning.trace_at`, at the same cuts: the regions
    are compared equation by equation) to compare the outputs' shapes, and the code that runs
    once per step, which must not depend on the batch's shape. ``drawn``: the indices of the
    equations before the loss function that make a draw per microbatch
    (:func:`~autopar._src.early_draws.find`; the same in both traces): what they make runs per
    microbatch, as the batch does.

    Returns:
      ``{index into the region's outputs: batch dim}``, and the statistics of the batch that the
      loss function reads (:func:`~autopar._src.batch_statistics.find`), made once per step, and
      the indices of the outputs that are sums over the examples (the loss among them: its
      gradients add up over the microbatches as they are).

    Raises:
      ValueError: naming a region output whose shape for the batch is not its shape for one
        microbatch with one dim ``num_microbatches`` times as long, or the source line of
        once-per-step code that reads the batch's shape.
    """
    at = step.region_index()
    if num_microbatches == 1 or at is None:
        return {}, batch_statistics.NONE, frozenset()
    whole = whole_batch()
    region = step.jaxpr.eqns[at]
    info = region.params["info"]
    num_aux = info.num_aux
    whole_outs = whole.jaxpr.eqns[whole.region_index()].outvars
    dims = {}
    for i, (part, full) in enumerate(zip(region.outvars, whole_outs, strict=True)):
        if i == 0 or part.aval.shape == full.aval.shape:
            continue
        grown = [d for d, (a, b) in enumerate(zip(part.aval.shape, full.aval.shape, strict=True)) if a != b]
        if len(grown) != 1 or full.aval.shape[grown[0]] != part.aval.shape[grown[0]] * num_microbatches:
            raise ValueError(
                f"{info.output_name(i)} is "
                f"{full.aval.str_short()} for the batch but "
                f"{part.aval.str_short()} for one of num_microbatches={num_microbatches}: neither "
                "reduced over the batch (averaged over microbatches) nor one value per example along "
                "one dim (concatenated). Return it reduced over the batch or per example, compute it "
                "outside the step, or use num_microbatches=1."
            )
        dims[i] = grown[0]
    # Code reading the per-example outputs is refused later, naming the output.
    mine, theirs = (
        _batch_values(s, batch_ids, dims) | {v for i in drawn for v in s.jaxpr.eqns[i].outvars}
        for s in (step, whole)
    )
    seeds = (mine, theirs)
    stats = batch_statistics.find(step, whole, {step.arg_vars[i] for i in batch_ids}, num_microbatches)
    figures = batch_statistics.unread(step, stats)
    example_mixing.require_examples_apart(step, whole, batch_ids, num_microbatches, figures, seeds[0])
    example_mixing.require_examples_apart_in_loss(step, whole, num_microbatches, set(stats.values))
    example_order.require_batch_order_in_loss(step, whole, num_microbatches, set(stats.values))
    averaged = [i for i in range(1 + num_aux) if i not in dims]
    _require_batch_free_once_per_step((step, whole), seeds, num_microbatches, figures, drawn)
    summed = output_checks.require_combinable(
        step,
        whole,
        batch_ids,
        dims,
        num_microbatches,
        set(stats.values) | stats.unshared,
        set(stats.values) - set(stats.shares),
    )
    share_scaling.require_linear_in_shares(step, stats, averaged)
    return dims, stats, summed


def _batch_values(step: trace.TracedStep, batch_ids: Sequence[int], dims: dict[int, int]) -> set[Any]:
    """The batch's inputs and the region's per-example outputs, as variables of ``step``."""
    at = step.region_index()
    outs = step.jaxpr.eqns[at].outvars if at is not None else []
    return {step.arg_vars[i] for i in batch_ids} | {outs[i] for i in dims}


def _require_batch_free_once_per_step(
    steps: tuple[trace.TracedStep, trace.TracedStep],
    seeds: tuple[set[Any], set[Any]],
    num_microbatches: int,
    figures: set[Any],
    drawn: Set[int],
) -> None:
    """Checks that the equations before the grad region that read no value of one microbatch
    (``seeds`` and what derives from them) and that the microbatches read are the same in the
    step traced at one microbatch as at the whole batch (``steps``): a batch shape read there
    (``jnp.arange(x.shape[0])`` as the examples' positions) would be one microbatch's. Where the
    rest differs (an examples-seen counter updated before the loss), it runs once per step at the
    whole batch (:mod:`~autopar._src.whole_batch`), as the code after the region does, and so does
    what only makes ``figures``, statistics of the batch (the element count ``jnp.std`` divides
    by)."""
    mine, theirs = (_once_per_step(s, seed, drawn) for s, seed in zip(steps, seeds, strict=True))
    step = steps[0]
    at = step.region_index()
    # What the step reads of the code before the region, but for the statistics' makings, and of
    # that, what the microbatches read (``feeding``). The rest runs once per step as its twin at
    # the whole batch (whole_batch.py), given the two traces' equations pair up.
    eqns = step.jaxpr.eqns
    read = _reading(step, [*(a for e in eqns[at:] for a in e.invars), *step.jaxpr.outvars], figures, True)
    derived = step.derived(seeds[0])
    # Code per microbatch that feeds the region: what only the step's outputs or the code after
    # the region read runs again at the whole batch instead.
    region = _reading(step, list(eqns[at].invars), figures, False)
    per_microbatch = [
        e
        for e in eqns[:at]
        if id(e) in region and any(not compat.is_literal(a) and a in derived for a in e.invars)
    ]
    feeding = _reading(step, [a for e in (*per_microbatch, eqns[at]) for a in e.invars], figures, False)
    paired = whole_batch.twins(*steps) is not None
    fills = _microbatch_fills(step, seeds[0], drawn)
    filled: set[Any] = set()  # values found to be fills
    for k, eqn in enumerate(mine):
        other = theirs[k] if k < len(theirs) else None
        if (
            other is not None
            and id(eqn) in fills
            and _fill_of_the_batch(eqn, other, num_microbatches, filled)
        ):
            filled.update(eqn.outvars)
            continue
        if (
            (other is None or str(eqn) != str(other))
            and id(eqn) in read
            and (id(eqn) in feeding or not paired)
        ):
            cause, fix = (
                (
                    "it draws random values in the batch's shape that no microbatch can draw as its "
                    "rows of the whole batch's (one that grows with the batch in two dims or out of "
                    "proportion, inside a shard_map, or regrouped so that its rows meet the batch's in "
                    "no runs of the examples)",
                    "Draw them with the data and pass them in the batch (then equal to jax.jit), "
                    "draw them per example (jax.random.split(key, batch) and jax.vmap), or use "
                    "num_microbatches=1.",
                )
                if eqn.primitive.name == "random_bits"
                else (
                    "it reads the batch's shape (e.g. x.shape[0]), which is one microbatch's there, "
                    "or a value Python makes while tracing",
                    "Read it inside the loss function and return what needs it as aux, pass it to "
                    "the step as an argument, or use num_microbatches=1.",
                )
            )
            raise ValueError(
                f"The step's code outside the loss function differs between one microbatch and the "
                f"whole batch (at {compat.source_line(eqn)}: {str(eqn).splitlines()[0]!r} for one of "
                f"num_microbatches={num_microbatches}, "
                f"{'nothing' if other is None else repr(str(other).splitlines()[0])} for the batch): "
                f"{cause}. {fix}"
            )
    if len(theirs) > len(mine):
        raise ValueError(
            f"The step's code outside the loss function differs between one microbatch and the "
            f"whole batch (at {compat.source_line(theirs[len(mine)])}, only for the batch): it "
            "reads the batch's shape. Read it inside the loss function, pass it to the step as an "
            "argument, or use num_microbatches=1."
        )


def _reading(step: trace.TracedStep, ends: Sequence[Any], figures: set[Any], effects: bool) -> set[int]:
    """The ``id`` of each equation before the grad region that makes a value of ``ends`` or that
    such an equation reads, past ``figures`` (with ``effects``: and those without outputs, a
    ``jax.debug.print``)."""
    live = {a for a in ends if not compat.is_literal(a)} - figures
    found = set()
    for e in reversed(step.jaxpr.eqns[: step.region_index()]):
        if any(v in live for v in e.outvars) or (effects and not e.outvars):
            found.add(id(e))
            live.update(a for a in e.invars if not compat.is_literal(a) and a not in figures)
    return found


def _microbatch_fills(step: trace.TracedStep, seeds: set[Any], drawn: Set[int] = frozenset()) -> set[int]:
    """The ``id`` of each equation before the grad region that may make a fill (a broadcast,
    a tile, an elementwise equation: :func:`_fill_of_the_batch` decides) and whose values only
    code run per microbatch reads (before the region, or the region), directly or through other
    such equations: at one microbatch's shape, a fill (``jnp.zeros(x.shape[0])`` as the update of
    ``x.at[:, 0].set(0.0)``) is each microbatch's part of the whole batch's, the same value
    everywhere. ``drawn``: the indices of the draws made per microbatch as the microbatch's rows
    of the whole batch's (their parameters broadcast to the batch's shape, a gamma draw's ``alpha``,
    are such fills)."""
    at = step.region_index()
    eqns = step.jaxpr.eqns
    derived = step.derived(seeds)
    per_microbatch = {
        id(e) for e in eqns[:at] if any(not compat.is_literal(a) and a in derived for a in e.invars)
    }
    per_microbatch.add(id(eqns[at]))
    per_microbatch.update(id(eqns[i]) for i in drawn)
    readers: dict[Any, list[int]] = {}
    for e in eqns:
        for a in e.invars:
            if not compat.is_literal(a):
                readers.setdefault(a, []).append(id(e))
    returned = {v for v in step.jaxpr.outvars if not compat.is_literal(v)}
    found: set[int] = set()
    for e in reversed(eqns[:at]):  # readers first: a fill may feed another
        if (
            (e.primitive.name in _FILLING or e.primitive.name in ELEMENTWISE_PRIMITIVES)
            and len(e.outvars) == 1
            and e.outvars[0] not in returned
            and all(r in per_microbatch or r in found for r in readers.get(e.outvars[0], []))
        ):
            found.add(id(e))
    return found


_FILLING = frozenset({"broadcast_in_dim", "tile", "iota"})
"""Primitives besides the elementwise ones that may make a fill."""


def _fill_of_the_batch(eqn: Any, other: Any, nmb: int, fills: set[Any]) -> bool:
    """Whether ``eqn`` differs from ``other``, its twin at the whole batch, in dims per example
    alone, along which its value is the same everywhere: a broadcast or tile that makes them from
    nothing (a new dim, or one of size 1 stretched: ``jnp.broadcast_to(jnp.arange(T)[None],
    ids.shape)``, ``jnp.tile(jnp.arange(T), (n, 1))``), an iota counting along another dim (the
    positions ``jnp.argsort(x, axis=1)`` sorts with), or an elementwise equation of such
    values (``fills``) and of values the same in both traces that do not vary along those dims
    (``jnp.ones(x.shape) + jnp.arange(T)``)."""
    grown = twin_traces.per_example_dims(eqn.outvars[0], other.outvars[0], nmb)
    if not grown:
        return False
    name = eqn.primitive.name
    if name == "broadcast_in_dim":
        same = [d for d in range(len(eqn.params["shape"])) if d not in grown]
        operand = getattr(eqn.invars[0].aval, "shape", ())
        taken = {d for k, d in enumerate(eqn.params["broadcast_dimensions"]) if operand[k] != 1}
        return not grown & taken and all(eqn.params["shape"][d] == other.params["shape"][d] for d in same)
    if name == "iota":  # counting along a dim of its own (a sort's positions along the sequence)
        mine, theirs = eqn.params, other.params
        return mine["dimension"] not in grown and all(
            mine["shape"][d] == theirs["shape"][d] for d in range(len(mine["shape"])) if d not in grown
        )
    if name == "tile":
        operand = getattr(eqn.invars[0].aval, "shape", ())
        reps, theirs = eqn.params["reps"], other.params["reps"]
        return all(operand[d] == 1 for d in grown) and all(
            reps[d] == theirs[d] for d in range(len(reps)) if d not in grown
        )
    if str(eqn.params) != str(other.params):
        return False
    for a, b in zip(eqn.invars, other.invars, strict=True):
        if compat.is_literal(a) or a in fills:
            continue
        shape = getattr(a.aval, "shape", ())
        if shape != getattr(b.aval, "shape", ()) or any(d < len(shape) and shape[d] != 1 for d in grown):
            return False
    return True


def _once_per_step(step: trace.TracedStep, seeds: set[Any], drawn: Set[int]) -> list[Any]:
    """The equations before the grad region that read nothing derived from ``seeds`` (those
    run per microbatch, at the microbatch's shape by design), nor make a draw per microbatch."""
    derived, at = step.derived(seeds), step.region_index()
    return [
        e
        for i, e in enumerate(step.jaxpr.eqns[:at])
        if i not in drawn and not any(not compat.is_literal(a) and a in derived for a in e.invars)
    ]
