"""Paired intervals: formulas against float64 brute force, coverage by simulation.

The coverage tests print what they measure (``pytest -s``): with 3 seeds the old
percentile bootstrap over seeds covers ~75%, the paired t and the paired
hierarchical bootstrap with a t_{S-1} quantile cover close to 95%.
"""

import itertools
import math

import numpy as np
import pytest

from mixrl.lab.study import paired
from mixrl.lab.study.stats import bootstrap_mean_diff

SIMS = 2000  # coverage standard error sqrt(.95 * .05 / 2000) = 0.005


def _t_cdf(x, df, n=200_000):
    """Student t CDF by the midpoint rule on its density (float64)."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    u = np.linspace(0.0, x, n + 1)
    mid = (u[1:] + u[:-1]) / 2
    return 0.5 + float(np.sum(c * (1 + mid**2 / df) ** (-(df + 1) / 2)) * (x / n))


def test_t_quantile_closed_forms_and_integral():
    for p in (0.9, 0.975, 0.995):
        assert paired.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-10)
        u = 2 * p - 1  # df = 2: F(t) = 1/2 + t / (2 sqrt(2 + t^2))
        assert paired.t_quantile(p, 2) == pytest.approx(math.sqrt(2 * u * u / (1 - u * u)), rel=1e-10)
        for df in (4, 7):
            assert _t_cdf(paired.t_quantile(p, df), df) == pytest.approx(p, abs=1e-8)


def test_paired_t_by_hand():
    d = [0.10, 0.02, 0.06]
    m = sum(d) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / 2)
    half = math.sqrt(2 * 0.95**2 / (1 - 0.95**2)) * sd / math.sqrt(3)  # t_{2, 0.975}, closed form
    iv = paired.paired_t(d)
    assert (iv.estimate, iv.lo, iv.hi) == pytest.approx((m, m - half, m + half), abs=1e-12)
    assert iv.method == paired.T_METHOD and "paired t" in str(iv)
    assert paired.paired_t([0.3]) is None and paired.paired_t([0.3, math.nan]) is None


def test_boot_var_replicates_equal_loops():
    x = np.array([0.3, -0.1, 0.25, 0.0])
    v, idx = paired.boot_var(x, 50, np.random.default_rng(4))
    reps = [sum(x[i] for i in row) / 4 for row in idx]
    assert v == pytest.approx(np.var(reps) * 4 / 3, abs=1e-15)


def test_bootstrap_matches_exhaustive_enumeration():
    d = np.array([[0.3, -0.1, 0.2], [0.05, 0.2, 0.1]])  # 2 seeds x 3 tasks
    ds, dt = d.mean(axis=1), d.mean(axis=0)
    vs = np.var([np.mean([ds[i] for i in c]) for c in itertools.product(range(2), repeat=2)]) * 2
    vt = np.var([np.mean([dt[i] for i in c]) for c in itertools.product(range(3), repeat=3)]) * 3 / 2
    v = vs + vt
    df = v * v / (vs * vs / 1 + vt * vt / 2)
    iv = paired.paired_bootstrap(d, draws=400_000, seed=1)
    assert iv.estimate == pytest.approx(d.mean(), abs=1e-12)
    from scipy import stats as sps

    assert iv.hi - iv.estimate == pytest.approx(sps.t.ppf(0.975, df) * math.sqrt(v), rel=0.02)
    assert iv.method == paired.BOOT_METHOD and iv.tasks == 3
    assert paired.paired_bootstrap(d[:1]) is None and paired.paired_bootstrap(d[:, :1]) is None


def test_both_pairs_rows():
    a = np.array([[1.0, 0.5], [0.8, 0.4], [0.9, 0.7]])
    b = a - np.array([[0.1], [0.2], [0.3]])  # seed-wise differences 0.1, 0.2, 0.3
    t, boot = paired.both(a, b, draws=500)
    ref = paired.paired_t([0.1, 0.2, 0.3])
    assert (t.lo, t.hi) == pytest.approx((ref.lo, ref.hi), abs=1e-12)
    assert boot.estimate == pytest.approx(0.2, abs=1e-12)


def _coverage(method, rng, sims=SIMS):
    hits = 0
    for _ in range(sims):
        hits += method(rng)
    return hits / sims


def _methods(delta, data):
    def old(rng):
        iv = bootstrap_mean_diff(list(data(rng).mean(axis=1)), draws=400, seed=int(rng.integers(1 << 30)))
        return iv.lo <= delta <= iv.hi

    def t(rng):
        iv = paired.paired_t(list(data(rng).mean(axis=1)))
        return iv.lo <= delta <= iv.hi

    def boot(rng):
        iv = paired.paired_bootstrap(data(rng), draws=400, seed=int(rng.integers(1 << 30)))
        return iv.lo <= delta <= iv.hi

    return {"percentile bootstrap over seeds": old, "paired t": t, "paired bootstrap seeds x tasks": boot}


@pytest.mark.parametrize("task_sd", [0.0, 0.03])
def test_coverage_at_three_seeds(task_sd):
    """3 seeds x 16 tasks, known effect 0.05, D[s, t] = effect + seed effect + task effect +
    noise. The old percentile bootstrap over seeds is the seeds' min-max (1 - 2 / 2^3 = 75%
    for seed noise alone, less with a task effect it cannot see); the paired t is exact
    without a task effect (it holds the tasks fixed; at this task sd the shared task effect
    is small beside the seed variance); the two-way bootstrap is near 95% in both."""
    delta, s_n, t_n = 0.05, 3, 16

    def data(rng):
        return (delta + rng.normal(0, 0.04, (s_n, 1)) + rng.normal(0, task_sd, (1, t_n))
                + rng.normal(0, 0.05, (s_n, t_n)))

    rng = np.random.default_rng(2026)
    cov = {name: _coverage(f, rng) for name, f in _methods(delta, data).items()}
    print(f"simulated coverage of nominal 95% intervals, 3 seeds, task sd {task_sd}:", cov)
    old, t, boot = cov.values()
    if task_sd == 0:
        assert 0.70 <= old <= 0.79
    else:
        assert 0.65 <= old <= 0.76
    assert t == pytest.approx(0.95, abs=0.02)
    assert 0.91 <= boot <= 0.97


def test_coverage_unpaired_percentile_bootstrap():
    """The former difference of two arms, each resampled over its 3 seeds independently."""
    delta = 0.05

    def one(rng):
        a, b = rng.normal(delta, 0.04, 3), rng.normal(0.0, 0.04, 3)
        iv = bootstrap_mean_diff(list(a), list(b), draws=400, seed=int(rng.integers(1 << 30)))
        return iv.lo <= delta <= iv.hi

    cov = _coverage(one, np.random.default_rng(11))
    print("simulated coverage, unpaired percentile bootstrap, 3 + 3 seeds:", cov)
    assert 0.76 <= cov <= 0.86


def test_t_covers_nominal_without_task_effect():
    rng = np.random.default_rng(7)
    cov = _coverage(lambda r: (lambda iv: iv.lo <= 0.0 <= iv.hi)(paired.paired_t(list(r.normal(0, 1, 3)))), rng)
    assert cov == pytest.approx(0.95, abs=0.015)


def test_tost_verdicts():
    iv = paired.PairedInterval

    def pair(lo90, hi90, lo95, hi95):
        return iv(0, lo90, hi90, 0.90, "m", 3), iv(0, lo95, hi95, 0.95, "m", 3)

    assert paired.tost(*pair(-0.02, 0.03, -0.03, 0.04), margin=0.05) == "equivalent"
    assert paired.tost(*pair(0.06, 0.10, 0.05, 0.11), margin=0.05) == "different"
    assert paired.tost(*pair(-0.02, 0.08, -0.03, 0.09), margin=0.05) == "not distinguishable"
    assert paired.tost(None, None, 0.05) == "inconclusive"


def _midranks(x):
    return [sum(y < v for y in x) + (sum(y == v for y in x) + 1) / 2 for v in x]


def _pearson(a, b):
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))


@pytest.mark.parametrize("a,b", [([0.1, 0.0, 0.0, 0.3], [1.0, 2.0, 3.0, 4.0]),
                                 ([1, 2, 2, 3, 3, 3], [6, 5, 5, 1, 2, 0]),
                                 ([0.5, 0.2, 0.9], [0.1, 0.1, 0.4])])
def test_rank_corr_is_pearson_on_midranks(a, b):
    assert paired.rank_corr(a, b) == pytest.approx(_pearson(_midranks(a), _midranks(b)), abs=1e-12)


def test_rank_corr_edges_and_same_ranking():
    assert math.isnan(paired.rank_corr([1, 2], [3, 4]))
    assert math.isnan(paired.rank_corr([1, 1, 1], [3, 4, 5]))
    assert paired.same_ranking([0.1, 0.5, 0.3], [1, 9, 4])
    assert not paired.same_ranking([0.1, 0.5, 0.3], [1, 4, 9])
    assert not paired.same_ranking([0.1, 0.1, 0.3], [1, 2, 3])  # a tie is a different ranking
