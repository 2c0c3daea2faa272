"""Statistics used by the aggregate and the benchmarks: rank matching and round-level intervals."""

import numpy as np
import pytest

from servegrid.testing import benchmark_stats


def test_rank_matched_ratios_compare_like_with_like_in_a_multimodal_sample():
    # Queue places 1..4 at ~210 ms each; the two samples hold the same places in a different order.
    places = np.array([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 3]) * 0.210
    ours = np.random.default_rng(1).permutation(places) * 1.02
    ratios = benchmark_stats.rank_matched_ratios(ours, places)
    assert ratios == pytest.approx(np.full(12, 1.02))
    # One request moved one place: the medians fall on different modes, the matched ratios barely move.
    moved = places.copy()
    moved[np.argmax(np.isclose(moved, 0.420))] = 0.630
    assert np.median(moved) / np.median(places) == pytest.approx(1.2)
    assert np.median(benchmark_stats.rank_matched_ratios(moved, places)) == pytest.approx(1.0)


def test_rank_matched_ratios_match_quantiles_when_counts_differ_and_ignore_nan():
    ratios = benchmark_stats.rank_matched_ratios([1.0, 2.0, 3.0, 4.0, np.nan], [2.0, 8.0])
    assert ratios == pytest.approx([1.0 / 2.0, 3.0 / 8.0])
    assert benchmark_stats.rank_matched_ratios([], [1.0]).size == 0


def test_grouped_median_ci_reflects_the_spread_between_groups():
    rng = np.random.default_rng(0)
    steady = [1.0 + rng.normal(0, 0.001, 12) for _ in range(8)]
    drifting = [level + rng.normal(0, 0.001, 12) for level in (0.8, 1.2, 0.9, 1.1, 0.85, 1.15, 0.95, 1.05)]
    low, high = benchmark_stats.grouped_median_ci(steady)
    assert low < 1.0 < high and high - low < 0.005
    low, high = benchmark_stats.grouped_median_ci(drifting)
    assert low < 1.0 < high and high - low > 0.1


def test_grouped_median_ci_needs_three_groups():
    assert benchmark_stats.grouped_median_ci([[1.0, 2.0], [3.0], []]) == (None, None)
