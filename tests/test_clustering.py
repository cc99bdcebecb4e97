"""Layer clustering: DP against brute force, hand-solved cases, automatic L, speed."""

import time

import numpy as np
import pytest
from clustering_oracle import brute_force_clustering

from autopar._src import clustering
from autopar._src.clustering import (
    Clustering,
    candidate_layer_counts,
    choose_num_layers,
    cluster_layers,
)


def _random_instance(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n = int(rng.integers(1, 13))
    heavy = rng.random(n) < rng.uniform(0.2, 0.7)
    heavy[rng.integers(n)] = True
    flops = np.where(heavy, rng.integers(1, 20, n), 0).astype(np.float64)
    if rng.random() < 0.3:
        # One giant op, so that many instances can only be solved relaxed.
        flops[rng.choice(np.flatnonzero(heavy))] = 200.0
    # Few distinct byte values, so ties (and the tie-breaks) are common.
    cut_bytes = rng.integers(0, 6, n + 1).astype(np.float64)
    return flops, cut_bytes


def _sq_deviation(c: Clustering) -> float:
    mean = sum(c.layer_flops) / c.num_layers
    return sum((f - mean) ** 2 for f in c.layer_flops)


def test_dp_equals_brute_force_on_random_instances():
    rng = np.random.default_rng(0)
    compared = relaxed = rejected = 0
    while compared < 300:
        flops, cut_bytes = _random_instance(rng)
        num_layers = int(rng.integers(1, 5))
        tolerance = float(rng.choice([0.1, 0.3, 1.0]))
        if num_layers > np.count_nonzero(flops):
            for solve in (cluster_layers, brute_force_clustering):
                with pytest.raises(ValueError, match=f"use num_layers <= {np.count_nonzero(flops)}"):
                    solve(flops, cut_bytes, num_layers=num_layers, tolerance=tolerance)
            rejected += 1
            continue
        got = cluster_layers(flops, cut_bytes, num_layers=num_layers, tolerance=tolerance)
        want = brute_force_clustering(flops, cut_bytes, num_layers=num_layers, tolerance=tolerance)
        assert got == want, (flops, cut_bytes, num_layers, tolerance)
        # Structural checks on the result itself.
        assert got.num_layers == num_layers
        bounds = (0, *got.cuts, len(flops))
        assert all(np.count_nonzero(flops[a:b]) >= 1 for a, b in zip(bounds, bounds[1:], strict=False))
        cap = (1 + tolerance) * flops.sum() / num_layers
        assert got.balanced == (got.max_layer_flops <= cap)
        compared += 1
        relaxed += not got.balanced
    assert relaxed >= 20 and rejected >= 10


def test_balance_breaks_ties_between_equal_widths():
    # Every cut is 1 byte wide; of the cuts (3|5), (4|4), (6|2) the balanced one wins.
    flops = np.array([3.0, 0, 1, 0, 2, 0, 2])
    c = cluster_layers(flops, np.array([0.0, 1, 1, 1, 1, 1, 1, 0]), num_layers=2, tolerance=1.0)
    assert c.cuts == (3,) and c.layer_flops == (4.0, 4.0) and _sq_deviation(c) == 0.0


def test_four_equal_matmuls_cut_at_the_narrow_point():
    # mm act mm act | mm act mm act: the only narrow cut is right after the 2nd matmul.
    flops = np.array([10.0, 0, 10, 0, 10, 0, 10, 0])
    cut_bytes = np.full(9, 100.0)
    cut_bytes[3] = 10.0
    c = cluster_layers(flops, cut_bytes, num_layers=2)
    assert c == Clustering(cuts=(3,), layer_flops=(20.0, 20.0), max_cut_bytes=10.0, balanced=True)


def test_equal_widths_cut_at_the_balance_point():
    flops = np.array([10.0, 0, 10, 0, 10, 0, 10])
    c = cluster_layers(flops, np.ones(8), num_layers=2)
    # Balance puts the cut in the gap after the 2nd matmul; its earliest position wins the tie.
    assert c.cuts == (3,) and c.layer_flops == (20.0, 20.0)


def test_cut_after_the_narrowing_op_within_the_gap():
    # matmul, wide activation (gelu), narrowing op (reduce), matmul.
    flops = np.array([8.0, 0, 0, 8])
    cut_bytes = np.array([0.0, 400, 400, 50, 0])
    c = cluster_layers(flops, cut_bytes, num_layers=2)
    assert c.cuts == (3,) and c.max_cut_bytes == 50.0 and c.balanced


def test_giant_op_gives_relaxed_result():
    flops = np.array([100.0, 1, 1, 1])
    cut_bytes = np.array([0.0, 70, 5, 50, 0])
    c = cluster_layers(flops, cut_bytes, num_layers=3, tolerance=0.2)
    # No placement is within 1.2 * 103 / 3; the giant op alone is the smallest
    # largest layer, which rules out (2, 3) even though it is the narrowest.
    assert not c.balanced
    assert c.max_layer_flops == 100.0
    assert c == Clustering(cuts=(1, 2), layer_flops=(100.0, 1.0, 2.0), max_cut_bytes=70.0, balanced=False)
    assert c == brute_force_clustering(flops, cut_bytes, num_layers=3, tolerance=0.2)


def test_single_layer():
    c = cluster_layers(np.array([0.0, 3, 0]), np.array([0.0, 9, 9, 0]), num_layers=1)
    assert c == Clustering(cuts=(), layer_flops=(3.0,), max_cut_bytes=0.0, balanced=True)


def _blocks(num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """``num_blocks`` identical blocks of [matmul, gelu, matmul, add]: 500 bytes
    live inside a block, 100 bytes between blocks."""
    flops = np.tile([4.0, 0, 4, 0], num_blocks)
    cut_bytes = np.tile([100.0, 500, 500, 500], num_blocks + 1)[: 4 * num_blocks + 1]
    return flops, cut_bytes


def test_auto_layers_on_uniform_blocks_is_one_per_block():
    flops, cut_bytes = _blocks(8)
    # 16 matmuls; any L > 8 must cut inside a block (500 > 4 * 100 bytes), and
    # L = 8 cuts exactly at the block boundaries with equal layers.
    assert choose_num_layers(flops, cut_bytes) == 8
    c = cluster_layers(flops, cut_bytes)
    assert c.cuts == (4, 8, 12, 16, 20, 24, 28) and c.balanced and c.max_cut_bytes == 100.0
    assert choose_num_layers(flops, cut_bytes, max_layers=4) == 4
    # A looser width bound admits one layer per matmul.
    assert choose_num_layers(flops, cut_bytes, bytes_factor=5.0) == 16


def test_candidate_layer_counts_are_each_factors_choice_once_in_order():
    flops, cut_bytes = _blocks(8)
    assert candidate_layer_counts(flops, cut_bytes, bytes_factors=(4.0, 5.0, 2.0, 8.0)) == (8, 16)
    assert candidate_layer_counts(flops, cut_bytes, bytes_factors=(6.0, 4.0)) == (16, 8)
    rng = np.random.default_rng(2)
    for _ in range(20):
        flops, cut_bytes = _random_instance(rng)
        factors = tuple(float(f) for f in rng.choice([1.0, 1.5, 2.0, 4.0, 8.0], size=3))
        each = [choose_num_layers(flops, cut_bytes, bytes_factor=f) for f in factors]
        assert candidate_layer_counts(flops, cut_bytes, bytes_factors=factors) == tuple(dict.fromkeys(each))
    with pytest.raises(ValueError, match="bytes_factors is empty"):
        candidate_layer_counts(flops, cut_bytes, bytes_factors=())
    with pytest.raises(ValueError, match="bytes_factor must be .* got 0.5"):
        candidate_layer_counts(flops, cut_bytes, bytes_factors=(4.0, 0.5))


def test_unbalanced_candidates_are_the_finest_the_bytes_allow():
    # A conv net in miniature: a wide stem conv, then convs of very different sizes. Past 3
    # layers none is balanced, yet all 5 convs can be cut apart within the bytes bound.
    flops = np.array([40.0, 0, 5, 0, 30, 0, 5, 0, 20])
    cut_bytes = np.full(10, 1.0)
    assert candidate_layer_counts(flops, cut_bytes, bytes_factors=(4.0,)) == (3,)
    assert candidate_layer_counts(flops, cut_bytes, bytes_factors=(4.0,), unbalanced_factors=(4.0,)) == (3, 5)
    assert not cluster_layers(flops, cut_bytes, num_layers=5).balanced
    rng = np.random.default_rng(3)
    for _ in range(40):
        flops, cut_bytes = _random_instance(rng)
        factor = float(rng.choice([1.0, 2.0, 8.0]))
        balanced = choose_num_layers(flops, cut_bytes, bytes_factor=factor)
        # By the definition: the largest count whose widest cut is within the factor.
        heavy = int(np.count_nonzero(flops))
        reference = brute_force_clustering(flops, cut_bytes, num_layers=2).max_cut_bytes if heavy > 1 else 0
        finest = next(
            (
                n
                for n in range(min(heavy, 32), 1, -1)
                if brute_force_clustering(flops, cut_bytes, num_layers=n).max_cut_bytes <= factor * reference
            ),
            1,
        )
        got = candidate_layer_counts(flops, cut_bytes, bytes_factors=(factor,), unbalanced_factors=(factor,))
        assert got == tuple(dict.fromkeys((balanced, finest)))
        assert finest >= balanced


def test_auto_layers_deterministic_bounded_and_equal_to_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(60):
        flops, cut_bytes = _random_instance(rng)
        tolerance = float(rng.choice([0.1, 0.3, 1.0]))
        max_layers = int(rng.integers(1, 6))
        num = choose_num_layers(flops, cut_bytes, tolerance=tolerance, max_layers=max_layers)
        assert num == choose_num_layers(flops, cut_bytes, tolerance=tolerance, max_layers=max_layers)
        assert 1 <= num <= min(np.count_nonzero(flops), max_layers)
        got = cluster_layers(flops, cut_bytes, tolerance=tolerance, max_layers=max_layers)
        want = brute_force_clustering(flops, cut_bytes, tolerance=tolerance, max_layers=max_layers)
        assert got == want and got.num_layers == num


def test_auto_layers_with_one_heavy_op():
    assert choose_num_layers(np.array([0.0, 5, 0]), np.zeros(4)) == 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_layers=0), "num_layers must be >= 1, got 0"),
        (dict(num_layers=3), "has 2 heavy operations .* but 3 layers were requested; .*use num_layers <= 2"),
        (dict(num_layers=2.0), "num_layers must be an integer"),
        (dict(tolerance=-0.1), "tolerance must be .* got -0.1"),
        (dict(max_layers=0), "max_layers must be an integer >= 1, got 0"),
        (dict(bytes_factor=0.5), "bytes_factor must be .* got 0.5"),
    ],
)
def test_bad_options(kwargs, match):
    flops, cut_bytes = np.array([1.0, 0, 1]), np.zeros(4)
    for solve in (cluster_layers, brute_force_clustering):
        with pytest.raises(ValueError, match=match):
            solve(flops, cut_bytes, **kwargs)


@pytest.mark.parametrize(
    "flops,cut_bytes,match",
    [
        (np.ones(3), np.zeros(3), r"cut_bytes must have shape \(4,\).*got shape \(3,\)"),
        (np.ones((2, 2)), np.zeros(5), "flops must be a non-empty 1-D array"),
        (np.array([]), np.zeros(1), "flops must be a non-empty 1-D array"),
        (np.array([1.0, -1]), np.zeros(3), r"flops must be finite and >= 0, got flops\[1\]=-1.0"),
        (np.ones(2), np.array([0, np.nan, 0]), r"cut_bytes\[1\]=nan"),
        (np.zeros(2), np.zeros(3), "no heavy"),
    ],
)
def test_bad_arrays(flops, cut_bytes, match):
    with pytest.raises(ValueError, match=match):
        cluster_layers(flops, cut_bytes, num_layers=1)
    with pytest.raises(ValueError, match=match):
        choose_num_layers(flops, cut_bytes)


def test_clustering_validates_its_fields():
    with pytest.raises(ValueError, match="layer_flops has 1 entries"):
        Clustering(cuts=(2,), layer_flops=(1.0,), max_cut_bytes=0.0, balanced=True)
    with pytest.raises(ValueError, match="strictly increasing"):
        Clustering(cuts=(2, 2), layer_flops=(1.0, 0.0, 1.0), max_cut_bytes=0.0, balanced=True)


def test_large_instance_is_fast():
    rng = np.random.default_rng(2)
    n, num_heavy, num_layers = 5000, 400, 96
    flops = np.zeros(n)
    flops[np.sort(rng.choice(n, num_heavy, replace=False))] = rng.integers(1, 100, num_heavy)
    cut_bytes = rng.integers(1, 1000, n + 1).astype(np.float64)
    start = time.perf_counter()
    c = cluster_layers(flops, cut_bytes, num_layers=num_layers)
    elapsed = time.perf_counter() - start
    assert elapsed < 10.0, elapsed
    assert len(c.cuts) == num_layers - 1 and c.balanced
    assert sum(c.layer_flops) == pytest.approx(flops.sum())
    start = time.perf_counter()
    num = choose_num_layers(flops, cut_bytes)
    assert 1 <= num <= 32 and time.perf_counter() - start < 10.0


def test_reduced_candidates_are_narrowest_per_gap():
    flops = np.array([1.0, 0, 0, 1, 0, 1])
    cut_bytes = np.array([0.0, 3, 2, 2, 7, 7, 0])
    red = clustering._reduce(flops, cut_bytes)
    assert red.positions.tolist() == [0, 2, 4, 6]
    assert red.node_bytes.tolist() == [0.0, 2.0, 7.0, 0.0]
