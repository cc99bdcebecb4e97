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
are refused by :mod:`~autopar._src.example_mixing` whatever the order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Any

import numpy as np

from autopar._src import compat, fusion, layers, order_errors, row_layout, twin_traces
from autopar._src.trace import TracedStep
from autopar._src.twin_traces import per_example_dims

BATCH = "batch"
"""The batch's order."""
ANY = "any"
"""No order: a fill, made from no example."""
ROWS = "rows"
"""An ``iota`` along the examples: the row numbers of whatever order it meets."""

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
_PLACING = frozenset({"pad", "dynamic_update_slice", "concatenate"})
"""Primitives that place rows by their position along the batch, from values with none."""
_COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
_DRAWS = ("random_", "threefry")
"""Prefixes of the primitives that draw random values: a dropout mask's rows are not positions."""


@dataclasses.dataclass(frozen=True)
class _Perm:
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

    def inverse(self, rows: int) -> _Perm:
        return _Perm(self.dst, self.src, rows, self.dst_layout, self.layout)


class _Walk:
    def __init__(self, nmb: int) -> None:
        self.nmb = nmb
        self.order: dict[Any, Any] = {}
        self.perm: dict[Any, _Perm] = {}
        self.sorts: dict[int, tuple[Any, str]] = {}  # id(sort equation) -> it and its line
        self.shifted: dict[Any, _Perm] = {}
        """Integers a permutation shifted by a constant: floor division's ``q - 1``."""
        self.read: set[Any] = set()
        """Integers read from the batch (:func:`~autopar._src.twin_traces.read_from_the_batch`):
        they number the whole batch's rows."""
        self.span: dict[Any, int] = {}
        """How many rows each ``iota`` along the examples numbers (``jnp.repeat(jnp.arange(n),
        k)`` numbers ``n``)."""
        self.consts: dict[Any, Any] = {}
        """Variables bound to literals: a call's divisor."""
        self.positions: set[Any] = set()
        """Values made from the rows' positions in their microbatch as numbers (ranks, a weight
        per row): each microbatch's differ from the whole batch's."""
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
        self.outer = "a line JAX did not record"
        """The line of the innermost loop or call being walked, for equations without their own."""

    def of(self, v: Any) -> Any:
        return None if compat.is_literal(v) else self.order.get(v)

    def constant(self, v: Any) -> Any:
        """``v``'s value where it is a literal or bound to one, else None."""
        return compat.literal_value(v) if compat.is_literal(v) else self.consts.get(v)

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
        for v in e.outvars:
            self._set(v, BATCH if order == ROWS else order if order != ANY else None, None)
            alike = [a for a in e.invars if self.of(a) is not None and a.aval.shape == v.aval.shape]
            self.layout[v] = self._layout(alike[0]) if alike else row_layout.OTHER
            if numbered:
                self.positions.add(v)

    def line(self, e: Any) -> str:
        return compat.source_line(e, self.outer)

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
        ins = [
            not compat.is_literal(a) and bool(per_example_dims(a, b, self.nmb))
            for a, b in zip(e.invars, other.invars, strict=True)
        ]
        for v, w in zip(e.outvars, other.outvars, strict=True):
            self.dims[v] = per_example_dims(v, w, self.nmb)
        outs = [bool(self.dims[v]) for v in e.outvars]
        name = e.primitive.name
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
        made = not any(ins) and name not in _KEEPING and not name.startswith(_DRAWS)
        if made and name in _PLACING and self.differ and self.placed is None and any(outs):
            self.placed = e
        if (
            found == ANY
            and name not in _KEEPING
            and not (_INDEXED.get(name[:7]) and not self._along(e, other))
        ):
            found = BATCH  # made from no example, but maybe not the same along the batch: positions
        naming = name in _NAMING or (name == "convert_element_type" and _integer(e.outvars[0]))
        order = ROWS if found == ROWS and naming else (BATCH if found == ROWS else found)
        self._lay_out(e, [a for a, per in zip(e.invars, ins, strict=True) if per], checked)
        perm = self._kept_perm(e, other, ins)
        kept = perm is not None and any(_integer(v) for v in e.outvars)
        spans = {self.span.get(a) for a in e.invars if self.of(a) == ROWS}
        if order == ROWS and len(spans) == 1 and None not in spans:
            self.span.update((v, *spans) for v in e.outvars)
        values = [a for k, a in enumerate(e.invars) if ins[k] and k in _value_operands(e)]
        numbers = [a for a in values if self._numbered(a, naming, kept)]
        if numbers and checked and any(_float(v) for v in e.outvars):
            data = [a for a in values if a not in numbers and self.of(a) not in (None, ANY, ROWS)]
            if data:
                raise self._positions(e)
        for v, per in zip(e.outvars, outs, strict=True):
            if per:
                self._set(v, order, perm if _integer(v) else None)
                if (numbers and not (kept and _integer(v))) or made:  # made: ``jnp.linspace(a, b, n)``
                    self.positions.add(v)

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
            self._loop(loop.body, twin.body, e.invars, loop.num_consts, loop.num_carry, e.outvars, used)
            return True
        found, found_twin = compat.while_body(e), compat.while_body(other)
        if found is not None and found_twin is not None:
            (body, skip), carries = found, len(e.outvars)
            self._loop(
                body, found_twin[0], e.invars[skip:], len(body.invars) - carries, carries, e.outvars, used
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
        outvars: Sequence[Any],
        used: set[int] | None,
    ) -> None:
        carried = slice(num_consts, num_consts + num_carry)
        ins = list(operands)
        for _ in range(4):  # a sort's order is the sort equation's: settled by the second pass
            self._enter(body.invars, ins)
            self.run(body.eqns, twin.eqns, used)
            if all(
                self.of(a) == self.of(b) and self._perm_of(a) == self._perm_of(b)
                for a, b in zip(body.invars[carried], body.outvars[:num_carry], strict=True)
            ):
                break
            ins[carried] = body.outvars[:num_carry]
        self._enter(outvars, body.outvars)

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

    def _perm_of(self, a: Any) -> _Perm | None:
        return None if compat.is_literal(a) else self.perm.get(a)

    def _set(self, v: Any, order: Any, perm: _Perm | None) -> None:
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

    def _kept_perm(self, e: Any, other: Any, ins: list[bool]) -> _Perm | None:
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
        perms = {self.perm.get(a) for a, per in zip(e.invars, ins, strict=True) if per and _integer(a)}
        return perms.pop() if len(perms) == 1 else None

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
            self.sorts[id(e)] = (e, self.line(e))
            data = [a for a in e.invars if self.of(a) not in (ROWS, None, ANY)]
            made = _Perm(src, id(e), rows, self._layout(data[0]) if data else row_layout.PLAIN)
        for a, v in zip(e.invars, e.outvars, strict=True):
            self._set(v, made.dst, made if self.of(a) == ROWS else None)

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
            numbers = self._layout(operand)  # ``jnp.repeat(jnp.arange(n), k)[order]``: rows' own
            if numbers not in (row_layout.PLAIN, perm.layout) and checked:
                raise self._misplaced(e, perm)
            layout = perm.layout if numbers == row_layout.PLAIN else row_layout.PLAIN
            kept = dataclasses.replace(perm, rows=self.span.get(operand, perm.rows), layout=layout)
            self._set(e.outvars[0], perm.dst, kept if _integer(e.outvars[0]) else None)
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
            if self.of(updates) == ROWS and _integer(e.outvars[0])
            else None
        )
        self._set(e.outvars[0], perm.src, inverse)
        self.layout[e.outvars[0]] = perm.layout
        return True

    def _layout(self, a: Any) -> row_layout.Layout:
        return row_layout.PLAIN if compat.is_literal(a) else self.layout.get(a, row_layout.PLAIN)

    def _misplaced(self, e: Any, perm: _Perm) -> ValueError:
        sort = next(self.sorts[o] for o in (perm.dst, perm.src) if o in self.sorts)
        return order_errors.misplaced(e, self.line(e), sort)

    def _lay_out(self, e: Any, operands: Sequence[Any], checked: bool) -> None:
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
        elif name == "tile" and len(ins) == 1:
            reps = e.params["reps"][d_out]
            layout = row_layout.tiled(reps) if layouts[0] == row_layout.PLAIN else row_layout.OTHER
        elif (
            len(ins) == 1 and twin_traces.shape_of(data[0])[min(ins)] == twin_traces.shape_of(outs[0])[d_out]
        ):
            layout = next((x for x in layouts if x != row_layout.PLAIN), row_layout.PLAIN)
        else:
            layout = row_layout.OTHER
        for v in outs:
            if layout != row_layout.PLAIN:
                self.layout[v] = layout

    def _require_rows(self, e: Any, operand: Any, along: Set[int], perm: _Perm) -> None:
        """Raises where ``e`` gathers or scatters the rows of ``operand`` by a permutation of
        another count of rows (``z[order // 2]`` for a sort of ``z``'s rows)."""
        rows = [twin_traces.shape_of(operand)[d] for d in along]
        if rows != [perm.rows] and len(rows) == 1:
            sort = next(self.sorts[o] for o in (perm.dst, perm.src) if o in self.sorts)
            raise order_errors.rows_not_numbered(e, self.line(e), sort, rows[0], perm.rows)

    def _refuse_renumbered(self, e: Any) -> None:
        """Raises where ``e`` compares integers read from the batch with the rows' numbers."""
        operands = [a for a in e.invars if not compat.is_literal(a)]
        if any(self.of(a) == ROWS for a in operands) and any(a in self.read for a in operands):
            raise order_errors.renumbered(e, self.line(e), self.nmb)

    def _refuse(self, e: Any, orders: set[Any]) -> None:
        sorts = [self.sorts[o] for o in sorted(orders, key=str) if o in self.sorts]
        if not sorts:
            raise self._positions(e)
        raise order_errors.mixed_orders(e, self.line(e), sorts[0])

    def _positions(self, e: Any) -> ValueError:
        """The error for ``e``, which reads the rows' positions in their microbatch."""
        if self.placed is not None:
            return order_errors.placed_by_position(e, self.line(e), self.placed, self.line(self.placed))
        return order_errors.positions(e, self.line(e))

    def refuse_outputs(self, outvars: Sequence[Any], twins: Sequence[Any]) -> None:
        for i, (v, w) in enumerate(zip(outvars, twins, strict=True)):
            if compat.is_literal(v) or not per_example_dims(v, w, self.nmb):
                continue
            if v in self.positions or self.perm.get(v) is not None or self.of(v) == ROWS:
                raise order_errors.positions_returned(i - 1)
            if self.of(v) in self.sorts:
                raise order_errors.sorted_returned(i - 1, self.sorts[self.of(v)])
            if self._layout(v)[0] == "tiled":
                raise order_errors.tiled_returned(i - 1)


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


def _float(v: Any) -> bool:
    return twin_traces.of_kind(v, np.floating)


def _integer(v: Any) -> bool:
    return twin_traces.of_kind(v, np.integer)


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
    rj = step.jaxpr.eqns[step.region_index()].params["info"].jaxpr
    rw = whole.jaxpr.eqns[whole.region_index()].params["info"].jaxpr
    walk = _Walk(nmb)
    for v, w in zip(rj.invars, rw.invars, strict=True):
        walk.dims[v] = per_example_dims(v, w, nmb)
        if walk.dims[v]:
            walk.order[v] = BATCH
            if twin_traces.whole_number(v):
                walk.read.add(v)
    twins = twin_traces.twin_equations(rj.eqns, rw.eqns, nmb)
    walk.differ = len(twins) < len(rj.eqns)
    walk.run(rj.eqns, twins, twin_traces.feeding_outputs(rj, statistics))
    walk.refuse_outputs(rj.outvars, rw.outvars)
