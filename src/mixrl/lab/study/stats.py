"""Bootstrap intervals for the study's verdicts: over seeds, and over tasks where there are tasks.

An arm is a list of seeds; a seed's held-out evaluation is a per-task table of
``(n, c)`` (samples, correct). Its score on a task set is the mean of the
unbiased pass@k (``rollout/passk.py``) over those tasks. The difference of two
arms is resampled hierarchically:

    for b in 1..B:
        tasks*  = T tasks drawn with replacement (one draw, shared by both arms: paired)
        seeds*A = S_A seeds of arm A drawn with replacement; seeds*B likewise
        d_b = mean_{s in seeds*A} mean_{t in tasks*} pass@k(A, s, t)
            − mean_{s in seeds*B} mean_{t in tasks*} pass@k(B, s, t)

and the interval is the (α/2, 1 − α/2) percentiles of ``d_b``. A per-run scalar
(final training reward, KL growth) has no task dimension: only seeds are
resampled. ``verdict_of`` reads an interval: ``"not distinguishable"`` when it
contains 0, else the sign. Replicates are returned with the draws that made them
so a test can recompute each one by brute force.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mixrl.rollout.passk import pass_at_k

NOT_DISTINGUISHABLE = "not distinguishable"


@dataclass
class Interval:
    estimate: float  # the difference on the data as observed (no resampling)
    lo: float
    hi: float
    level: float  # e.g. 0.95
    replicates: int
    what: str  # "seeds x tasks" or "seeds"

    @property
    def contains_zero(self) -> bool:
        return not (self.lo > 0 or self.hi < 0)

    def __str__(self) -> str:
        return (
            f"{self.estimate:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}] "
            f"({self.level:.0%} bootstrap over {self.what}, B={self.replicates})"
        )


def verdict_of(iv: Interval | None) -> str:
    """``not distinguishable`` / ``higher`` / ``lower``; ``inconclusive`` without an interval."""
    if iv is None or math.isnan(iv.lo) or math.isnan(iv.hi):
        return "inconclusive"
    if iv.contains_zero:
        return NOT_DISTINGUISHABLE
    return "higher" if iv.lo > 0 else "lower"


def passk_matrix(
    per_seed: Sequence[dict[str, Sequence[int]]], tasks: Sequence[str], k: int
) -> np.ndarray:
    """[S, T] float64 pass@k of each seed on each task (tasks absent from a seed: NaN)."""
    out = np.full((len(per_seed), len(tasks)), np.nan, dtype=np.float64)
    for s, table in enumerate(per_seed):
        for t, task in enumerate(tasks):
            if task in table:
                n, c = table[task]
                out[s, t] = pass_at_k(int(n), int(c), k)
    return out


def _percentiles(d: np.ndarray, level: float) -> tuple[float, float]:
    a = (1 - level) / 2
    d = d[np.isfinite(d)]
    if d.size == 0:
        return math.nan, math.nan
    return float(np.quantile(d, a)), float(np.quantile(d, 1 - a))


def diff_draws(
    a: np.ndarray, b: np.ndarray, draws: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Hierarchical replicates of mean(a) − mean(b) for [S_A, T] and [S_B, T] matrices.

    Returns (replicates [B], task draws [B, T], seed draws of A [B, S_A], of B [B, S_B])."""
    rng = np.random.default_rng(seed)
    t = a.shape[1]
    ti = rng.integers(0, t, size=(draws, t))
    ai = rng.integers(0, a.shape[0], size=(draws, a.shape[0]))
    bi = rng.integers(0, b.shape[0], size=(draws, b.shape[0]))
    # per-seed mean over the drawn tasks: [B, S] (nanmean: a task missing from one seed)
    a_t = np.nanmean(a[:, ti], axis=2).T  # a[:, ti] is [S_A, B, T]
    b_t = np.nanmean(b[:, ti], axis=2).T
    ma = np.take_along_axis(a_t, ai, axis=1).mean(axis=1)
    mb = np.take_along_axis(b_t, bi, axis=1).mean(axis=1)
    return ma - mb, ti, ai, bi


def _common_tasks(tables: Sequence[dict[str, Sequence[int]]]) -> list[str]:
    """The tasks every seed's table evaluated, sorted."""
    return sorted(set.intersection(*(set(t) for t in tables)))


def bootstrap_passk_diff(
    a: Sequence[dict[str, Sequence[int]]],
    b: Sequence[dict[str, Sequence[int]]],
    k: int,
    *,
    tasks: Sequence[str] | None = None,
    draws: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> Interval | None:
    """pass@k(A) − pass@k(B) with a bootstrap interval over seeds and (paired) tasks.

    ``a``, ``b``: per seed, ``{task: (n, c)}``. ``tasks``: the task set (default: the
    tasks every seed of both arms evaluated). None when either arm has no seed or
    the task set is empty."""
    if not a or not b:
        return None
    tasks = _common_tasks([*a, *b]) if tasks is None else list(tasks)
    if not tasks:
        return None
    ma, mb = passk_matrix(a, tasks, k), passk_matrix(b, tasks, k)
    est = float(np.nanmean(np.nanmean(ma, axis=1)) - np.nanmean(np.nanmean(mb, axis=1)))
    reps, *_ = diff_draws(ma, mb, draws, seed)
    lo, hi = _percentiles(reps, level)
    return Interval(est, lo, hi, level, draws, f"{len(a)}+{len(b)} seeds x {len(tasks)} tasks")


def bootstrap_mean_diff(
    a: Sequence[float],
    b: Sequence[float] | None = None,
    *,
    draws: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> Interval | None:
    """mean(a) − mean(b) (or mean(a) alone) with a bootstrap interval over seeds."""
    xa = np.array([x for x in a if math.isfinite(x)], dtype=np.float64)
    xb = None if b is None else np.array([x for x in b if math.isfinite(x)], dtype=np.float64)
    if xa.size == 0 or (xb is not None and xb.size == 0):
        return None
    rng = np.random.default_rng(seed)
    reps = xa[rng.integers(0, xa.size, size=(draws, xa.size))].mean(axis=1)
    est = float(xa.mean())
    if xb is not None:
        reps = reps - xb[rng.integers(0, xb.size, size=(draws, xb.size))].mean(axis=1)
        est -= float(xb.mean())
    lo, hi = _percentiles(reps, level)
    what = f"{xa.size} seeds" if xb is None else f"{xa.size}+{xb.size} seeds"
    return Interval(est, lo, hi, level, draws, what)


def bootstrap_passk_mean(
    a: Sequence[dict[str, Sequence[int]]],
    k: int,
    *,
    tasks: Sequence[str] | None = None,
    draws: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> Interval | None:
    """pass@k of one arm with its interval over seeds and tasks (the difference from an
    arm that scores 0 on every task: the same resampling as ``bootstrap_passk_diff``)."""
    if not a:
        return None
    tasks = _common_tasks(a) if tasks is None else list(tasks)
    zero = [{t: (max(k, 1), 0) for t in tasks}]
    iv = bootstrap_passk_diff(a, zero, k, tasks=tasks, draws=draws, level=level, seed=seed)
    if iv is not None:
        iv.what = f"{len(a)} seeds x {len(tasks)} tasks"
    return iv


def hard_tasks(base: dict[str, Sequence[int]], threshold: float = 0.25) -> list[str]:
    """Tasks the base policy solves less than ``threshold`` of the time (c / n)."""
    return sorted(t for t, (n, c) in base.items() if n > 0 and c / n < threshold)


__all__ = [
    "Interval",
    "NOT_DISTINGUISHABLE",
    "verdict_of",
    "passk_matrix",
    "diff_draws",
    "bootstrap_passk_mean",
    "bootstrap_passk_diff",
    "bootstrap_mean_diff",
    "hard_tasks",
]

