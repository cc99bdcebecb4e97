"""How a value's rows along the batch are laid out, for the loss function's order check.

A value with one dim per example holds each example's rows where the whole batch's
concatenated microbatches would: as ``k`` *copies* of each example side by side (``x.reshape(-1,
d)`` of ``[n, k, d]``, ``jnp.repeat(x, k, 0)``, tokens flattened from ``[batch, seq]``; one copy
is the batch's plain layout), or *tiled*, ``k`` runs of all the examples one after the other
(``jnp.concatenate([a, b])``, ``jnp.tile``, ``x.T.reshape(-1)``), where a microbatch's rows are
not the whole batch's run for run. :mod:`~autopar._src.example_order` tells them apart where it
matters: ``order // k`` names each copy's row only in the copies layout, an ``iota`` laid out
one way numbers rows sorted from another, and tiled rows combined with copies, or returned per
example, differ from the whole batch's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Layout = tuple[str, int]

PLAIN: Layout = ("copies", 1)
"""One row per example, in the batch's order: also what every unmoved value has."""
OTHER: Layout = ("other", 0)
"""Regrouped in a way not followed (a reshape that splits a run of examples): not checked."""
DIVIDED: Layout = ("divided", 0)
"""A sort's positions divided by ``k`` where the sorted rows were not ``k`` copies side by side."""


def copies(k: int) -> Layout:
    return PLAIN if k == 1 else ("copies", k)


def tiled(k: int) -> Layout:
    return PLAIN if k == 1 else ("tiled", k)


def regrouped(layout: Layout, before: Sequence[int], after: Sequence[int], d_in: int, d_out: int) -> Layout:
    """The layout of a reshape of a value laid out as ``layout`` from shape ``before`` (its
    per-example dim ``d_in``) to ``after`` (``d_out``): merging ``k`` elements after each example
    multiplies its copies, before it its runs; splitting them off again divides them."""
    kind, k = layout
    rows_in, rows_out = before[d_in], after[d_out]
    lead_in, lead_out = math.prod(before[:d_in]), math.prod(after[:d_out])
    if rows_in == rows_out:
        return layout if lead_in == lead_out else OTHER
    if rows_out % rows_in == 0:  # merged with the dims around it
        m = rows_out // rows_in
        if lead_in == lead_out and kind == "copies":
            return copies(k * m)
        if lead_in == lead_out * m and (kind == "tiled" or layout == PLAIN):
            return tiled(k * m)
        return OTHER
    if rows_in % rows_out == 0:  # split into it and others
        m = rows_in // rows_out
        if lead_in == lead_out and kind == "copies" and k % m == 0:
            return copies(k // m)
        if lead_out == lead_in * m and kind == "tiled" and k % m == 0:
            return tiled(k // m)
    return OTHER


def concatenated(layouts: Sequence[Layout], rows: Sequence[int]) -> Layout:
    """The layout of ``len(layouts)`` values concatenated along their per-example dim."""
    if all(layout == PLAIN for layout in layouts) and len(set(rows)) == 1:
        return tiled(len(layouts))
    return OTHER


def divided(layout: Layout, k: int) -> Layout:
    """The layout ``order // k`` numbers, ``order`` numbering rows laid out as ``layout``: each
    copy's example where those are ``k`` (or a multiple of ``k``) copies side by side."""
    kind, copied = layout
    return copies(copied // k) if kind == "copies" and copied % k == 0 else DIVIDED


def fit(a: Layout, b: Layout) -> bool:
    """Whether rows laid out as ``a`` and as ``b`` are each other's one for one in every
    microbatch as in the whole batch: both copies of the examples (any number), or both the same
    runs; unknown layouts are taken to fit."""
    if DIVIDED in (a, b):
        return False
    return OTHER in (a, b) or (a[0] == b[0] == "copies") or a == b
