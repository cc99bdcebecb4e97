"""Layer clustering: where to cut the forward equation sequence into layers.

The forward loss is ``n`` equations in topological order. A cut at position
``p`` (``1 <= p <= n - 1``) puts equations ``[0, p)`` before it and ``[p, n)``
after it. Only *heavy* equations (nonzero FLOPs: matmuls, convolutions) are
balanced; ``cut_bytes[p]`` is what stays live across a cut at ``p``.

For ``L`` layers the clustering picks ``L - 1`` strictly increasing cuts such
that every layer holds at least one heavy equation and, when possible, every
layer's FLOPs are at most ``(1 + tolerance) * total / L``. Among those it
minimises, in order:

1. the largest ``cut_bytes`` over the cuts (what one boundary sends);
2. the sum of squared deviations of layer FLOPs from ``total / L``;
3. the sum of ``cut_bytes`` over the cuts;
4. the cut vector itself, lexicographically (so the answer is unique).

If no placement meets the FLOPs bound (say, one op holds most of the FLOPs) the
bound is relaxed to the smallest achievable largest-layer FLOPs, the same
objective is applied among the placements that achieve it, and the result is
flagged ``balanced=False``.

Equal objectives are found exactly for integer-valued inputs whose squared
layer FLOPs stay below 2**53; beyond that, ties within float rounding are broken
deterministically but not necessarily lexicographically.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable

import numpy as np

_INF = np.inf

BYTES_FACTOR = 4.0
"""How much wider than the two-layer cut the widest cut of an automatic clustering may be.

A conv net's reference cut sits in its narrow late feature maps while its first blocks hold
maps several times wider, so a tight factor (2) left those blocks as one or two layers, and
the stage search could not balance a pipeline through them (a Wide-ResNet clustered into 4
layers). Each cut's transfer is priced by the stage search anyway; at 4 the early blocks are
cut too, while a transformer, whose cuts all carry the same residual stream, is unaffected."""

BYTES_FACTORS = (BYTES_FACTOR, 2.0, 8.0)
"""The slacks whose clusterings the stage search plans with, keeping the fastest plan.

No one factor suits every model: a coarse clustering keeps cuts off wide activations (and the
analytic costs charge a tensor-parallel stage's all-reduces at each of its boundaries), a fine
one lets the stage DP balance a conv net's wide early blocks. :data:`BYTES_FACTOR` comes first;
factors giving the same layer count are planned once."""

UNBALANCED_FACTORS = (8.0,)
"""Slacks whose finest clustering is planned too when it cannot be balanced.

A conv net's convolutions differ several-fold in FLOPs, so past some count no clustering keeps
every layer within the balance tolerance, and the balanced ones stop there (20 layers for a
Wide-ResNet of 54 convolutions). Finer layers, as even as they can be, still let the stage DP
cut its stages closer to equal; each such factor adds the largest count whose widest cut it
allows, balanced or not (:func:`candidate_layer_counts`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Clustering:
    """Where the forward equations are cut into layers, and what that costs.

    Example:
      >>> c = cluster_layers(np.array([1.0, 0, 1, 0]), np.array([0.0, 5, 1, 5, 0]), num_layers=2)
      >>> c.cuts
      (2,)
    """

    cuts: tuple[int, ...]
    """Cut positions, strictly increasing; layer ``k`` is equations ``[cuts[k-1], cuts[k])``."""
    layer_flops: tuple[float, ...]
    """FLOPs of each layer (``len(cuts) + 1`` entries)."""
    max_cut_bytes: float
    """Largest ``cut_bytes`` over the cuts (0 for a single layer)."""
    balanced: bool
    """Whether every layer is within ``(1 + tolerance) * total / L``; if not, the
    largest layer is the smallest achievable (see :attr:`max_layer_flops`)."""

    def __post_init__(self) -> None:
        if len(self.layer_flops) != len(self.cuts) + 1:
            raise ValueError(
                f"layer_flops has {len(self.layer_flops)} entries but cuts={self.cuts} "
                f"makes {len(self.cuts) + 1} layers"
            )
        if any(b <= a for a, b in itertools.pairwise(self.cuts)):
            raise ValueError(f"cuts={self.cuts} must be strictly increasing")

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.layer_flops)

    @property
    def max_layer_flops(self) -> float:
        """FLOPs of the largest layer (the relaxed bound when not ``balanced``)."""
        return max(self.layer_flops)


def cluster_layers(
    flops: np.ndarray,
    cut_bytes: np.ndarray,
    *,
    num_layers: int | None = None,
    tolerance: float = 0.2,
    max_layers: int = 32,
    bytes_factor: float = BYTES_FACTOR,
) -> Clustering:
    """Cuts ``n`` equations into balanced layers with narrow boundaries (see module doc).

    Args:
      flops: ``[n]`` FLOPs per equation; nonzero only for heavy equations.
      cut_bytes: ``[n + 1]`` bytes live across a cut at each position (ends unused).
      num_layers: number of layers, or ``None`` for :func:`choose_num_layers`.
      tolerance: how far above ``total / L`` a layer's FLOPs may go.
      max_layers: upper bound for the automatic choice.
      bytes_factor: boundary-width slack for the automatic choice.

    Raises:
      ValueError: on arrays of the wrong shape or with negative or non-finite
        entries, on bad options, or if ``num_layers`` is not in ``[1, H]`` for
        ``H`` heavy equations.
    """
    flops, cut_bytes = _check_inputs(flops, cut_bytes, tolerance)
    red = _reduce(flops, cut_bytes)
    if num_layers is None:
        (num_layers,) = _choose(red, tolerance, max_layers, (bytes_factor, True))
    _check_num_layers(num_layers, red.num_heavy)
    balanced, limit = _flops_limit(red, num_layers, tolerance)
    fits = red.seg <= limit
    widest = _min_widest_cut(fits, red.node_bytes, num_layers)
    nodes = _cheapest_nodes(red, fits & (red.node_bytes <= widest)[None, :], num_layers)
    return _result(flops, cut_bytes, tuple(int(red.positions[k]) for k in nodes), balanced)


def choose_num_layers(
    flops: np.ndarray,
    cut_bytes: np.ndarray,
    *,
    tolerance: float = 0.2,
    max_layers: int = 32,
    bytes_factor: float = BYTES_FACTOR,
) -> int:
    """The largest ``L`` in ``[1, min(H, max_layers)]`` whose clustering is balanced
    and whose widest cut is at most ``bytes_factor`` times the widest cut of the
    clustering into two layers.

    Splitting the loss in two at all costs that much: it is what any pipeline
    cuts through at least once, so it measures what is "wide" for this model (a
    transformer's residual stream; a conv net's mid-network feature map) rather
    than the narrowest spot anywhere (which in a conv net sits by the head).
    ``L = 1`` always qualifies, so the result is at least 1. More layers give the
    stage search more freedom; the bytes bound keeps it from cutting through
    activations much wider than that.

    Raises:
      ValueError: as :func:`cluster_layers`.
    """
    flops, cut_bytes = _check_inputs(flops, cut_bytes, tolerance)
    return _choose(_reduce(flops, cut_bytes), tolerance, max_layers, (bytes_factor, True))[0]


def candidate_layer_counts(
    flops: np.ndarray,
    cut_bytes: np.ndarray,
    *,
    tolerance: float = 0.2,
    max_layers: int = 32,
    bytes_factors: tuple[float, ...] = BYTES_FACTORS,
    unbalanced_factors: tuple[float, ...] = (),
) -> tuple[int, ...]:
    """The distinct :func:`choose_num_layers` over ``bytes_factors``, in their order, then for
    each of ``unbalanced_factors`` the largest count whose widest cut that factor allows when
    the layers need not be balanced (they are then as even as they can be, see
    :func:`cluster_layers`).

    Raises:
      ValueError: as :func:`cluster_layers`, or for an empty ``bytes_factors``.
    """
    if not bytes_factors:
        raise ValueError("bytes_factors is empty; give at least one factor >= 1")
    flops, cut_bytes = _check_inputs(flops, cut_bytes, tolerance)
    red = _reduce(flops, cut_bytes)
    rules = [(f, True) for f in bytes_factors] + [(f, False) for f in unbalanced_factors]
    return tuple(dict.fromkeys(_choose(red, tolerance, max_layers, *rules)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Reduced:
    """The problem over candidate cuts: node 0 is the start, node ``h`` the end,
    node ``g + 1`` the best cut between heavy equations ``g`` and ``g + 1``."""

    num_heavy: int
    """Number of heavy equations ``h``."""
    positions: np.ndarray
    """``[h + 1]`` equation position of each node (0 and ``n`` at the ends)."""
    node_bytes: np.ndarray
    """``[h + 1]`` cut bytes at each node (0 at the ends)."""
    seg: np.ndarray
    """``[h + 1, h + 1]`` FLOPs of the layer from node ``i`` to node ``j``; inf unless ``i < j``."""
    total: float
    """Total FLOPs."""


def _reduce(flops: np.ndarray, cut_bytes: np.ndarray) -> _Reduced:
    # Only one cut per gap between consecutive heavy equations needs to be
    # considered: the narrowest one (earliest on ties). Why this loses nothing:
    # - a cut before the first or after the last heavy equation leaves a layer
    #   with no heavy equation, as do two cuts in one gap; so every valid
    #   placement has one cut in each of L - 1 distinct gaps;
    # - moving a cut within its gap moves only zero-FLOP equations, so every
    #   layer's FLOPs (hence the bound, the relaxed bound and the squared
    #   deviations) stay the same;
    # - moving it to the gap's narrowest position raises neither the widest cut
    #   nor the sum of cut bytes. So the best objective value is reached on
    #   candidates, and every optimum has each cut at its gap's minimum bytes
    #   (else moving it lowers the sum); taking the earliest such position
    #   lowers the cut vector, so the lexicographically first optimum is made
    #   of candidates too.
    heavy = np.flatnonzero(flops > 0)
    positions = [0]
    for a, b in itertools.pairwise(heavy):
        positions.append(int(a) + 1 + int(np.argmin(cut_bytes[a + 1 : b + 1])))
    positions.append(len(flops))
    positions_arr = np.asarray(positions)
    prefix = _prefix(flops)[positions_arr]
    seg = prefix[None, :] - prefix[:, None]
    seg[np.tril_indices(len(positions))] = _INF
    node_bytes = cut_bytes[positions_arr].copy()
    node_bytes[[0, -1]] = 0.0
    return _Reduced(
        num_heavy=len(heavy),
        positions=positions_arr,
        node_bytes=node_bytes,
        seg=seg,
        total=float(prefix[-1]),
    )


def _flops_limit(red: _Reduced, num_layers: int, tolerance: float) -> tuple[bool, float]:
    """Whether the balance bound is reachable, and the bound on layer FLOPs to use."""
    # Min over placements of the largest layer: best[j] is that minimum over the
    # first k layers ending at node j.
    best = np.full(len(red.positions), _INF)
    best[0] = 0.0
    for _ in range(num_layers):
        best = np.maximum(best[:, None], red.seg).min(axis=0)
    smallest_largest = float(best[-1])
    cap = _balance_cap(red.total, num_layers, tolerance)
    return (True, cap) if smallest_largest <= cap else (False, smallest_largest)


def _min_widest_cut(fits: np.ndarray, node_bytes: np.ndarray, num_layers: int) -> float:
    """Least achievable widest cut using only the layers (node pairs) in ``fits``."""
    best = np.full(len(node_bytes), _INF)
    best[0] = 0.0
    for _ in range(num_layers):
        best = np.maximum(node_bytes, np.where(fits, best[:, None], _INF).min(axis=0))
    return float(best[-1])


def _cheapest_nodes(red: _Reduced, allowed: np.ndarray, num_layers: int) -> list[int]:
    """Cut nodes minimising (sum of squared layer FLOPs, sum of cut bytes, nodes)
    using only the layers (node pairs) in ``allowed``.

    With the total fixed, the sum of squared deviations from ``total / L`` is the
    sum of squares minus ``total**2 / L``, so the sum of squares ranks the same.
    The DP runs from the end so that taking the first of equal choices, front to
    back, gives the lexicographically first cut vector.
    """
    sq = np.where(allowed, red.seg * red.seg, _INF)
    bytes_row = red.node_bytes[None, :]
    # Suffix values: cover nodes i..h with r layers, node i being a cut.
    suffix_sq = sq[:, -1].copy()
    suffix_bytes = np.where(np.isfinite(suffix_sq), 0.0, _INF)
    choice = []
    for _ in range(num_layers - 1):
        total_sq = sq + suffix_sq[None, :]
        best_sq = total_sq.min(axis=1)
        tie = (total_sq == best_sq[:, None]) & np.isfinite(best_sq)[:, None]
        total_bytes = np.where(tie, bytes_row + suffix_bytes[None, :], _INF)
        best_bytes = total_bytes.min(axis=1)
        choice.append(np.argmax(tie & (total_bytes == best_bytes[:, None]), axis=1))
        suffix_sq, suffix_bytes = best_sq, best_bytes
    nodes, node = [], 0
    for step in reversed(choice):
        node = int(step[node])
        nodes.append(node)
    return nodes


def _choose(red: _Reduced, tolerance: float, max_layers: int, *rules: tuple[float, bool]) -> list[int]:
    """:func:`_auto_num_layers` for each ``(bytes factor, balanced)``, probing each layer count once."""

    @functools.cache
    def probe(num: int) -> tuple[bool, float]:
        balanced, limit = _flops_limit(red, num, tolerance)
        return balanced, _min_widest_cut(red.seg <= limit, red.node_bytes, num)

    reference = probe(2)[1] if red.num_heavy > 1 else 0.0
    return [_auto_num_layers(red.num_heavy, reference, max_layers, f, probe, b) for f, b in rules]


def _auto_num_layers(
    num_heavy: int,
    reference: float,
    max_layers: int,
    bytes_factor: float,
    probe: Callable[[int], tuple[bool, float]],
    balanced_only: bool = True,
) -> int:
    """The rule of :func:`choose_num_layers`; ``probe(L)`` gives (balanced, widest cut).
    Without ``balanced_only``, a count whose layers cannot be balanced qualifies too."""
    if isinstance(max_layers, bool) or not isinstance(max_layers, int | np.integer) or max_layers < 1:
        raise ValueError(f"max_layers must be an integer >= 1, got {max_layers!r}")
    if not (math.isfinite(bytes_factor) and bytes_factor >= 1.0):
        raise ValueError(f"bytes_factor must be a finite number >= 1, got {bytes_factor!r}")
    for num in range(min(num_heavy, int(max_layers)), 1, -1):
        balanced, widest = probe(num)
        if (balanced or not balanced_only) and widest <= bytes_factor * reference:
            return num
    return 1


def _result(flops: np.ndarray, cut_bytes: np.ndarray, cuts: tuple[int, ...], balanced: bool) -> Clustering:
    prefix = _prefix(flops)
    bounds = (0, *cuts, len(flops))
    return Clustering(
        cuts=tuple(int(c) for c in cuts),
        layer_flops=tuple(float(prefix[b] - prefix[a]) for a, b in itertools.pairwise(bounds)),
        max_cut_bytes=float(max((cut_bytes[c] for c in cuts), default=0.0)),
        balanced=balanced,
    )


def _prefix(flops: np.ndarray) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(flops)))


def _balance_cap(total: float, num_layers: int, tolerance: float) -> float:
    return float((1.0 + tolerance) * total / num_layers)


def _right_sum(values: list[float]) -> float:
    acc = 0.0
    for v in reversed(values):
        acc = v + acc
    return float(acc)


def _check_inputs(
    flops: np.ndarray, cut_bytes: np.ndarray, tolerance: float
) -> tuple[np.ndarray, np.ndarray]:
    flops = np.asarray(flops, dtype=np.float64)
    cut_bytes = np.asarray(cut_bytes, dtype=np.float64)
    if flops.ndim != 1 or len(flops) == 0:
        raise ValueError(
            f"flops must be a non-empty 1-D array (one entry per equation), got shape {flops.shape}"
        )
    if cut_bytes.shape != (len(flops) + 1,):
        raise ValueError(
            f"cut_bytes must have shape ({len(flops) + 1},), one entry per cut position 0..n "
            f"for n={len(flops)} equations, got shape {cut_bytes.shape}"
        )
    for name, arr in (("flops", flops), ("cut_bytes", cut_bytes)):
        bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
        if len(bad):
            raise ValueError(f"{name} must be finite and >= 0, got {name}[{bad[0]}]={arr[bad[0]]}")
    if not np.any(flops > 0):
        raise ValueError("flops has no heavy (nonzero) equation, so there is nothing to balance into layers")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    return flops, cut_bytes


def _check_num_layers(num_layers: int, num_heavy: int) -> None:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int | np.integer):
        raise ValueError(f"num_layers must be an integer or None, got {num_layers!r}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if num_layers > num_heavy:
        raise ValueError(
            f"The forward pass has {num_heavy} heavy operations (nonzero FLOPs) but {num_layers} "
            f"layers were requested; every layer needs one, so use num_layers <= {num_heavy}"
        )
