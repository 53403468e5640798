"""lockstep.core.stats: Wilson intervals, the item bootstrap for ratios, mean and spread across seeds."""

import math

import numpy as np
import pytest

from lockstep.core.stats import bootstrap_ratio_interval, mean_std, seed_difference, wilson_interval


def test_wilson_matches_the_closed_form_values():
    # 8 of 10 at 95%: the textbook Wilson interval is (0.4902, 0.9433).
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    # Stays inside [0, 1] and is not degenerate at the edges, unlike p +- z*sqrt(p(1-p)/n).
    lo, hi = wilson_interval(0, 20)
    assert lo == 0.0 and 0.1 < hi < 0.2
    lo, hi = wilson_interval(20, 20)
    assert hi == 1.0 and 0.8 < lo < 0.9


def test_wilson_narrows_with_more_items():
    widths = [np.subtract(*wilson_interval(n // 2, n)[::-1]) for n in (10, 100, 1000)]
    assert widths[0] > widths[1] > widths[2]


def test_wilson_refuses_impossible_counts():
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(5, 4)
    assert all(math.isnan(v) for v in wilson_interval(0, 0))


def test_bootstrap_covers_the_ratio_and_is_reproducible():
    rng = np.random.default_rng(1)
    den = rng.integers(100, 1000, size=50).astype(float)
    num = den * rng.normal(2.0, 0.3, size=50)
    lo, hi = bootstrap_ratio_interval(num, den, seed=3)
    assert lo < num.sum() / den.sum() < hi
    assert (lo, hi) == bootstrap_ratio_interval(num, den, seed=3)
    # Items that all give the same ratio leave nothing to be unsure about.
    lo, hi = bootstrap_ratio_interval([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)


def test_bootstrap_needs_two_items_and_matching_lengths():
    assert all(math.isnan(v) for v in bootstrap_ratio_interval([1.0], [1.0]))
    with pytest.raises(ValueError, match="one length"):
        bootstrap_ratio_interval([1.0, 2.0], [1.0])


def test_mean_std_is_the_sample_deviation():
    mean, std, n = mean_std([1.0, 2.0, 3.0])
    assert (mean, n) == (2.0, 3) and std == pytest.approx(1.0)
    mean, std, n = mean_std([5.0])
    assert mean == 5.0 and math.isnan(std) and n == 1


def test_seed_difference_compares_against_the_larger_spread():
    # std of [1, 2, 3] is 1, of [2.5, 2.5, 2.5] is 0: the spread is the larger, 1.
    diff, spread, within = seed_difference([1.0, 2.0, 3.0], [2.5, 2.5, 2.5])
    assert diff == pytest.approx(0.5) and spread == pytest.approx(1.0) and within is True
    diff, spread, within = seed_difference([2.5, 2.5, 2.5], [1.0, 2.0, 6.0])
    assert diff == pytest.approx(0.5) and spread == pytest.approx(math.sqrt(7)) and within is True
    diff, spread, within = seed_difference([1.0, 2.0, 3.0], [4.0, 4.1, 3.9])
    assert diff == pytest.approx(2.0) and within is False
    # Negative differences compare by size.
    assert seed_difference([4.0, 4.1, 3.9], [1.0, 2.0, 3.0])[2] is False


def test_seed_difference_says_when_the_spread_is_unknown():
    diff, spread, within = seed_difference([1.0, 2.0], [7.0])
    assert diff == pytest.approx(5.5) and math.isnan(spread) and within is None
    diff, spread, within = seed_difference([], [1.0, 2.0])
    assert math.isnan(diff) and within is None


def test_seed_difference_counts_no_difference_as_within_a_zero_spread():
    assert seed_difference([80.0, 80.0], [80.0, 80.0]) == (0.0, 0.0, True)
    assert seed_difference([80.0, 80.0], [81.0, 81.0])[2] is False
