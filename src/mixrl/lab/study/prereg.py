"""The study's pre-registered tests: p-values, Holm's correction, Fisher's exact test, a trend test.

Stated before the runs (docs/study.md, "Pre-registration"):

- ``paired_p``: two-sided p of the paired t over seeds (the per-seed difference of
  the cells' mean held-out pass@1), the test of F1 and F2;
- ``noninferiority_p``: one-sided p of H0 ``Δ <= −m`` (F3, margin ``m``);
- ``holm``: Holm's step-down adjustment over the family F1–F3 (controls the
  family-wise error at α without assuming independence);
- ``fisher``: Fisher's exact test of a 2 x 2 table of collapsed / not collapsed runs;
- ``trend``: the Cochran–Armitage test for a trend in the out-of-bounds rate of the
  groups ordered by their precision KL (F4: counts of tokens, not ranks of 3 values), with
  ``sign_p`` over the runs' own trend statistics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats as sps


def paired_p(d: Sequence[float]) -> float:
    """Two-sided p of H0 mean(d) = 0 (paired t, n − 1 df); NaN below 2 finite values.
    Zero spread: 0 when the mean is not 0, else 1."""
    x = np.asarray([v for v in d if math.isfinite(v)], dtype=np.float64)
    if len(x) < 2:
        return math.nan
    sd = float(x.std(ddof=1))
    if sd == 0:
        return 1.0 if float(x.mean()) == 0 else 0.0
    t = float(x.mean()) / (sd / math.sqrt(len(x)))
    return float(2 * sps.t.sf(abs(t), len(x) - 1))


def noninferiority_p(d: Sequence[float], margin: float) -> float:
    """One-sided p of H0 mean(d) <= −margin against mean(d) > −margin (paired t)."""
    if not margin > 0:
        raise ValueError(f"non-inferiority margin must be > 0, got {margin}")
    x = np.asarray([v for v in d if math.isfinite(v)], dtype=np.float64)
    if len(x) < 2:
        return math.nan
    sd = float(x.std(ddof=1))
    if sd == 0:
        return 0.0 if float(x.mean()) > -margin else 1.0
    t = (float(x.mean()) + margin) / (sd / math.sqrt(len(x)))
    return float(sps.t.sf(t, len(x) - 1))


def holm(p: dict[str, float]) -> dict[str, float]:
    """Holm-adjusted p-values: sort ascending, p_(i) x (m − i + 1), running max, cap at 1.
    NaN entries (a test not run) are left NaN and do not count in m."""
    named = sorted(((v, k) for k, v in p.items() if math.isfinite(v)))
    m, out, run = len(named), {k: math.nan for k in p}, 0.0
    for i, (v, k) in enumerate(named):
        run = max(run, min(1.0, v * (m - i)))
        out[k] = run
    return out


def fisher(a_yes: int, a_no: int, b_yes: int, b_no: int) -> float:
    """Two-sided p of Fisher's exact test on ``[[a_yes, a_no], [b_yes, b_no]]``."""
    if min(a_yes, a_no, b_yes, b_no) < 0:
        raise ValueError("Fisher's exact test needs counts >= 0")
    return float(sps.fisher_exact([[a_yes, a_no], [b_yes, b_no]]).pvalue)


def sign_p(positive: int, n: int) -> float:
    """One-sided sign test: P(X >= positive) for X ~ Binomial(n, 1/2); NaN when n = 0."""
    if n <= 0:
        return math.nan
    return float(sum(math.comb(n, j) for j in range(positive, n + 1)) / 2**n)


def trend(events: Sequence[float], totals: Sequence[float], scores: Sequence[float]) -> tuple[float, float]:
    """Cochran–Armitage trend test: ``(z, one-sided p of an increasing rate)``.

    ``events[g]`` of ``totals[g]`` tokens left the bounds in group g with score
    ``scores[g]`` (its precision KL). z = Σ s_g (x_g − N_g p̄) / sqrt(p̄(1−p̄)(Σ N_g s_g² −
    (Σ N_g s_g)²/N)). NaN when no token, no event, every token an event or equal scores.
    """
    x, n, s = (np.asarray(v, dtype=np.float64) for v in (events, totals, scores))
    if not (len(x) == len(n) == len(s)) or len(x) < 2:
        raise ValueError("trend test: events, totals and scores need one value per group (>= 2)")
    big_n = float(n.sum())
    if big_n <= 0:
        return math.nan, math.nan
    pbar = float(x.sum()) / big_n
    var = pbar * (1 - pbar) * (float((n * s * s).sum()) - float((n * s).sum()) ** 2 / big_n)
    if not var > 0:
        return math.nan, math.nan
    z = float((s * (x - n * pbar)).sum()) / math.sqrt(var)
    return z, float(sps.norm.sf(z))
