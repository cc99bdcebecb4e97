"""A reference for :func:`autopar._src.clustering.cluster_layers`: every cut vector enumerated."""

import itertools

import numpy as np

from autopar._src.clustering import (
    BYTES_FACTOR,
    Clustering,
    _auto_num_layers,
    _balance_cap,
    _check_inputs,
    _check_num_layers,
    _prefix,
    _result,
    _right_sum,
)


def brute_force_clustering(
    flops: np.ndarray,
    cut_bytes: np.ndarray,
    *,
    num_layers: int | None = None,
    tolerance: float = 0.2,
    max_layers: int = 32,
    bytes_factor: float = BYTES_FACTOR,
) -> Clustering:
    """:func:`~autopar._src.clustering.cluster_layers` by enumerating every cut vector over all positions."""
    flops, cut_bytes = _check_inputs(flops, cut_bytes, tolerance)
    n = len(flops)
    heavy = np.flatnonzero(flops > 0)
    if num_layers is None:

        def probe(num: int) -> tuple[bool, float]:
            c = brute_force_clustering(flops, cut_bytes, num_layers=num, tolerance=tolerance)
            return c.balanced, c.max_cut_bytes

        reference = probe(2)[1] if len(heavy) > 1 else 0.0
        num_layers = _auto_num_layers(len(heavy), reference, max_layers, bytes_factor, probe)
    _check_num_layers(num_layers, len(heavy))
    prefix = _prefix(flops)
    heavy_before = np.concatenate(([0], np.cumsum(flops > 0)))
    placements = []
    for cuts in itertools.combinations(range(1, n), num_layers - 1):
        bounds = (0, *cuts, n)
        if all(heavy_before[b] > heavy_before[a] for a, b in itertools.pairwise(bounds)):
            placements.append((cuts, [prefix[b] - prefix[a] for a, b in itertools.pairwise(bounds)]))
    smallest_largest = min(max(layers) for _, layers in placements)
    cap = _balance_cap(prefix[-1], num_layers, tolerance)
    balanced = bool(smallest_largest <= cap)
    limit = cap if balanced else smallest_largest

    def key(placement: tuple[tuple[int, ...], list[float]]) -> tuple:
        cuts, layers = placement
        # Sums run right to left, the order in which the DP accumulates them.
        return (
            max((cut_bytes[c] for c in cuts), default=0.0),
            _right_sum([f * f for f in layers]),
            _right_sum([cut_bytes[c] for c in cuts]),
            cuts,
        )

    best = min((p for p in placements if max(p[1]) <= limit), key=key)
    return _result(flops, cut_bytes, best[0], balanced)
