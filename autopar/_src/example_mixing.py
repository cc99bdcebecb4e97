"""Code before the gradient that mixes examples, refused with microbatches.

What the step computes from the batch before the loss function runs per microbatch, inside the
first stage's forward (:mod:`~autopar._src.partition`). That is ``jax.jit``'s result only where
each example's values are made from that example alone. An equation that combines examples
(a partner from another example as mixup's ``jnp.roll(x, 1, 0)``, a sort or cumulative sum
along the batch, every example against every other, a statistic of more than the batch alone)
would see one microbatch's examples, so its values, and the loss, would differ from the whole
batch's, silently. A statistic of the batch alone (``x.mean(0)``) is made from the whole batch
instead (:mod:`~autopar._src.batch_statistics`), and what only makes it is not checked. The
step traced at one microbatch and at the whole batch tell the per-example dims apart: a dim
``num_microbatches`` times longer in the second.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence, Set
from typing import Any

import numpy as np

from autopar._src import compat, layers, loop_carries, loop_restarts, row_loops, twin_traces
from autopar._src.trace import TracedStep

_ALONG = {"rev": "dimensions", "sort": "dimension", "cumsum": "axis", "cumprod": "axis"}
_ALONG.update({"cummax": "axis", "cummin": "axis", "cumlogsumexp": "axis"})
"""Primitives that order or accumulate along the dims a param names."""


def require_examples_apart(
    step: TracedStep,
    whole: TracedStep,
    batch_ids: Sequence[int],
    nmb: int,
    whole_figures: Set[Any] = frozenset(),
    per_microbatch: Set[Any] = frozenset(),
) -> None:
    """Raises if an equation before the grad region combines examples of the batch (see the
    module's docstring); ``step`` is traced at one microbatch, ``whole`` at the whole batch.
    ``whole_figures``: values the microbatches read from the whole batch instead of making them
    (statistics, :mod:`~autopar._src.batch_statistics`): what only makes them may combine
    examples. ``per_microbatch``: values made per microbatch as the batch's leaves are (its
    per-example outputs, draws in the batch's shape).

    Raises:
      ValueError: naming the equation and its source line.
    """
    at, at_whole = step.region_index(), whole.region_index()
    if at is None or at_whole is None:
        return
    mine, theirs = step.jaxpr.eqns[:at], whole.jaxpr.eqns[:at_whole]
    twin = twin_traces.twin_equations(mine, theirs, nmb)
    # Only what reaches the loss function: a value returned from the step is refused by name
    # (partition), one the update reads after the gradient too.
    needed = {a for a in step.jaxpr.eqns[at].invars if not compat.is_literal(a) and a not in whole_figures}
    feeding = set()
    for k in reversed(range(len(mine))):
        if any(v in needed for v in mine[k].outvars if not compat.is_dropvar(v)):
            feeding.add(k)
            needed.update(a for a in mine[k].invars if not compat.is_literal(a) and a not in whole_figures)
    tainted = {step.arg_vars[i] for i in batch_ids} | set(per_microbatch)
    positions = twin_traces.read_from_the_batch(mine, {v for v in tainted if twin_traces.whole_number(v)})
    indices = _Indices(tainted, _Static(mine, step), _Static(theirs, whole), positions)  # tainted grows
    twins = dict(zip(step.jaxpr.invars, whole.jaxpr.invars, strict=True))
    for k, e in enumerate(mine):
        other = twin_traces.reading_twins(e, twin.get(id(e)), twins)
        if not any(not compat.is_literal(a) and a in tainted for a in e.invars):
            continue
        tainted.update(v for v in e.outvars if not compat.is_dropvar(v))
        found = _mixing(e, other, nmb, indices) if k in feeding and other is not None else None
        if found is not None and len(twin) < len(mine) and _picks_a_row(found, positions):
            continue  # traces paired around a Python loop over the rows: row_loops follows them
        if found is not None:
            raise _combined_before_the_gradient(found, compat.source_line(found, compat.source_line(e)), nmb)
    # A Python loop over the rows: what it makes from one row alone, put back in place.
    dims = {
        v: twin_traces.per_example_dims(v, w, nmb) for v, w in zip(step.arg_vars, whole.arg_vars, strict=True)
    }
    for e in mine:
        other = twin.get(id(e))
        if other is not None:
            dims.update(
                (v, twin_traces.per_example_dims(v, w, nmb))
                for v, w in zip(e.outvars, other.outvars, strict=True)
            )
    region = {a for a in step.jaxpr.eqns[at].invars if not compat.is_literal(a)}
    found = row_loops.mixing_rows(mine, dims, region)
    if found is not None:
        raise _combined_before_the_gradient(found, compat.source_line(found), nmb)


def _require_in_proportion(e: Any, other: Any, nmb: int) -> None:
    """Raises if ``e`` (``other``: its twin at the whole batch), reading the examples' values,
    makes a value whose size follows the batch out of proportion: a dim neither the same at both
    batch sizes nor ``nmb`` times as long at the whole batch's (a mixture of experts' buffer of a
    capacity computed from the batch's token count, ``E * int(1.25 * T / E) + 1`` rows). A
    microbatch's is no part of the whole batch's: what lands in it depends on the whole batch."""
    for v, w in zip(e.outvars, other.outvars, strict=True):
        if compat.is_dropvar(v):
            continue
        mine, theirs = twin_traces.shape_of(v), twin_traces.shape_of(w)
        if len(mine) != len(theirs) or all(a == b or b == a * nmb for a, b in zip(mine, theirs, strict=True)):
            continue
        raise ValueError(
            f"The loss function makes a value whose size follows the batch out of proportion (at "
            f"{compat.source_line(e)}: {str(e).splitlines()[0]!r}; {v.aval.str_short()} for one of "
            f"num_microbatches={nmb}, {w.aval.str_short()} for the batch), such as a mixture of "
            "experts' buffer whose capacity is computed from the batch's token count, or a segment "
            "sum with a padding bucket added to the batch's segments: a microbatch's is no part of "
            "the whole batch's, so what lands in it (which tokens an expert keeps) would not be "
            "jax.jit's. Make it per example or per group of examples a microbatch holds whole (a "
            "capacity per sequence, jax.vmap over the examples), or use num_microbatches=1."
        )


def _combined_before_the_gradient(found: Any, where: str, nmb: int) -> ValueError:
    # Inside the loss function, rows sorted and put back in the batch's order are followed
    # (example_order): a frozen model's forward that sorts (a mixture of experts' dispatch) can go
    # there.
    inside = (
        " Or, for rows sorted and put back in the batch's order (a frozen mixture of experts "
        "sorting its tokens by expert), compute it inside the loss function under "
        "jax.lax.stop_gradient, where such sorts are followed."
        if found.primitive.name == "sort"
        else ""
    )
    return ValueError(
        f"The step's code before the gradient combines examples (at {where}: "
        f"{str(found).splitlines()[0]!r}): with num_microbatches={nmb} it runs per microbatch "
        "and would see only that microbatch's examples, so what it makes (another example's "
        "values as mixup's partner, a statistic of more than the batch alone, rows picked by "
        "indices read from the batch, which number the whole batch's rows, rows of a Python "
        "loop over the batch combined with others, a gradient taken with jax.grad before "
        "autopar's of a loss that reads draws (a GAN discriminator's on samples generated from "
        "noise drawn in the step) or that moves the differentiated weights by a sum over the "
        "examples (sharpness-aware minimization's ascent not normalised)) would not be the whole "
        "batch's. Do it in the "
        f"data pipeline, or use num_microbatches=1.{inside}{_leading_dim_hint(found)}"
    )


def _leading_dim_hint(found: Any) -> str:
    """What to say where ``found`` runs along the batch's leading dim as along time: a
    recurrence (``scan``) or a convolution's window over it, as on time-major data."""
    if found.primitive.name not in ("scan", "while", "conv_general_dilated"):
        return ""
    loop = (
        " A loop over the examples (its trip count follows the batch) runs once per microbatch, "
        "from its initial carries: each iteration must depend on its own rows alone (not on "
        "values or a key carried from earlier rows, nor on the counter but as the rows' index), "
        "and what it carries to its end must add up over microbatches (a sum, a running mean, "
        "a max)."
        if found.primitive.name != "conv_general_dilated"
        else ""
    )
    return loop + (
        " The batch arguments are split along their leading dim, which must be the examples': "
        "for time-major data (nn.RNN(time_major=True), a scan over x of shape (time, batch, ...)) "
        "pass the batch with its examples first and transpose inside the step."
    )


def require_examples_apart_in_loss(
    step: TracedStep, whole: TracedStep, nmb: int, statistics: Set[Any] = frozenset()
) -> None:
    """Raises if the grad region of ``step`` (traced at one of ``nmb`` microbatches; ``whole``: at
    the whole batch, with the same cuts) takes examples by their position in the batch: another
    example's values (mixup's ``jnp.flip(x, 0)`` inside the loss function), the hardest examples
    (``lax.top_k`` of the losses, a sorted slice), a median. Each microbatch would pick from its
    own examples. Reductions over the examples (the loss's mean; checked by
    :mod:`~autopar._src.region_outputs`), sorting alone (a dropless mixture of experts orders its
    tokens by expert and back) and what only makes ``statistics`` (made from the whole batch)
    are not refused here.

    Raises:
      ValueError: naming the equation and its source line.
    """
    rj = step.jaxpr.eqns[step.region_index()].params["info"].jaxpr
    rw = whole.jaxpr.eqns[whole.region_index()].params["info"].jaxpr
    mine = [e for e in rj.eqns if not layers.is_boundary(e)]
    theirs = [e for e in rw.eqns if not layers.is_boundary(e)]
    twin = twin_traces.twin_equations(mine, theirs, nmb)
    used = twin_traces.feeding_outputs(rj, statistics)
    # Values made from the microbatch's examples (not from positions, keys or constants alone).
    data = {v for v, w in zip(rj.invars, rw.invars, strict=True) if twin_traces.per_example_dims(v, w, nmb)}
    for e in rj.eqns:
        if any(not compat.is_literal(a) and a in data for a in e.invars):
            data.update(v for v in e.outvars if not compat.is_dropvar(v))
    positions = twin_traces.read_from_the_batch(
        rj.eqns, {v for v in data & set(rj.invars) if twin_traces.whole_number(v)}
    )
    indices = _Indices(data, _Static(rj.eqns), _Static(rw.eqns), positions, len(twin) == len(mine))
    twins = dict(zip(rj.invars, rw.invars, strict=True))
    num_aux = step.jaxpr.eqns[step.region_index()].params["info"].num_aux
    live = twin_traces.feeding_values(rj, rj.outvars[: 1 + num_aux], statistics)
    for e in mine:
        other = twin_traces.reading_twins(e, twin.get(id(e)), twins)
        found = (
            _mixing(e, other, nmb, within=True, indices=indices, live=live)
            if id(e) in used and other
            else None
        )
        if found is not None and len(twin) < len(mine) and _picks_a_row(found, positions):
            continue  # traces paired around a Python loop over the rows: a row's slice is its own
        if found is not None:
            where = compat.source_line(found, compat.source_line(e))  # in a loop's body: the loop's
            raise ValueError(
                f"The loss function takes examples by their place in the batch (at "
                f"{where}: {str(found).splitlines()[0]!r}): with "
                f"num_microbatches={nmb} it runs per microbatch and picks among that microbatch's "
                "examples alone, so what it makes (another example's values as mixup's partner, the "
                "hardest examples by top_k or a sort, a median, rows picked by indices read from the "
                "batch, which number the whole batch's rows) would not be the whole batch's. Do it in "
                f"the data pipeline, pick per example, or use num_microbatches=1.{_leading_dim_hint(found)}"
            )
    # Checked last: a value sized out of proportion that no check above names (a roll's slice
    # is named as taking examples by their place).
    for e in mine:
        other = twin_traces.reading_twins(e, twin.get(id(e)), twins)
        if (
            id(e) in used
            and other is not None
            and any(not compat.is_literal(a) and a in data for a in e.invars)
        ):
            _require_in_proportion(e, other, nmb)


def _picks_a_row(e: Any, positions: Set[Any]) -> bool:
    """Whether ``e`` picks rows by position, not by indices read from the batch: what a Python
    loop over the rows (``[f(row) for row in x]``) does, where the two traces differ and are
    paired around it (:func:`~autopar._src.twin_traces.twin_equations`), so that its slices
    look like picks by place."""
    name = e.primitive.name
    if name == "slice":  # a strided one takes every other row: an associative scan's (``cummax``)
        return all(k == 1 for k in e.params["strides"] or ())
    if name == "pad":
        return all(interior == 0 for _, _, interior in e.params["padding_config"])
    if name in ("dynamic_slice", "dynamic_update_slice"):
        return True
    indexed = name == "gather" or name.startswith("scatter")
    return indexed and not (
        len(e.invars) > 1 and not compat.is_literal(e.invars[1]) and e.invars[1] in positions
    )


def _mixing(
    e: Any,
    other: Any,
    nmb: int,
    indices: _Indices | None = None,
    within: bool = False,
    looped: bool = False,
    live: Set[Any] | None = None,
) -> Any:
    """``e`` or the equation inside its body that combines examples (``other``: its twin at the
    whole batch), or None. ``within`` the loss function, reductions over the examples, pairs of
    them and sorts are left to other checks. ``indices`` tells a gather's or scatter's
    per-example indices that pick each example's own rows from those that pick by place (None,
    inside a body: all are taken as each example's own). Inside a loop's body (``looped``), what
    picks by an index is checked only for indices read from the batch: a loop over the batch's
    rows picks its row by the loop's counter."""
    values = None if indices is None else indices.values()
    if loop_carries.carries_examples_on(e, other, nmb, live, values):
        return e
    body, twin = compat.operand_body(e), compat.operand_body(other)
    if body is not None and twin is not None:
        inside = None if indices is None else indices.into(e.invars, body)
        return _in_body(body, twin, nmb, within, looped, inside)
    inner, theirs = compat.bodies(e), compat.bodies(other)
    if len(inner) == len(theirs):  # a loop's or a cond's: reversed, sorted, sliced along the batch
        branching = compat.cond_branches(e) is not None  # no counter to pick rows by
        found = next(
            (
                f
                for b, t in zip(inner, theirs, strict=True)
                if (f := _in_body(b, t, nmb, within, looped or not branching, _inside(e, b, indices)))
                is not None
            ),
            None,
        )
        if found is not None:
            return found
    # Per operand, in order (a literal has none).
    ins = [
        set() if compat.is_literal(a) else twin_traces.per_example_dims(a, b, nmb)
        for a, b in zip(e.invars, other.invars, strict=True)
    ]
    outs = [twin_traces.per_example_dims(v, w, nmb) for v, w in zip(e.outvars, other.outvars, strict=True)]
    most_in = max((len(d) for d in ins), default=0)
    if most_in == 0:
        return None
    operand = ins[0] if ins else set()
    name, p = e.primitive.name, e.params
    if name == "top_k":  # along the last dim
        return e if len(twin_traces.shape_of(e.invars[0])) - 1 in operand else None
    if not within and (any(len(d) < most_in for d in outs) or any(len(d) > most_in for d in outs)):
        return e  # reduced over the examples, or every example against every other
    if within and name in ("sort", "rev"):  # what reads reversed rows: example_order
        return None
    if name in _ALONG:
        dims = p[_ALONG[name]]
        dims = dims if isinstance(dims, tuple | list) else (dims,)
        return e if any(d % len(twin_traces.shape_of(e.invars[0])) in operand for d in dims) else None
    if name == "slice":
        full = twin_traces.shape_of(e.invars[0])
        strides = p["strides"] or (1,) * len(full)
        kept = all(
            (p["start_indices"][d], p["limit_indices"][d], strides[d]) == (0, full[d], 1) for d in operand
        )
        # Inside the loss function, rows sliced back out of runs of all the examples (``out[:n]``
        # of ``jnp.concatenate([a, b])``): the order walk (example_order) checks where they fall.
        back = (  # rows along the batch still: a single row picked is refused here
            within
            and indices is not None
            and indices.paired
            and all(strides[d] == 1 and d in outs[0] for d in operand)
        )
        return None if kept or back else e
    if name == "split" and not within:  # ``jnp.split`` of the batch (inside: example_order)
        return e if p["axis"] in operand else None
    if name == "conv_general_dilated":  # a window over neighbouring examples (time-major data)
        numbers, kernel = p["dimension_numbers"], twin_traces.shape_of(e.invars[1])
        window = {
            d: (kernel[k], p["window_strides"][i], p["lhs_dilation"][i], tuple(p["padding"][i]))
            for i, (d, k) in enumerate(zip(numbers.lhs_spec[2:], numbers.rhs_spec[2:], strict=True))
        }
        return e if any(window[d] != (1, 1, 1, (0, 0)) for d in operand if d in window) else None
    if name.startswith("reduce_window"):  # a pooling window over neighbouring examples
        alone = (
            (
                p["window_dimensions"][d],
                p["window_strides"][d],
                p["base_dilation"][d],
                p["window_dilation"][d],
            )
            == (1, 1, 1, 1)
            and tuple(p["padding"][d]) == (0, 0)
            for d in operand
        )
        return None if all(alone) else e
    picks = name in ("dynamic_slice", "gather", "dynamic_update_slice") or name.startswith("scatter")
    if looped and picks and (indices is None or len(e.invars) < 2 or e.invars[1] not in indices.positions):
        return None  # by the loop's counter, maybe: but not by indices read from the batch
    if name in ("dynamic_slice", "gather", "pad"):
        full = twin_traces.shape_of(e.invars[0])
        if name == "pad":  # inside the loss function, unit ones are the order walk's (``_sliced``'s)
            back = (
                within
                and indices is not None
                and indices.paired
                and all(p["padding_config"][d][2] == 0 for d in operand)
            )
            whole_dims = [back or tuple(p["padding_config"][d]) == (0, 0, 0) for d in operand]
        elif name == "dynamic_slice":
            whole_dims = [p["slice_sizes"][d] == full[d] for d in operand]
        else:  # indices made per example from its values pick its own row (take_along_axis)
            batching = set(getattr(p["dimension_numbers"], "operand_batching_dims", ()))
            aligned = _own_indices(e, other, ins, operand, nmb, indices)
            whole_dims = [aligned or d in batching or p["slice_sizes"][d] == full[d] for d in operand]
        return None if all(whole_dims) else e
    if name == "dynamic_update_slice":  # writes some examples' rows: those at one position
        full, part = twin_traces.shape_of(e.invars[0]), twin_traces.shape_of(e.invars[1])
        return None if all(part[d] == full[d] for d in operand) else e
    if name.startswith("scatter"):  # x.at[0].set(...): rows picked by position in the batch
        numbers = p["dimension_numbers"]
        picked = set(numbers.scatter_dims_to_operand_dims) - set(
            getattr(numbers, "operand_batching_dims", ())
        )
        aligned = _own_indices(e, other, ins, operand, nmb, indices)  # each example's own rows
        return e if operand & picked and not aligned else None
    return None


def _inside(e: Any, body: Any, indices: _Indices | None) -> _Indices | None:
    """``indices`` inside ``body``, a loop's or a ``cond``'s body of ``e``, where its inputs are
    ``e``'s operands one for one (a ``scan``'s, a branch's, a ``while``'s body or predicate)."""
    if indices is None:
        return None
    operands = list(e.invars[1:] if compat.cond_branches(e) is not None else e.invars)
    if e.primitive.name == "while":
        skip, consts = e.params["cond_nconsts"], e.params["body_nconsts"]
        looped = e.params["body_jaxpr"]
        in_body = body is looped or body is getattr(looped, "jaxpr", None)
        operands = operands[skip:] if in_body else operands[:skip] + operands[skip + consts :]
    if len(operands) != len(body.invars):
        return None
    return indices.into(operands, body)


def _in_body(
    body: Any, twin: Any, nmb: int, within: bool, looped: bool, indices: _Indices | None = None
) -> Any:
    """The equation of ``body`` (``twin``: the same at the whole batch) that combines examples."""
    if len(body.eqns) != len(twin.eqns) or any(
        q.primitive is not r.primitive for q, r in zip(body.eqns, twin.eqns, strict=True)
    ):
        return None
    pairs = zip(body.eqns, twin.eqns, strict=True)
    return next(
        (
            f
            for q, r in pairs
            if (f := _mixing(q, r, nmb, indices=indices, within=within, looped=looped)) is not None
        ),
        None,
    )


@dataclasses.dataclass(frozen=True)
class _Static:
    """The values of variables that ``eqns`` make from literals and constants alone."""

    eqns: Sequence[Any]
    step: TracedStep | None = None
    """Gives the constants' values (the code before the region); None: the region's."""

    @functools.cached_property
    def _producer(self) -> dict[int, Any]:
        return {id(w): e for e in self.eqns for w in e.outvars}

    def value(self, v: Any) -> np.ndarray | None:
        """``v``'s value, or None where it reads an input (or is too large to evaluate)."""
        known: dict[Any, Any] = dict(self.step.const_bindings) if self.step is not None else {}
        return twin_traces.static_value(v, self._producer, known)


@dataclasses.dataclass(frozen=True)
class _Indices:
    """What tells whether a gather's or scatter's per-example indices are each example's own."""

    data: Set[Any]
    """Values made from the examples' values: indices among them (a mixture of experts' routing,
    ``take_along_axis`` by the labels) pick from the example they are made for."""
    mine: _Static | None
    """Index values made from no input, at one microbatch (None inside a call's body: indices
    not read from the batch are taken as each example's own there)."""
    theirs: _Static | None
    """The same at the whole batch."""
    positions: Set[Any] = frozenset()
    """Integers read from the batch (:func:`~autopar._src.twin_traces.read_from_the_batch`):
    indices among them pick the rows of the whole batch that the data pipeline numbered."""
    paired: bool = True
    """Whether the two traces pair one for one (not around a Python loop over the rows): slices
    and pads along the batch are then left to the order walk, which knows the rows' runs."""

    def values(self) -> tuple[loop_restarts.Values, loop_restarts.Values] | None:
        """The static values at one microbatch and at the whole batch, where both are known."""
        if self.mine is None or self.theirs is None:
            return None
        return self.mine.value, self.theirs.value

    def into(self, operands: Sequence[Any], body: Any) -> _Indices:
        """What tells the same inside ``body``, given ``operands`` (its inputs' values outside)."""
        seeds = {
            v
            for a, v in zip(operands, body.invars, strict=True)
            if not compat.is_literal(a) and a in self.positions
        }
        return _Indices(
            frozenset(), None, None, twin_traces.read_from_the_batch(body.eqns, seeds), self.paired
        )


def _own_indices(
    e: Any, other: Any, ins: list[set[int]], operand: set[int], nmb: int, indices: _Indices | None
) -> bool:
    """Whether ``e``'s indices (its second operand; ``other``: its twin at the whole batch) are
    per example and each example's own: made from the examples' values, or, made from none (an
    iota: ``jnp.repeat(jnp.arange(n), k)`` as embedding bags' segments), such that the whole
    batch's are each microbatch's shifted to its rows. A random permutation of the batch, or
    ``jnp.arange(n)[::-1]``, picks by place."""
    if len(ins) < 2 or not ins[1]:
        return False
    if indices is None:
        return True
    if e.invars[1] in indices.positions:
        return False
    if indices.mine is None or indices.theirs is None or e.invars[1] in indices.data:
        return True
    part, whole = indices.mine.value(e.invars[1]), indices.theirs.value(other.invars[1])
    if part is None or whole is None or len(ins[1]) != 1:
        return False
    part, whole = np.asarray(part), np.asarray(whole)
    (dim,) = ins[1]
    numbers = e.params["dimension_numbers"]
    picked = tuple(
        numbers.start_index_map if e.primitive.name == "gather" else numbers.scatter_dims_to_operand_dims
    )
    rows = twin_traces.shape_of(e.invars[0])
    # Microbatch m's indices are the first microbatch's, moved by m microbatches' rows along
    # each per-example dim of the operand they pick.
    shift = np.array([rows[d] if d in operand else 0 for d in picked], dtype=part.dtype)
    expected = np.concatenate([part + m * shift for m in range(nmb)], axis=dim)
    return expected.shape == whole.shape and bool(np.array_equal(expected, whole))
