"""How sure a number is: 95% intervals for the metrics lockstep writes, and the spread of a metric
across runs that differ only in their training seed.

- A proportion of n items (an accuracy, a pass rate) gets the Wilson score interval, which stays
  inside [0, 1] and behaves at 0 and n successes, where the normal approximation does not.
- A ratio of sums over items (bits per byte: nats over bytes, summed over documents) gets a
  percentile bootstrap that resamples whole items, so long and short documents keep their weight.
- Runs with different seeds get mean, sample standard deviation and n; two configurations differ
  by more than seed noise only where their means differ by more than the larger deviation.

Pure numpy; nothing here reads files."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054  # the standard normal quantile at 0.975


def wilson_interval(successes: float, n: int, *, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of `successes` out of `n` (95% for the default z); (nan, nan)
    when n is 0, since no item says nothing. `successes` may be fractional (n times a mean of
    per-item rates in [0, 1], e.g. pass@1 over k samples per problem): p(1-p)/n bounds the
    variance of such a mean, so the interval is conservative there."""
    if n < 0 or successes < 0 or successes > n:
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return (math.nan, math.nan)
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def bootstrap_ratio_interval(numerators: Sequence[float], denominators: Sequence[float], *, level: float = 0.95,
                             reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of sum(numerators) / sum(denominators), resampling the
    items (pairs) with replacement `reps` times from a generator seeded with `seed`, so the same
    items always give the same interval. (nan, nan) with fewer than 2 items."""
    num = np.asarray(numerators, dtype=np.float64)
    den = np.asarray(denominators, dtype=np.float64)
    if num.shape != den.shape or num.ndim != 1:
        raise ValueError(f"numerators and denominators must be 1-D of one length, got {num.shape} and {den.shape}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if len(num) < 2:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(num), size=(reps, len(num)))
    dens = den[picks].sum(axis=1)
    ratios = num[picks].sum(axis=1) / np.where(dens > 0, dens, np.nan)
    lo, hi = np.nanquantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return (float(lo), float(hi))


def mean_std(values: Sequence[float]) -> tuple[float, float, int]:
    """(mean, sample standard deviation, n) of `values`; the deviation is nan below 2 values."""
    arr = np.asarray(values, dtype=np.float64)
    n = int(arr.size)
    if n == 0:
        return (math.nan, math.nan, 0)
    return (float(arr.mean()), float(arr.std(ddof=1)) if n > 1 else math.nan, n)


def seed_difference(reference: Sequence[float], other: Sequence[float]) -> tuple[float, float, bool | None]:
    """(difference, spread, within_spread) of two groups of seed runs: mean(other) - mean(reference),
    the seed-to-seed spread as the larger of the two sample standard deviations, and whether
    |difference| is smaller than that spread (a zero difference counts as within it, also where
    every seed gave the same value). within_spread is None when either group has fewer than 2
    values, since one run says nothing about the spread; the difference is nan when either is empty."""
    mean_ref, std_ref, n_ref = mean_std(reference)
    mean_other, std_other, n_other = mean_std(other)
    difference = mean_other - mean_ref
    if n_ref < 2 or n_other < 2:
        return (difference, math.nan, None)
    spread = max(std_ref, std_other)
    return (difference, spread, bool(abs(difference) < spread or difference == 0))
