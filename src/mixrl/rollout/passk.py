"""Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models
Trained on Code", arXiv 2107.03374, eq. 1 and its numerically stable form).

From n >= k samples of which c are correct,

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

The product form never builds a binomial coefficient (no overflow, no
catastrophic cancellation for large n). Edge cases: if n - c < k every draw
of k contains a correct sample, so pass@k = 1; c = 0 gives 0.
"""

from __future__ import annotations

from collections.abc import Iterable


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with ``c`` correct out of ``n`` samples."""
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """Mean pass@k over tasks given (n, c) per task; 0 tasks -> ValueError."""
    vals = [pass_at_k(n, c, k) for n, c in counts]
    if not vals:
        raise ValueError("mean_pass_at_k: no tasks")
    return sum(vals) / len(vals)
