"""Sorts' permutations along the batch, for the loss function's order check.

:mod:`~autopar._src.example_order` walks the loss function with an :class:`Orders` of what it
knows of each value. This module holds that state and the rules for sorts: a sort's index operand
comes out as a :class:`Perm`, gathering rows of one order by it gives another's, scattering by
it goes back; arithmetic that keeps it a permutation (relabeling, ``jnp``'s index wrapping,
``order // k`` of ``k`` copies side by side) keeps it; rows it picks must be those it numbers,
laid out alike (:mod:`~autopar._src.row_layout`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence, Set
from typing import Any

import numpy as np

from autopar._src import compat, fusion, order_errors, row_layout, twin_traces
from autopar._src.twin_traces import per_example_dims

BATCH = "batch"
"""The batch's order."""
ANY = "any"
"""No order: a fill, made from no example."""
ROWS = "rows"
"""An ``iota`` along the examples: the row numbers of whatever order it meets."""


_RELABELING = fusion.LAYOUT_PRIMITIVES | {
    "broadcast_in_dim",
    "transpose",
    "convert_element_type",
    "copy",
    "copy_p",
}
"""Primitives that keep a permutation's values: ``order[:, None]``, ``order.astype(jnp.int32)``."""
_INDEXED = {"gather": "start_index_map", "scatter": "scatter_dims_to_operand_dims"}
"""The dimension numbers that name the operand's dims a gather's or scatter's indices pick (by
the primitive's name's first seven letters: ``scatter-add`` and all)."""


@dataclasses.dataclass(frozen=True)
class Perm:
    """Positions: gathering rows in order ``src`` by them gives rows in order ``dst``."""

    src: Any
    dst: Any
    rows: int
    """How many rows in order ``src`` they number, at one microbatch: the sort's, or a ``k``-th
    of them for ``order // k`` (the row of each of a token's ``k`` copies)."""
    layout: row_layout.Layout = row_layout.PLAIN
    """How the rows they number are laid out (:mod:`~autopar._src.row_layout`)."""
    dst_layout: row_layout.Layout = row_layout.PLAIN
    """How the rows they gather are laid out: a sort's, plainly; an inverse's, as ``src``'s."""

    def inverse(self, rows: int) -> Perm:
        return Perm(self.dst, self.src, rows, self.dst_layout, self.layout)


class Orders:
    """What the walk knows of each value: its order, permutation, layout, per-example dims."""

    def __init__(self, nmb: int) -> None:
        self.nmb = nmb
        self.order: dict[Any, Any] = {}
        self.perm: dict[Any, Perm] = {}
        self.sorts: dict[int, tuple[Any, str]] = {}  # id(sort equation) -> it and its line
        self.shifted: dict[Any, Perm] = {}
        """Integers a permutation shifted by a constant: floor division's ``q - 1``."""
        self.span: dict[Any, int] = {}
        """How many rows each ``iota`` along the examples numbers (``jnp.repeat(jnp.arange(n),
        k)`` numbers ``n``)."""
        self.consts: dict[Any, Any] = {}
        """Variables bound to literals: a call's divisor."""
        self.layout: dict[Any, row_layout.Layout] = {}
        """How each value's rows are laid out, where not plainly (:mod:`~autopar._src.row_layout`)."""
        self.dims: dict[Any, set[int]] = {}
        """The per-example dims of each value made by an equation with a twin."""
        self.differ = False
        """Whether the two traces differ beyond shapes, paired around the differences."""
        self.placed: Any = None
        """The first equation that places rows by their position along the batch (a slice's
        transpose, a ``pad``) where the two traces are paired around differences: a Python loop
        over the rows makes one per row."""
        self.flipped: dict[Any, Any] = {}
        """Row numbers (an ``iota``) reversed along the batch -> the ``rev`` equation: in a sort
        with rows reversed alike (``jnp.argsort(x, descending=True)``) they number the rows before
        the reversal."""
        self.sorted_alike: dict[tuple[Any, ...], int] = {}
        """What each sort sorts (:meth:`_sorting`) -> the order of the first to sort it."""
        self.flips: dict[Any, Any] = {}
        """Each reversed order of rows -> the first ``rev`` equation that made it."""
        self.numbered_at: dict[Any, Any] = {}
        """Values made from the rows' numbers -> the equation that made the numbers (an ``iota``
        along the examples, ``jnp.linspace(a, b, n)``), for the errors."""
        self.outer = "a line JAX did not record"
        """The line of the innermost loop or call being walked, for equations without their own."""

    def of(self, v: Any) -> Any:
        return None if compat.is_literal(v) else self.order.get(v)

    def constant(self, v: Any) -> Any:
        """``v``'s value where it is a literal or bound to one, else None."""
        return compat.literal_value(v) if compat.is_literal(v) else self.consts.get(v)

    def line(self, e: Any) -> str:
        return compat.source_line(e, self.outer)

    def _perm_of(self, a: Any) -> Perm | None:
        return None if compat.is_literal(a) else self.perm.get(a)

    def _set(self, v: Any, order: Any, perm: Perm | None) -> None:
        if compat.is_dropvar(v):
            return
        if order is not None:
            self.order[v] = order
        if perm is not None:
            self.perm[v] = perm

    def _common(self, e: Any, operands: Iterable[Any], checked: bool) -> Any:
        """The one order of ``operands`` (ANY for none, ROWS for row numbers alone); raises where
        two differ."""
        orders = {self.of(a) for a in operands} - {None, ANY}
        if not orders:
            return ANY
        if orders == {ROWS}:
            return ROWS
        orders.discard(ROWS)
        if len(orders) > 1 and checked:
            self._refuse(e, orders)
        return orders.pop()

    def _kept_perm(self, e: Any, other: Any, ins: list[bool]) -> Perm | None:
        """The permutation an elementwise or layout equation on it keeps: ``[:, None]``, ``// k``
        for the ``k`` copies of a token routed to ``k`` experts, ``jnp``'s wrapping of negative
        indices (adding the dim's size: a literal ``num_microbatches`` times larger at the whole
        batch). Another shift (``order + 1``) or a reflection (``n - 1 - order``) is not the
        permutation; floor division's correction of negative quotients (``select_n`` of ``q - 1``
        and ``q``) keeps it, a permutation having none. Other arithmetic (``order % 2``) does not;
        a relabeling keeps it where its other per-example integer operands are that permutation
        too."""
        name = e.primitive.name
        if name == "div":
            perm, k = self._perm_of(e.invars[0]), self.constant(e.invars[1])
            if perm is None or k is None or np.ndim(k) or int(k) <= 0 or perm.rows % int(k):
                return None
            layout = row_layout.divided(perm.layout, int(k))
            return dataclasses.replace(perm, rows=perm.rows // int(k), layout=layout)
        if name in ("add", "sub"):
            perm = self._perm_of(e.invars[0]) or (self._perm_of(e.invars[1]) if name == "add" else None)
            rest = [(a, b) for a, b in zip(e.invars, other.invars, strict=True) if self._perm_of(a) is None]
            if perm is None or len(rest) != 1:
                return None
            a, b = rest[0]
            if (
                compat.is_literal(a)
                and compat.is_literal(b)
                and np.all(
                    np.asarray(compat.literal_value(b)) == self.nmb * np.asarray(compat.literal_value(a))
                )
            ):
                return perm
            for v in e.outvars:
                self.shifted[v] = perm
            return None
        if name == "select_n":
            cases = [a for a in e.invars[1:] if not compat.is_literal(a)]
            perms = {self._perm_of(a) or self.shifted.get(a) for a in cases}
            return perms.pop() if len(perms) == 1 and any(self._perm_of(a) for a in cases) else None
        if name not in _RELABELING:
            return None
        perms = {self.perm.get(a) for a, per in zip(e.invars, ins, strict=True) if per and integer(a)}
        return perms.pop() if len(perms) == 1 else None

    def _reverse(self, e: Any) -> None:
        """``rev`` along the batch: rows of an order come out in its reverse (a sort's: a
        descending sort's; the batch's: mixup's ``jnp.flip(x, 0)``, which meets nothing in the
        batch's order), their permutation too; row numbers reversed (:attr:`flipped`)."""
        a, v = e.invars[0], e.outvars[0]
        order, perm = self.of(a), self._perm_of(a)
        self.layout[v] = self._layout(a)
        if order in (None, ANY):
            self._set(v, order, None)
        elif order == ROWS:
            self._set(v, ROWS, None)
            if a in self.span:
                self.span[v] = self.span[a]
            if a not in self.flipped:
                self.flipped[v] = e
        else:
            flipped = _flip(order)
            if order in self.sorts:
                self.sorts[flipped] = self.sorts[order]
            self.flips.setdefault(flipped, e)
            self._set(v, flipped, None if perm is None else dataclasses.replace(perm, dst=_flip(perm.dst)))

    def _sort(self, e: Any, checked: bool) -> None:
        keys = e.invars[: e.params.get("num_keys", 1)]
        key_perm = self._perm_of(keys[0]) if len(keys) == 1 else None
        rows = twin_traces.shape_of(keys[0])[e.params["dimension"]]
        if key_perm is not None and self.of(keys[0]) == key_perm.dst:
            # Sorting a permutation's positions: the rows go back to the order they name (a
            # token's k copies side by side, for ``order // k``).
            made = key_perm.inverse(rows)
        else:
            src = self._common(e, [a for a in e.invars if self.of(a) != ROWS], checked)
            src = BATCH if src in (ANY, ROWS) else src
            # Two sorts of the same values (``jnp.argsort(expert)`` called twice) give one order.
            dst = self.sorted_alike.setdefault(self._sorting(e), id(e))
            self.sorts.setdefault(dst, (e, self.line(e)))
            data = [a for a in e.invars if self.of(a) not in (ROWS, None, ANY)]
            made = Perm(src, dst, rows, self._layout(data[0]) if data else row_layout.PLAIN)
        for a, v in zip(e.invars, e.outvars, strict=True):
            # Row numbers reversed with the rows they are sorted with number the rows before
            # (``jnp.argsort(x, descending=True)``: the batch's).
            flipped = not compat.is_literal(a) and a in self.flipped
            numbers = dataclasses.replace(made, src=_flip(made.src)) if flipped else made
            self._set(v, made.dst, numbers if self.of(a) == ROWS else None)

    def _sorting(self, e: Any) -> tuple[Any, ...]:
        """What decides the order ``e`` sorts in: a stable sort's keys (an ``iota`` along the
        examples by what it numbers: each ``jnp.argsort`` makes its own) and dimension; the
        other operands are only carried along."""

        def operand(a: Any) -> Any:
            if compat.is_literal(a):
                return ("literal", str(a))
            if self.of(a) == ROWS and a not in self.perm:
                return ("rows", a in self.flipped, self.span.get(a), str(a.aval))
            return a

        if not e.params.get("is_stable", False):  # ties broken as the sort goes
            return (id(e),)
        keys = e.invars[: e.params.get("num_keys", 1)]
        return (e.params["dimension"], *map(operand, keys))

    def picks_no_example(self, e: Any, other: Any) -> bool:
        """Whether ``e`` is a gather or scatter whose indices pick along no per-example dim."""
        return e.primitive.name[:7] in _INDEXED and not self._along(e, other)

    def _along(self, e: Any, other: Any) -> set[int]:
        """The per-example dims of a gather's or scatter's operand that its indices pick."""
        picked = getattr(e.params["dimension_numbers"], _INDEXED[e.primitive.name[:7]])
        return per_example_dims(e.invars[0], other.invars[0], self.nmb) & set(picked)

    def _gather(self, e: Any, other: Any, checked: bool) -> bool:
        """A gather of the rows of one order by a permutation of them."""
        operand, idx = e.invars[0], e.invars[1]
        perm, along = self._perm_of(idx), self._along(e, other)
        if perm is None or not along:
            return False
        if checked:
            self._require_rows(e, operand, along, perm)
        if self.of(operand) == ROWS:  # ``jnp.arange(n)[order]``: the permutation itself
            # ``jnp.repeat(jnp.arange(n), k)[order]``: ``order // k`` where the sorted rows are
            # ``k`` copies side by side (of tokens that are themselves copies of the examples).
            numbers = self._layout(operand)
            kind, k = numbers
            layout = (
                perm.layout  # plain numbers: the permutation itself, laid out as it is
                if numbers == row_layout.PLAIN
                else row_layout.PLAIN  # the same runs: each one's rows numbered
                if numbers == perm.layout
                else row_layout.divided(perm.layout, k)
                if kind == "copies"
                else row_layout.DIVIDED
            )
            if layout == row_layout.DIVIDED and checked:
                raise self._misplaced(e, perm)
            kept = dataclasses.replace(perm, rows=self.span.get(operand, perm.rows), layout=layout)
            self._set(e.outvars[0], perm.dst, kept if integer(e.outvars[0]) else None)
            return True
        if self.of(operand) not in (perm.src, ANY, None) and checked:
            self._refuse(e, {self.of(operand), perm.src})
        if (
            self.of(operand) not in (ANY, None)
            and not row_layout.fit(self._layout(operand), perm.layout)
            and checked
        ):
            raise self._misplaced(e, perm)
        self._set(e.outvars[0], perm.dst, None)
        self.layout[e.outvars[0]] = perm.dst_layout
        return True

    def _scatter(self, e: Any, other: Any, checked: bool) -> bool:
        """Rows in a permutation's order written back to the order it gathers from."""
        operand, idx, updates = e.invars[0], e.invars[1], e.invars[2]
        perm, along = self._perm_of(idx), self._along(e, other)
        if perm is None or not along:
            return False
        if checked:
            self._require_rows(e, operand, along, perm)
            for a, want in ((operand, perm.src), (updates, perm.dst)):
                if self.of(a) not in (want, ANY, ROWS, None):
                    self._refuse(e, {self.of(a), want})
            if perm.layout == row_layout.DIVIDED or (
                self.of(operand) not in (ANY, None) and not row_layout.fit(self._layout(operand), perm.layout)
            ):
                raise self._misplaced(e, perm)
        # ``zeros.at[order].set(jnp.arange(n))``: the inverse permutation.
        inverse = (
            perm.inverse(twin_traces.shape_of(idx)[0])
            if self.of(updates) == ROWS and integer(e.outvars[0])
            else None
        )
        self._set(e.outvars[0], perm.src, inverse)
        self.layout[e.outvars[0]] = perm.layout
        return True

    def _layout(self, a: Any) -> row_layout.Layout:
        return row_layout.PLAIN if compat.is_literal(a) else self.layout.get(a, row_layout.PLAIN)

    def _misplaced(self, e: Any, perm: Perm) -> ValueError:
        sort = next(self.sorts[o] for o in (perm.dst, perm.src) if o in self.sorts)
        return order_errors.misplaced(e, self.line(e), sort)

    def _lay_out(self, e: Any, operands: Sequence[Any], checked: bool, other: Any = None) -> None:
        """Lays out the rows of ``e``'s results from its per-example ``operands``' (a reshape
        regroups them, a concatenation along the batch runs them one after the other); raises
        where two of them are laid out otherwise (tiled rows against copies)."""
        data = [a for a in operands if self.of(a) not in (None, ANY)]
        layouts = [self._layout(a) for a in data]
        if checked and any(not row_layout.fit(x, y) for x in layouts for y in layouts):
            raise order_errors.mixed_layouts(e, self.line(e))
        name, outs = e.primitive.name, [v for v in e.outvars if len(self.dims.get(v, ())) == 1]
        if not data or not outs:
            return
        (d_out,) = self.dims[outs[0]]
        ins = self.dims.get(data[0], set())
        if name == "reshape" and len(ins) == 1:
            (d_in,) = ins
            before, after = twin_traces.shape_of(data[0]), twin_traces.shape_of(outs[0])
            layout = row_layout.regrouped(layouts[0], before, after, d_in, d_out)
        elif name == "concatenate" and e.params["dimension"] == d_out:
            rows = [twin_traces.shape_of(a)[d_out] for a in e.invars]
            layout = row_layout.concatenated([self._layout(a) for a in e.invars], rows)
        elif name == "split" and ins == {e.params["axis"]}:
            layout = _split(layouts[0], e.params["sizes"])
            if layout == row_layout.OTHER and checked:
                raise order_errors.split_examples(e, self.line(e), self.nmb)
        elif name in ("slice", "pad") and len(ins) == 1 and other is not None and _cut(e, min(ins)):
            sliced = _sliced if name == "slice" else _padded
            layout = sliced(layouts[0], e, other, min(ins), self.nmb)
            if layout == row_layout.OTHER and checked:
                raise order_errors.split_examples(e, self.line(e), self.nmb)
        elif name == "tile" and len(ins) == 1:
            reps = e.params["reps"][d_out]
            layout = row_layout.tiled(reps) if layouts[0] == row_layout.PLAIN else row_layout.OTHER
        elif (
            len(ins) == 1 and twin_traces.shape_of(data[0])[min(ins)] == twin_traces.shape_of(outs[0])[d_out]
        ):
            known = [x for x in layouts if x != row_layout.OTHER]  # a draw's fits what it meets
            layout = next(
                (x for x in known if x != row_layout.PLAIN), row_layout.PLAIN if known else row_layout.OTHER
            )
        else:
            layout = row_layout.OTHER
        for v in outs:
            if layout != row_layout.PLAIN:
                self.layout[v] = layout

    def _require_rows(self, e: Any, operand: Any, along: Set[int], perm: Perm) -> None:
        """Raises where ``e`` gathers or scatters the rows of ``operand`` by a permutation of
        another count of rows (``z[order // 2]`` for a sort of ``z``'s rows)."""
        rows = [twin_traces.shape_of(operand)[d] for d in along]
        if rows != [perm.rows] and len(rows) == 1:
            sort = next(self.sorts[o] for o in (perm.dst, perm.src) if o in self.sorts)
            raise order_errors.rows_not_numbered(e, self.line(e), sort, rows[0], perm.rows)

    def _refuse(self, e: Any, orders: set[Any]) -> None:
        flip = next((self.flips[o] for o in orders if o not in self.sorts and o in self.flips), None)
        if flip is not None:  # the batch's rows reversed
            raise order_errors.reversed_rows(e, self.line(e), flip, self.line(flip), self.nmb)
        sorts = [self.sorts[o] for o in sorted(orders, key=str) if o in self.sorts]
        if not sorts:
            raise self._positions(e)
        raise order_errors.mixed_orders(e, self.line(e), sorts[0])

    def _positions(self, e: Any) -> ValueError:
        """The error for ``e``, which reads the rows' positions in their microbatch."""
        if self.placed is not None:
            return order_errors.placed_by_position(e, self.line(e), self.placed, self.line(self.placed))
        values = [a for a in (*e.invars, *e.outvars) if not compat.is_literal(a)]
        if any(len(self.dims.get(a, ())) > 1 for a in values):  # ``jnp.eye`` against pairs
            return order_errors.pairs(e, self.line(e), self.nmb)
        made = next(
            (self.numbered_at[a] for a in e.invars if not compat.is_literal(a) and a in self.numbered_at), e
        )
        return order_errors.positions(e, self.line(e), made, self.line(made))


def _flip(order: Any) -> Any:
    """The reverse of a sort's order: rows sorted descending."""
    return order[1] if isinstance(order, tuple) and order[0] == "reversed" else ("reversed", order)


def floating(v: Any) -> bool:
    return twin_traces.of_kind(v, np.floating)


def integer(v: Any) -> bool:
    return twin_traces.of_kind(v, np.integer)


def _cut(e: Any, d: int) -> bool:
    """Whether ``e``, a slice or a pad, cuts or pads its operand along dim ``d``."""
    if e.primitive.name == "pad":
        return tuple(e.params["padding_config"][d]) != (0, 0, 0)
    strides = e.params["strides"]
    whole = (0, twin_traces.shape_of(e.invars[0])[d], 1)
    return (e.params["start_indices"][d], e.params["limit_indices"][d], strides[d] if strides else 1) != whole


def _sliced(layout: row_layout.Layout, e: Any, other: Any, d: int, nmb: int) -> row_layout.Layout:
    """The layout of ``e``, a slice along the per-example dim ``d`` (``other``: its twin at the
    whole batch), of rows laid out as ``layout``: whole runs of all the examples, the same ones
    in both traces (``out[:n]`` of ``jnp.concatenate([a, b])`` with ``n = len(a)``), are runs of
    them; any other rows are not each microbatch's part of the whole batch's."""
    kind, k = layout
    strides = e.params["strides"]
    rows = twin_traces.shape_of(e.invars[0])[d]
    start, limit = e.params["start_indices"][d], e.params["limit_indices"][d]
    if kind != "tiled" or (strides is not None and strides[d] != 1):
        return row_layout.OTHER
    run, whole_run = rows // k, rows * nmb // k
    whole = (other.params["start_indices"][d], other.params["limit_indices"][d])
    if start % run or limit % run or whole != (start // run * whole_run, limit // run * whole_run):
        return row_layout.OTHER
    return row_layout.tiled((limit - start) // run)


def _padded(layout: row_layout.Layout, e: Any, other: Any, d: int, nmb: int) -> row_layout.Layout:
    """The layout of ``e``, a pad along the per-example dim ``d`` (``other``: its twin at the
    whole batch) of rows laid out as ``layout`` (a slice's transpose): whole runs of zeros
    before and after runs of all the examples, the same in both traces, make more runs."""
    kind, k = layout
    low, high, interior = e.params["padding_config"][d]
    if kind != "tiled" and layout != row_layout.PLAIN:
        return row_layout.OTHER
    rows = twin_traces.shape_of(e.invars[0])[d]
    run, whole_run = rows // k, rows * nmb // k
    whole = tuple(other.params["padding_config"][d])
    if interior or low < 0 or high < 0 or low % run or high % run:
        return row_layout.OTHER
    if whole != (low // run * whole_run, high // run * whole_run, 0):
        return row_layout.OTHER
    return row_layout.tiled(k + (low + high) // run)


def _split(layout: row_layout.Layout, sizes: Sequence[int]) -> row_layout.Layout:
    """The layout of parts of ``sizes`` rows of rows laid out as ``layout``: equal parts of runs of
    all the examples are runs of them; other parts are not split into examples' rows."""
    kind, k = layout
    parts = len(sizes)
    if kind == "tiled" and k % parts == 0 and len(set(sizes)) == 1:
        return row_layout.tiled(k // parts)
    return row_layout.OTHER
