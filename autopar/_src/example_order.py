"""Examples sorted inside the loss function, refused with microbatches where the order matters.

A sort along the batch inside the loss function puts each microbatch's examples in the order of
that microbatch alone: the first row is the microbatch's smallest, not the whole batch's. What is
made from the sorted rows is still each example's own while it stays among rows sorted the same
way and goes back to the batch's order before it meets anything else: a dropless mixture of
experts sorts its tokens by expert, runs each expert on its run of rows and scatters them back
(``zeros.at[order].set(y)``, or gathers them by the inverse permutation); a mean of the sorted
losses is the mean of the losses. Rows in a sort's order that meet rows in the batch's order
(``z[jnp.argsort(s)]`` against the labels), or positions (a weight per rank,
``jnp.sort(losses) * jnp.linspace(...)``), or that the loss function returns per example, would
give each microbatch another result than ``jax.jit``'s whole batch: refused, naming the sort.

Each value with a dim per example (``num_microbatches`` times longer in the step traced at the
whole batch) gets an *order*: the batch's, a sort's (the sort equation), or none (a fill, made
from no example: it suits any order). Integer values made from a sort's index operand (an
``iota``: ``jnp.argsort``) are *permutations*: gathering rows in one order by them gives rows in
another, scattering rows by them goes back. ``iota`` itself numbers the rows of whatever order
it is used in while it only names them (shifted, compared for equality with other row numbers,
the ids of ``jax``'s derivative of a scatter); used as a number (weights, thresholds) it is a
position in the batch's order. Sorts, slices and gathers by position that pick a few examples
are refused by :mod:`~autopar._src.example_mixing` whatever the order. Permutations, layouts
and what is known of each value are in :mod:`~autopar._src.sort_permutations` and
:mod:`~autopar._src.row_layout`. The batch's integers compared with the rows' numbers (a one-hot
of partner rows) are refused, and so is a Python loop over the rows (``jax.vmap`` does the same
in one equation): the traces differ there and its rows are not followed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

from autopar._src import compat, layers, order_errors, row_layout, sort_permutations, twin_traces
from autopar._src.sort_permutations import ANY, BATCH, ROWS, floating, integer
from autopar._src.trace import TracedStep
from autopar._src.twin_traces import per_example_dims

_NAMING = frozenset(
    {
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "tile",
        "add",
        "sub",
        "eq",
        "ne",
        "copy",
        "copy_p",
    }
)
"""Primitives that keep ``iota``'s row numbers names of the rows (``jax``'s scatter ids, shifted
by one and compared for equality), integer conversions besides."""


_KEEPING = twin_traces.KEEPING_PRIMITIVES
_PLACING = frozenset({"pad", "dynamic_update_slice", "concatenate"})
"""Primitives that place rows by their position along the batch, from values with none."""
_COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
_DRAWS = ("random_", "threefry")
"""Prefixes of the primitives that draw random values: a dropout mask's rows are not positions."""


def _broadcasts(e: Any) -> bool:
    """Whether ``e`` is a ``tile`` that repeats only dims of length 1 (``jnp.tile(cls, (b, 1, 1))``
    of a class token): a broadcast, the same along every dim it makes longer."""
    if e.primitive.name != "tile":
        return False
    shape = e.invars[0].aval.shape
    return all(r == 1 or n == 1 for n, r in zip(shape, e.params["reps"], strict=False))


class _Walk(sort_permutations.Orders):
    def __init__(self, nmb: int) -> None:
        super().__init__(nmb)
        self.read: set[Any] = set()
        """Integers read from the batch (:func:`~autopar._src.twin_traces.read_from_the_batch`):
        they number the whole batch's rows."""
        self.positions: set[Any] = set()
        """Values made from the rows' positions in their microbatch as numbers (ranks, a weight
        per row): each microbatch's differ from the whole batch's."""

    def run(
        self, eqns: Sequence[Any], twins: Sequence[Any] | Mapping[int, Any], used: set[int] | None
    ) -> None:
        """Walks ``eqns``; ``twins``: theirs at the whole batch, one for one or by ``id``."""
        twin = twins if isinstance(twins, Mapping) else dict(zip(map(id, eqns), twins, strict=True))
        for e in eqns:
            outer, self.outer = self.outer, self.line(e)
            other = twin.get(id(e))
            checked = used is None or id(e) in used
            if other is None:
                self._untwinned(e, checked)
            else:
                self.eqn(e, other, checked)
            self.outer = outer

    def _untwinned(self, e: Any, checked: bool) -> None:
        """An equation the trace at the whole batch has not (an einsum's contraction order there):
        its results in the one order of its operands."""
        if e.primitive.name == "unstack" and checked:
            axis = e.params["axis"] % len(twin_traces.shape_of(e.invars[0]))
            if self.of(e.invars[0]) not in (None, ANY) and axis in self.dims.get(e.invars[0], ()):
                raise order_errors.rows_one_by_one(e, self.line(e))
        order = self._common(e, [a for a in e.invars if self.of(a) is not None], checked)
        numbered = any(not compat.is_literal(a) and a in self.positions for a in e.invars)
        self._number(e, e.invars)
        for v in e.outvars:
            self._set(v, BATCH if order == ROWS else order if order != ANY else None, None)
            alike = [a for a in e.invars if self.of(a) is not None and a.aval.shape == v.aval.shape]
            self.layout[v] = self._layout(alike[0]) if alike else row_layout.OTHER
            if numbered:
                self.positions.add(v)

    def eqn(self, e: Any, other: Any, checked: bool) -> None:
        if layers.is_boundary(e):  # an identity per value
            self._enter(e.outvars, e.invars)
            return
        body, twin = compat.operand_body(e), compat.operand_body(other)
        if body is not None and twin is not None and len(body.eqns) == len(twin.eqns):
            self._enter(body.invars, e.invars)
            self.run(body.eqns, twin.eqns, None if checked else set())
            self._enter(e.outvars, body.outvars)
            return
        if self._control(e, other, checked):
            return
        name = e.primitive.name
        ins = [
            not compat.is_literal(a) and bool(per_example_dims(a, b, self.nmb))
            for a, b in zip(e.invars, other.invars, strict=True)
        ]
        for v, w in zip(e.outvars, other.outvars, strict=True):
            self.dims[v] = per_example_dims(v, w, self.nmb)
        outs = [bool(self.dims[v]) for v in e.outvars]
        if name == "rev" and set(e.params["dimensions"]) & per_example_dims(
            e.invars[0], other.invars[0], self.nmb
        ):
            self._reverse(e)
            return
        if twin_traces.reads_the_batch(e, self.read):
            self.read.update(v for v in e.outvars if twin_traces.whole_number(v))
        if name == "convert_element_type" and (k := self.constant(e.invars[0])) is not None:
            self.consts[e.outvars[0]] = k
        if name in _COMPARISONS and checked:
            self._refuse_renumbered(e)
        if name == "iota":
            if outs[0] and e.params["dimension"] in per_example_dims(
                e.outvars[0], other.outvars[0], self.nmb
            ):
                self._set(e.outvars[0], ROWS, None)
                self.span[e.outvars[0]] = twin_traces.shape_of(e.outvars[0])[e.params["dimension"]]
                self.numbered_at[e.outvars[0]] = e
            elif outs[0]:
                self._set(e.outvars[0], ANY, None)
            return
        if (
            name == "sort"
            and ins
            and ins[0]
            and e.params["dimension"] in per_example_dims(e.invars[0], other.invars[0], self.nmb)
        ):
            self._sort(e, checked)
            return
        if name == "gather" and self._gather(e, other, checked):
            return
        if name.startswith("scatter") and self._scatter(e, other, checked):
            return
        found = self._common(e, [a for a, per in zip(e.invars, ins, strict=True) if per], checked)
        keeps = name in _KEEPING or _broadcasts(e)
        made = not any(ins) and not keeps and not name.startswith(_DRAWS)
        if made and name in _PLACING and self.differ and self.placed is None and any(outs):
            self.placed = e
        if found == ANY and not keeps and not self.picks_no_example(e, other):
            found = BATCH  # made from no example, but maybe not the same along the batch: positions
        naming = name in _NAMING or (name == "convert_element_type" and integer(e.outvars[0]))
        order = ROWS if found == ROWS and naming else (BATCH if found == ROWS else found)
        self._lay_out(e, [a for a, per in zip(e.invars, ins, strict=True) if per], checked, other)
        if name.startswith(_DRAWS):  # laid out as the rows it meets (draw_layout.py)
            self.layout.update((v, row_layout.OTHER) for v in e.outvars if not compat.is_dropvar(v))
        perm = self._kept_perm(e, other, ins)
        kept = perm is not None and any(integer(v) for v in e.outvars)
        spans = {self.span.get(a) for a in e.invars if self.of(a) == ROWS}
        if order == ROWS and len(spans) == 1 and None not in spans:
            self.span.update((v, *spans) for v in e.outvars)
        values = [a for k, a in enumerate(e.invars) if ins[k] and k in _value_operands(e)]
        numbers = [a for a in values if self._numbered(a, naming, kept)]
        self._number(e, numbers)
        if numbers and checked and any(floating(v) for v in e.outvars):
            data = [a for a in values if a not in numbers and self.of(a) not in (None, ANY, ROWS)]
            if data:
                raise self._positions(e)
        for v, per in zip(e.outvars, outs, strict=True):
            if per:
                self._set(v, order, perm if integer(v) else None)
                if (numbers and not (kept and integer(v))) or made:  # made: ``jnp.linspace(a, b, n)``
                    self.positions.add(v)
                    self.numbered_at.setdefault(v, e)

    def _number(self, e: Any, operands: Sequence[Any]) -> None:
        """``e``'s results are made from the rows' numbers where one of ``operands`` is."""
        made = next(
            (self.numbered_at[a] for a in operands if not compat.is_literal(a) and a in self.numbered_at),
            None,
        )
        if made is not None:
            self.numbered_at.update((v, made) for v in e.outvars if not compat.is_dropvar(v))

    def _numbered(self, a: Any, naming: bool, kept: bool) -> bool:
        """Whether ``a`` is read for the positions of the rows as numbers: made from them, a
        permutation not kept as one (ranks, a double argsort's), an ``iota`` along the batch
        other than as names of the rows."""
        return (
            a in self.positions
            or (self._perm_of(a) is not None and not kept)
            or (self.of(a) == ROWS and not naming)
        )

    def _control(self, e: Any, other: Any, checked: bool) -> bool:
        """Walks a ``scan``'s, ``while``'s or ``cond``'s bodies with their operands' orders (a
        loop's carries again until their orders settle); False for another equation."""
        used: set[int] | None = None if checked else set()
        loop, twin = compat.scan_loop(e), compat.scan_loop(other)
        if loop is not None and twin is not None:
            results = (e.outvars, other.outvars)
            self._loop(loop.body, twin.body, e.invars, loop.num_consts, loop.num_carry, results, used)
            return True
        found, found_twin = compat.while_body(e), compat.while_body(other)
        if found is not None and found_twin is not None:
            (body, skip), carries = found, len(e.outvars)
            self._loop(
                body,
                found_twin[0],
                e.invars[skip:],
                len(body.invars) - carries,
                carries,
                (e.outvars, other.outvars),
                used,
            )
            return True
        branches, twins = compat.cond_branches(e), compat.cond_branches(other)
        if branches is None or twins is None or any(c for _, c in branches + twins):
            return False
        outs: list[set[Any]] = [set() for _ in e.outvars]
        for (body, _), (twin_body, _) in zip(branches, twins, strict=True):
            self._enter(body.invars, e.invars[1:])
            self.run(body.eqns, twin_body.eqns, used)
            for k, b in enumerate(body.outvars):
                outs[k].add(self.of(b))
        for v, b, orders in zip(e.outvars, branches[0][0].outvars, outs, strict=True):
            orders -= {None, ANY, ROWS}
            if len(orders) > 1 and checked:
                self._refuse(e, orders)
            self._set(v, orders.pop() if orders else self.of(b), None)
        return True

    def _loop(
        self,
        body: Any,
        twin: Any,
        operands: Sequence[Any],
        num_consts: int,
        num_carry: int,
        outvars: tuple[Sequence[Any], Sequence[Any]],
        used: set[int] | None,
    ) -> None:
        """Walks a loop's ``body`` (``twin``: at the whole batch), its carries again until their
        orders settle. ``outvars``: the loop's results and their twins."""
        carried = slice(num_consts, num_consts + num_carry)
        ins = list(operands)
        for _ in range(4):  # a sort's order is the sort equation's: settled by the second pass
            self._enter(body.invars, ins)
            self._redim(body.invars, twin.invars)  # a scanned array's slice has a dim less
            self.run(body.eqns, twin.eqns, used)
            if all(
                self.of(a) == self.of(b) and self._perm_of(a) == self._perm_of(b)
                for a, b in zip(body.invars[carried], body.outvars[:num_carry], strict=True)
            ):
                break
            ins[carried] = body.outvars[:num_carry]
        self._enter(outvars[0], body.outvars)
        self._redim(*outvars)  # a scan's stacked results have a dim more

    def _redim(self, into: Sequence[Any], twins: Sequence[Any]) -> None:
        for v, w in zip(into, twins, strict=True):
            if not compat.is_literal(v):
                self.dims[v] = per_example_dims(v, w, self.nmb)

    def _enter(self, into: Sequence[Any], values: Sequence[Any]) -> None:
        """Gives each variable of ``into`` the order, permutation, constant value and whether it
        is read from the batch of its value in ``values``."""
        for v, a in zip(into, values, strict=True):
            self._set(v, self.of(a), self._perm_of(a))
            if not compat.is_literal(a) and a in self.dims:
                self.dims[v] = self.dims[a]
            if not compat.is_literal(a) and a in self.layout:
                self.layout[v] = self.layout[a]
            if not compat.is_literal(a) and a in self.span:
                self.span[v] = self.span[a]
            if (k := self.constant(a)) is not None:
                self.consts[v] = k
            if not compat.is_literal(a) and a in self.read:
                self.read.add(v)
            if not compat.is_literal(a) and a in self.positions:
                self.positions.add(v)
            if not compat.is_literal(a) and a in self.numbered_at:
                self.numbered_at[v] = self.numbered_at[a]
            if not compat.is_literal(a) and a in self.flipped:
                self.flipped[v] = self.flipped[a]

    def _refuse_renumbered(self, e: Any) -> None:
        """Raises where ``e`` compares integers read from the batch with the rows' numbers."""
        operands = [a for a in e.invars if not compat.is_literal(a)]
        if any(self.of(a) == ROWS for a in operands) and any(a in self.read for a in operands):
            raise order_errors.renumbered(e, self.line(e), self.nmb)

    def refuse_outputs(
        self, outvars: Sequence[Any], twins: Sequence[Any], name: Callable[[int], str]
    ) -> None:
        for i, (v, w) in enumerate(zip(outvars, twins, strict=True)):
            if compat.is_literal(v) or not per_example_dims(v, w, self.nmb):
                continue
            if v in self.positions or self.perm.get(v) is not None or self.of(v) == ROWS:
                raise order_errors.positions_returned(name(i))
            if self.of(v) in self.flips and self.of(v) not in self.sorts:
                raise order_errors.positions_returned(name(i))  # the batch's rows reversed
            if self.of(v) in self.sorts:
                raise order_errors.sorted_returned(name(i), self.sorts[self.of(v)])
            if self._layout(v)[0] == "tiled":
                raise order_errors.tiled_returned(name(i))


def _value_operands(e: Any) -> range | tuple[int, ...]:
    """The operands of ``e`` read as values, not as indices into another."""
    name = e.primitive.name
    if name in ("gather", "dynamic_slice"):
        return (0,)
    if name == "dynamic_update_slice":
        return (0, 1)
    if name.startswith("scatter"):
        return (0, 2)
    return range(len(e.invars))


def require_batch_order_in_loss(
    step: TracedStep, whole: TracedStep, nmb: int, statistics: Set[Any] = frozenset()
) -> None:
    """Raises if the grad region of ``step`` (traced at one of ``nmb`` microbatches; ``whole``: at
    the whole batch, with the same cuts) combines examples sorted along the batch with others in
    another order, or returns them per example (see the module's docstring). Equations that
    only make ``statistics`` (made from the whole batch) are not checked.

    Raises:
      ValueError: naming the sort and the equation, with their source lines.
    """
    walk, (rj, rw), twins = walked(step, whole, nmb)
    walk.run(rj.eqns, twins, twin_traces.feeding_outputs(rj, statistics))
    walk.refuse_outputs(
        rj.outvars, rw.outvars, step.jaxpr.eqns[step.region_index()].params["info"].output_name
    )


def walked(
    step: TracedStep, whole: TracedStep, nmb: int, *, run: bool = False
) -> tuple[_Walk, tuple[Any, Any], dict[int, Any]]:
    """The walk of the loss function (what it knows of each value: orders, per-example dims,
    layouts), the loss function traced at one microbatch and at the whole batch, and its
    equations' twins (by ``id``). With ``run``, walked already, raising nothing. The loss
    function's operands are laid out as the step's code before it lays out the batch's rows."""
    at, at_whole = step.region_index(), whole.region_index()
    region = step.jaxpr.eqns[at]
    rj = region.params["info"].jaxpr
    rw = whole.jaxpr.eqns[at_whole].params["info"].jaxpr
    walk = _Walk(nmb)
    # The batch's rows as the step lays them out before the loss function (``jnp.tile``), unchecked.
    _seed(walk, step.arg_vars, whole.arg_vars)
    before, before_whole = step.jaxpr.eqns[:at], whole.jaxpr.eqns[:at_whole]
    walk.run(before, twin_traces.twin_equations(before, before_whole, nmb), set())
    laid = {
        v: walk.layout[a]
        for v, a in zip([*rj.constvars, *rj.invars], region.invars, strict=True)
        if not compat.is_literal(a) and a in walk.layout
    }
    walk = _Walk(nmb)
    _seed(walk, rj.invars, rw.invars)
    walk.layout.update(laid)
    twins = twin_traces.twin_equations(rj.eqns, rw.eqns, nmb)
    walk.differ = len(twins) < len(rj.eqns)
    if run:
        walk.run(rj.eqns, twins, set())
    return walk, (rj, rw), twins


def _seed(walk: _Walk, mine: Sequence[Any], theirs: Sequence[Any]) -> None:
    """Values read from the batch: ``mine`` at one microbatch, ``theirs`` at the whole batch."""
    for v, w in zip(mine, theirs, strict=True):
        walk.dims[v] = per_example_dims(v, w, walk.nmb)
        if walk.dims[v]:
            walk.order[v] = BATCH
            if twin_traces.whole_number(v):
                walk.read.add(v)
