"""Unbiased pass@k against hand-computed values and a brute-force enumeration."""

from __future__ import annotations

import itertools
import math

import pytest

from mixrl.rollout.passk import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize(
    "n,c,k,want",
    [
        (4, 0, 1, 0.0),
        (4, 1, 1, 0.25),  # c / n
        (4, 2, 1, 0.5),
        (4, 1, 4, 1.0),  # every draw of 4 out of 4 holds the correct one
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (8, 3, 4, 13 / 14),  # 1 - C(5,4)/C(8,4) = 1 - 5/70
        (10, 10, 3, 1.0),
        (6, 4, 3, 1.0),  # n - c = 2 < k
    ],
)
def test_hand_values(n: int, c: int, k: int, want: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_matches_brute_force_enumeration() -> None:
    """Fraction of k-subsets of the n samples that contain a correct one."""
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                samples = [1] * c + [0] * (n - c)
                subsets = list(itertools.combinations(range(n), k))
                want = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_large_n_is_stable() -> None:
    # binomials of this size overflow float; the product form does not
    got = pass_at_k(5000, 10, 100)
    want = 1 - math.exp(math.lgamma(4991) - math.lgamma(4891) - math.lgamma(5001) + math.lgamma(4901))
    assert got == pytest.approx(want, rel=1e-9)


def test_mean_and_bad_input() -> None:
    assert mean_pass_at_k([(4, 1), (4, 0)], 1) == pytest.approx(0.125)
    with pytest.raises(ValueError, match="k=5, n=4"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c=5"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="no tasks"):
        mean_pass_at_k([], 1)
