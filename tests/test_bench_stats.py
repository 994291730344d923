"""The median's order-statistic interval (mixrl.lab.bench.stats) against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from mixrl.lab.bench.stats import median_coverage, median_interval


@pytest.mark.parametrize("n", range(1, 15))
def test_coverage_is_the_count_of_outcomes_that_bracket_the_median(n: int) -> None:
    # each round falls below the true median or not, each with probability 1/2: [x(k), x(n-k+1)]
    # holds the median exactly when between k and n-k rounds fall below it
    for k in range(1, n // 2 + 1):
        hits = sum(k <= sum(below) <= n - k for below in itertools.product((0, 1), repeat=n))
        assert median_coverage(n, k) == pytest.approx(hits / 2**n, abs=1e-15)


def test_interval_is_the_narrowest_pair_of_order_statistics_at_the_level() -> None:
    xs = [0.9, 0.5, 1.1, 0.7, 0.8, 1.0, 0.6, 0.95, 0.85]  # n = 9: k = 2 covers 0.961, k = 3 only 0.820
    lo, hi, cov = median_interval(xs)
    assert (lo, hi) == (0.6, 1.0) and cov == pytest.approx(1 - 2 * 10 / 512, abs=1e-4)
    assert median_interval(xs[:5]) is None  # 5 rounds: at best 1 - 2/32 = 0.9375
    assert median_interval(xs[:6])[:2] == (0.5, 1.1)  # 6 rounds: only the extremes, 0.969


def test_interval_covers_a_known_median_at_least_as_often_as_it_says() -> None:
    rng = random.Random(0)
    trials, n, hits = 4000, 15, 0
    for _ in range(trials):  # log-normal rounds, true median exp(0) = 1
        lo, hi, cov = median_interval([rng.lognormvariate(0.0, 0.3) for _ in range(n)])
        hits += lo <= 1.0 <= hi
    assert cov >= 0.95 and hits / trials > cov - 0.015  # 0.015: > 4 standard errors at 4000 trials
