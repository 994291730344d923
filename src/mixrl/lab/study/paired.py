"""Paired intervals for few seeds: a t-interval over seeds and a hierarchical bootstrap.

Two arms of the study share everything but the arm: seed ``s`` of arm A and seed
``s`` of arm B draw the same prompts, and every run evaluates the same held-out
tasks with the same sampling seeds. The comparison is therefore paired: the
unit is the per-seed difference, not two independent samples.

For ``D[s, t] = A[s, t] − B[s, t]`` (pass@k of seed ``s`` on task ``t``), the
effect is ``mean_s mean_t D`` and two intervals are given side by side:

* ``paired t over seeds``: ``d_s = mean_t D[s, t]``; ``d̄ ± t_{S−1, 1−α/2} · sd(d) / √S``
  (Student 1908). Tasks are fixed: the question is "these tasks, another seed".
* ``paired bootstrap over seeds x tasks``: the variance of the effect has a seed part
  and a task part (seeds and tasks are crossed: every seed runs every task), each
  estimated by resampling one dimension with replacement, the other held, one
  draw shared by both arms (the pairing)::

      d_s = mean_t D[s, t],  e_t = mean_s D[s, t]
      v_seeds = Var_b(mean of S seeds drawn from d) · S / (S − 1)
      v_tasks = Var_b(mean of T tasks drawn from e) · T / (T − 1)

  (the plug-in variance has divisor n, hence the factors), and the interval
  ``d̄ ± t_{ν, 1−α/2} · √(v_seeds + v_tasks)`` with Satterthwaite's (1946) degrees of
  freedom ``ν = (v_s + v_t)² / (v_s² / (S − 1) + v_t² / (T − 1))``. Tasks are a sample
  too: "other tasks, another seed". A percentile interval over 3 seeds would be the
  seeds' min–max (10 distinct resamples; 71–73% simulated coverage);
  this one covers 93% (``tests/observe/test_paired.py``: 2000 simulations, 3 seeds x 16 tasks).

``tost`` reads an equivalence margin stated before the runs (Schuirmann 1987):
``equivalent`` when the ``1 − 2α`` interval lies inside ``(−m, m)``, ``different``
when the ``1 − α`` interval excludes 0, else ``not distinguishable``.
``rank_corr`` is Spearman's ρ with average ranks for ties (Pearson on mid-ranks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

T_METHOD = "paired t over seeds"
BOOT_METHOD = "paired bootstrap over seeds x tasks, Satterthwaite t"


@dataclass
class PairedInterval:
    estimate: float
    lo: float
    hi: float
    level: float
    method: str  # T_METHOD or BOOT_METHOD
    seeds: int
    tasks: int = 0  # 0: a per-run scalar (no task dimension)

    @property
    def contains_zero(self) -> bool:
        return not (self.lo > 0 or self.hi < 0)

    def __str__(self) -> str:
        size = f"{self.seeds} seeds" + (f" x {self.tasks} tasks" if self.tasks else "")
        return f"{self.estimate:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}] ({self.level:.0%} {self.method}, {size})"

    def to_dict(self) -> dict[str, float | str | int]:
        return {"estimate": self.estimate, "lo": self.lo, "hi": self.hi, "level": self.level,
                "method": self.method, "seeds": self.seeds, "tasks": self.tasks}


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (scipy.stats.t.ppf)."""
    return float(sps.t.ppf(p, df))


def paired_t(d: Sequence[float], level: float = 0.95, tasks: int = 0) -> PairedInterval | None:
    """t-interval of the mean of per-seed paired differences ``d`` (NaN left out); None under 2."""
    x = np.asarray([v for v in d if math.isfinite(v)], dtype=np.float64)
    if x.size < 2:
        return None
    est = float(x.mean())
    half = t_quantile(1 - (1 - level) / 2, x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return PairedInterval(est, est - half, est + half, level, T_METHOD, int(x.size), tasks)


def boot_var(x: np.ndarray, draws: int, rng: np.random.Generator) -> tuple[float, np.ndarray]:
    """Bootstrap variance of the mean of ``x`` (NaN left out) times n / (n − 1); returns it
    with the draws [B, n] that made it."""
    x = x[np.isfinite(x)]
    idx = rng.integers(0, x.size, size=(draws, x.size))
    return float(np.var(x[idx].mean(axis=1))) * x.size / (x.size - 1), idx


def paired_bootstrap(d: np.ndarray, level: float = 0.95, draws: int = 2000,
                     seed: int = 0) -> PairedInterval | None:
    """Two-way bootstrap interval (module docstring) of the mean of ``d`` [S, T]; None under
    2 seeds or 2 tasks."""
    d = np.asarray(d, dtype=np.float64)
    if d.ndim != 2 or d.shape[0] < 2 or d.shape[1] < 2:
        return None
    rng = np.random.default_rng(seed)
    per_seed, per_task = np.nanmean(d, axis=1), np.nanmean(d, axis=0)
    est = float(per_seed.mean())
    vs, _ = boot_var(per_seed, draws, rng)
    vt, _ = boot_var(per_task, draws, rng)
    s_n, t_n = d.shape
    v = vs + vt
    den = vs * vs / (s_n - 1) + vt * vt / (t_n - 1)
    df = v * v / den if den > 0 else float(s_n - 1)
    half = float(sps.t.ppf(1 - (1 - level) / 2, df)) * math.sqrt(v)
    return PairedInterval(est, est - half, est + half, level, BOOT_METHOD, s_n, t_n)


def both(a: np.ndarray, b: np.ndarray, level: float = 0.95, draws: int = 2000,
         seed: int = 0) -> tuple[PairedInterval | None, PairedInterval | None]:
    """(paired t, paired hierarchical bootstrap) of A − B for [S, T] matrices, row s of each
    being the same seed."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    t = paired_t(list(np.nanmean(d, axis=1)), level, tasks=d.shape[1])
    return t, paired_bootstrap(d, level, draws, seed)


def tost(iv_narrow: PairedInterval | None, iv_wide: PairedInterval | None, margin: float) -> str:
    """Equivalence verdict from the ``1 − 2α`` interval (``iv_narrow``, e.g. 90%) and the
    ``1 − α`` interval (``iv_wide``, e.g. 95%) against the stated margin."""
    if iv_narrow is None or iv_wide is None:
        return "inconclusive"
    if -margin < iv_narrow.lo and iv_narrow.hi < margin:
        return "equivalent"
    return "different" if not iv_wide.contains_zero else "not distinguishable"


def rank_corr(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's ρ with average ranks (scipy.stats.spearmanr); NaN under 3 points or a
    constant input."""
    if len(a) < 3 or len(set(a)) < 2 or len(set(b)) < 2:
        return math.nan
    return float(sps.spearmanr(a, b).statistic)


def same_ranking(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether ``a`` and ``b`` order their items identically (mid-ranks equal)."""
    return bool(np.array_equal(sps.rankdata(a), sps.rankdata(b)))


__all__ = ["PairedInterval", "T_METHOD", "BOOT_METHOD", "t_quantile", "paired_t", "boot_var",
           "paired_bootstrap", "both", "tost", "rank_corr", "same_ranking"]
