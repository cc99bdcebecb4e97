"""How a draw that follows the batch lays out the examples' rows, read from how its values meet the
batch's.

A draw's shape says nothing of which of its rows are which example's: ``jax.jit`` draws
``bits(key, (2 * B, d))`` and the loss function decides. Reshaped to ``[2, B, d]`` against the
batch's ``[B, d]``, its rows are two *runs* of all the examples (row ``q * B + i`` is example
``i``'s in run ``q``), and microbatch ``j``'s rows of the whole draw are two blocks, one per run;
flattened tokens ``[B * T, d]`` hold each example's rows side by side, one block in all. A
layout here is the number of runs (1: one block, as :mod:`~autopar._src.row_layout`'s copies;
``k``: its ``tiled(k)``), or None where a value's rows are regrouped otherwise.

:func:`runs` follows the draw's values forward from the draw, through the equations after it,
into calls, loops and branches and out of the bodies that hold it, laying out each result from its
operand's (a reshape splits or merges runs), and finds the fewest runs the draw must be made with
for every value of it that meets one of the batch's to be laid out as that one is (as
:mod:`~autopar._src.example_order`'s walk lays the batch's out). Equations that place rows by
their position along the batch (gathers, sorts, pads) end the following: what they make is not
checked, as the walk does not check values it does not follow. Slices along the batch are refused
before (:mod:`~autopar._src.example_mixing`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from autopar._src import compat, layers, row_layout
from autopar._src.sort_permutations import ANY
from autopar._src.twin_traces import per_example_dims, shape_of

Runs = int | None
"""How many runs of the microbatch's examples a value's rows along the batch hold; None:
regrouped otherwise, so they are no microbatch's rows of the whole batch's value."""

_PICKING = frozenset(
    {"gather", "dynamic_slice", "dynamic_update_slice", "sort", "rev", "pad", "concatenate"}
    | {"scatter", "scatter-add", "scatter_add", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
)
"""Primitives that may place rows by their position along the batch: their results are not
followed."""


def runs(
    eqns: Sequence[Any],
    twin_of: Callable[[Any], Any],
    path: Sequence[int],
    walk: Any,
    nmb: int,
    region: Region | None = None,
) -> Runs:
    """The fewest runs the draw at ``path`` in ``eqns`` (traced at one microbatch; ``twin_of``:
    each one's twin at the whole batch) must be made with so that its values meet the batch's
    laid out alike (``walk``: what :mod:`~autopar._src.example_order` knows of the batch's values
    in the loss function); None where no number of runs does. ``region``: for a draw before the
    loss function, its equation, to follow the draw's values into it."""
    chain = _chain(eqns, twin_of, path)
    if chain is None:
        return 1  # the traces differ around the draw: nothing to follow
    inner, at, inner_twin = chain[-1]
    other = inner_twin(inner[at])
    if other is None:
        return 1
    draw = inner[at]
    rows = shape_of(draw.outvars[0])
    dims = per_example_dims(draw.outvars[0], other.outvars[0], nmb)
    if len(dims) != 1:
        return 1
    (d,) = dims
    for k in (k for k in range(1, rows[d] + 1) if rows[d] % k == 0):
        follow = _Follow(walk, nmb, region)
        follow.seed(draw.outvars[0], other.outvars[0], k)
        if follow.out_of(chain):
            return k
    return None


class Region(NamedTuple):
    """The loss function's equation in the step, its twin, and its equations' twins by ``id``."""

    eqn: Any
    twin: Any
    twins: Mapping[int, Any]


Level = tuple[Sequence[Any], int, Callable[[Any], Any]]
"""A body's equations, the index of the one holding the draw (or the draw), and its twin of each."""


def _chain(eqns: Sequence[Any], twin_of: Callable[[Any], Any], path: Sequence[int]) -> list[Level] | None:
    """The bodies from ``eqns`` down to the draw, each paired with its twin."""
    chain: list[Level] = [(eqns, path[0], twin_of)]
    for b, k in zip(path[1::2], path[2::2], strict=True):
        eqn = eqns[chain[-1][1]]
        other = chain[-1][2](eqn)
        if other is None:
            return None
        body, twin = compat.bodies(eqn)[b], compat.bodies(other)[b]
        if len(body.eqns) != len(twin.eqns):
            return None
        eqns = body.eqns
        chain.append((eqns, k, _pairing(body.eqns, twin.eqns)))
    return chain


def _pairing(eqns: Sequence[Any], twins: Sequence[Any]) -> Callable[[Any], Any]:
    by_id = {id(e): t for e, t in zip(eqns, twins, strict=True)}
    return lambda e: by_id.get(id(e))


class _Follow:
    """The draw's values (each with its twin and its runs) as the equations after it make them."""

    def __init__(self, walk: Any, nmb: int, region: Region | None) -> None:
        self.walk = walk
        self.nmb = nmb
        self.region = region
        self.runs: dict[Any, Runs] = {}
        self.twin: dict[Any, Any] = {}
        self.ok = True

    def seed(self, v: Any, w: Any, k: Runs) -> None:
        self.runs[v], self.twin[v] = k, w

    def out_of(self, chain: list[Level]) -> bool:
        """Follows the draw to the end of its body, then out of each body holding it: whether
        every value of it that meets the batch's is laid out alike."""
        for depth in range(len(chain) - 1, -1, -1):
            eqns, at, twin_of = chain[depth]
            self.run(eqns[at + 1 :], twin_of)
            if depth:
                outer, at_outer, outer_twin = chain[depth - 1]
                holder = outer[at_outer]
                body = _holding(holder, chain[depth][0])
                other = outer_twin(holder)
                if body is None or other is None:
                    return self.ok
                self._out(body.outvars, holder.outvars, other.outvars)
        return self.ok

    def run(self, eqns: Sequence[Any], twin_of: Callable[[Any], Any]) -> None:
        for e in eqns:
            if any(self._has(a) for a in e.invars):
                self.eqn(e, twin_of(e))

    def _has(self, a: Any) -> bool:
        return not compat.is_literal(a) and a in self.runs

    def eqn(self, e: Any, other: Any) -> None:
        if self.region is not None and e is self.region.eqn:  # into the loss function
            loss, twin = (x.params["info"].jaxpr for x in (e, self.region.twin))
            for v, w, a in zip(
                [*loss.constvars, *loss.invars], [*twin.constvars, *twin.invars], e.invars, strict=True
            ):
                if self._has(a):
                    self.seed(v, w, self.runs[a])
            self.run(loss.eqns, lambda x: self.region.twins.get(id(x)) if self.region else None)
            return
        if layers.is_boundary(e):  # an identity per value: it meets nothing
            for a, v, w in zip(e.invars, e.outvars, other.outvars if other else e.outvars, strict=True):
                if self._has(a) and not compat.is_dropvar(v):
                    self.seed(v, self.twin[a] if other is None else w, self.runs[a])
            return
        if other is None:
            self._meet(e)
            return
        body, twin = compat.operand_body(e), compat.operand_body(other)
        if body is not None and twin is not None and len(body.eqns) == len(twin.eqns):
            self._into(body, twin, e.invars, other.invars)
            self._out(body.outvars, e.outvars, other.outvars)
            return
        branches, twin_branches = compat.cond_branches(e), compat.cond_branches(other)
        if branches is not None and twin_branches is not None:
            outs: list[set[Runs]] = [set() for _ in e.outvars]
            for (b, _), (t, _) in zip(branches, twin_branches, strict=True):
                if len(b.eqns) == len(t.eqns):
                    self._into(b, t, e.invars[1:], other.invars[1:])
                    for k, o in enumerate(b.outvars):
                        if self._has(o):
                            outs[k].add(self.runs[o])
            for v, w, made in zip(e.outvars, other.outvars, outs, strict=True):
                if made:
                    self.seed(v, w, made.pop() if len(made) == 1 else None)
            return
        loop, twin_loop = compat.scan_loop(e), compat.scan_loop(other)
        if loop is not None and twin_loop is not None and len(loop.body.eqns) == len(twin_loop.body.eqns):
            self._into(loop.body, twin_loop.body, e.invars, other.invars)
            self._out(loop.body.outvars, e.outvars, other.outvars)
            return
        held, twin_held = compat.while_body(e), compat.while_body(other)
        if held is not None and twin_held is not None and len(held[0].eqns) == len(twin_held[0].eqns):
            (inner, skip), (twin_inner, twin_skip) = held, twin_held
            self._into(inner, twin_inner, e.invars[skip:], other.invars[twin_skip:])
            self._out(inner.outvars, e.outvars, other.outvars)
            return
        self._meet(e)
        if e.primitive.name in _PICKING or compat.bodies(e):
            return
        operand = next(a for a in e.invars if self._has(a))
        for k, (v, w) in enumerate(zip(e.outvars, other.outvars, strict=True)):
            if compat.is_dropvar(v) or len(per_example_dims(v, w, self.nmb)) != 1:
                continue
            self.seed(v, w, self._laid_out(e, other, operand, k))

    def _into(self, body: Any, twin: Any, operands: Sequence[Any], twin_operands: Sequence[Any]) -> None:
        for v, w, a in zip(body.invars, twin.invars, operands, strict=True):
            if self._has(a):
                self.seed(v, w, self.runs[a])
        self.run(body.eqns, _pairing(body.eqns, twin.eqns))

    def _out(self, results: Sequence[Any], outvars: Sequence[Any], twins: Sequence[Any]) -> None:
        for o, v, w in zip(results, outvars, twins, strict=True):
            if self._has(o) and not compat.is_dropvar(v):
                self.seed(v, w, self.runs[o])

    def _meet(self, e: Any) -> None:
        """Marks the draw laid out otherwise where ``e`` reads one of its values regrouped so
        that its rows are no microbatch's, or meets one of the batch's (or another of its own)
        laid out otherwise."""
        mine = {self.runs[a] for a in e.invars if self._has(a)}
        if len(mine) > 1 or None in mine:  # rows regrouped otherwise are no microbatch's: not read
            self.ok = False
        theirs = [
            self.walk.layout.get(a, row_layout.PLAIN)
            for a in e.invars
            if not compat.is_literal(a)
            and a not in self.runs
            and self.walk.of(a) not in (None, ANY)
            and self.walk.dims.get(a)
        ]
        if any(not _fits(r, layout) for r in mine for layout in theirs):
            self.ok = False

    def _laid_out(self, e: Any, other: Any, operand: Any, k: int) -> Runs:
        """The runs of ``e``'s result ``k`` made from the draw's ``operand``."""
        v, w = e.outvars[k], other.outvars[k]
        dims_in = per_example_dims(operand, self.twin[operand], self.nmb)
        (d_out,) = per_example_dims(v, w, self.nmb)
        held = self.runs[operand]
        if held is None or len(dims_in) != 1:
            return None
        (d_in,) = dims_in
        before, after = shape_of(operand), shape_of(v)
        name = e.primitive.name
        if name in ("reshape", "squeeze"):
            return _regrouped(held, before, after, d_in, d_out)
        return held if before[d_in] == after[d_out] else None


def _holding(eqn: Any, eqns: Sequence[Any]) -> Any:
    """The body of ``eqn`` whose equations are ``eqns``."""
    return next((b for b in compat.bodies(eqn) if b.eqns is eqns), None)


def _fits(runs: Runs, layout: row_layout.Layout) -> bool:
    """Whether rows of the draw in ``runs`` meet rows of the batch laid out as ``layout`` one for
    one (the batch's regrouped otherwise are not checked, as the walk does not check them)."""
    kind, k = layout
    if kind not in ("copies", "tiled"):
        return True
    if runs is None:
        return False
    return runs == 1 if kind == "copies" else runs == k


def _regrouped(runs: int, before: Sequence[int], after: Sequence[int], d_in: int, d_out: int) -> Runs:
    """The runs of a reshape from ``before`` (rows along ``d_in`` in ``runs``) to ``after``."""
    n, n_out = before[d_in], after[d_out]
    lead_in, lead_out = math.prod(before[:d_in]), math.prod(after[:d_out])
    if n_out % n == 0 and lead_in % lead_out == 0 and (n_out // n) % (lead_in // lead_out) == 0:
        return runs * (lead_in // lead_out)  # merged with dims around it: the ones before make runs
    if n % n_out == 0 and lead_out % lead_in == 0 and (n // n_out) % (lead_out // lead_in) == 0:
        split_off = lead_out // lead_in  # split into dims before and after it
        trailing = n // n_out // split_off
        if runs % split_off == 0 and (n // runs) % trailing == 0:
            return runs // split_off
    return None
