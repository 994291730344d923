"""Summaries the benchmarks print: percentiles, medians over rounds, and an interval for a median.

``median_interval(xs)`` is the distribution-free confidence interval of the
median of ``xs``: with ``n`` independent rounds sorted ``x(1) <= ... <= x(n)``,
``x(j)`` lies above the true median exactly when fewer than ``j`` rounds fall
below it, and each round does so with probability 1/2, so

    P(x(k) <= median <= x(n - k + 1)) >= 1 - 2 * P(Binomial(n, 1/2) <= k - 1)

whatever the rounds' distribution (continuous, rounds independent). The
interval is the narrowest such pair, i.e. the largest ``k`` whose guaranteed
coverage is at least ``level``; fewer than 6 rounds cannot give 95% (``n = 5``:
1 - 2/32 = 0.9375), and then there is no interval (``None``).
"""

from __future__ import annotations

import math
import statistics
from typing import Any


def median_coverage(n: int, k: int) -> float:
    """Guaranteed coverage of ``[x(k), x(n - k + 1)]`` for the median of ``n`` rounds (1 <= k <= n/2)."""
    tail = sum(math.comb(n, i) for i in range(k)) / 2**n  # P(Binomial(n, 1/2) <= k - 1)
    return 1.0 - 2.0 * tail


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """``(lo, hi, coverage)``: the order-statistic interval of the median of ``xs``, or ``None``."""
    n = len(xs)
    s = sorted(xs)
    best = None
    for k in range(1, n // 2 + 1):
        cov = median_coverage(n, k)
        if cov < level:
            break
        best = (s[k - 1], s[n - k], round(cov, 4))
    return best


def pct_ms(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (seconds; nearest rank) in milliseconds, to 0.1 ms."""
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] * 1e3, 1)


def load_summary(wall: float, lat: list[float], tokens: int) -> dict[str, float]:
    """Requests/s, tokens/s and latency percentiles of one arm's load."""
    return {"wall_s": round(wall, 3), "requests_per_s": round(len(lat) / wall, 2),
            "tokens_per_s": round(tokens / wall, 1), "p50_ms": pct_ms(lat, 0.5), "p99_ms": pct_ms(lat, 0.99),
            "mean_ms": round(statistics.fmean(lat) * 1e3, 1), "generated_tokens": tokens,
            "mean_reply_tokens": round(tokens / len(lat), 1)}


def round_medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each numeric figure's median over the rounds, with the range of tokens/s."""
    out: dict[str, Any] = {k: round(statistics.median(r[k] for r in runs), 3) for k, v in runs[0].items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
    tps = [r["tokens_per_s"] for r in runs]
    out["tokens_per_s_range"] = [min(tps), max(tps)]
    return out
