"""Bootstrap intervals of the study against float64 brute force on tiny examples."""

import itertools
import math

import numpy as np
import pytest

from mixrl.lab.study.stats import (
    NOT_DISTINGUISHABLE,
    Interval,
    bootstrap_mean_diff,
    bootstrap_passk_diff,
    diff_draws,
    hard_tasks,
    passk_matrix,
    verdict_of,
)


def _pk(n, c, k):  # textbook unbiased pass@k, exact integers
    return 1.0 - math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 1.0


A = [{"t0": (16, 3), "t1": (16, 0), "t2": (16, 9)}, {"t0": (16, 5), "t1": (16, 1), "t2": (16, 8)}]
B = [{"t0": (16, 1), "t1": (16, 0), "t2": (16, 4)}, {"t0": (16, 2), "t1": (16, 2), "t2": (16, 7)},
     {"t0": (16, 0), "t1": (16, 1), "t2": (16, 6)}]
TASKS = ["t0", "t1", "t2"]


def test_passk_matrix_matches_comb():
    m = passk_matrix(A, TASKS, 4)
    for s, t in itertools.product(range(2), range(3)):
        n, c = A[s][TASKS[t]]
        assert m[s, t] == pytest.approx(_pk(n, c, 4), abs=1e-12)


def test_every_replicate_equals_loops():
    ma, mb = passk_matrix(A, TASKS, 4), passk_matrix(B, TASKS, 4)
    reps, ti, ai, bi = diff_draws(ma, mb, 64, seed=3)
    def arm(tables, seeds, tasks):
        return sum(sum(_pk(*tables[s][TASKS[t]], 4) for t in tasks) / len(tasks)
                   for s in seeds) / len(seeds)

    for b in range(64):
        assert reps[b] == pytest.approx(arm(A, ai[b], ti[b]) - arm(B, bi[b], ti[b]), abs=1e-12)


def test_distribution_matches_exhaustive_enumeration():
    a = [{"x": (8, 2), "y": (8, 6)}, {"x": (8, 4), "y": (8, 7)}]
    b = [{"x": (8, 1), "y": (8, 5)}, {"x": (8, 0), "y": (8, 8)}]
    exact = []
    for tt in itertools.product("xy", repeat=2):
        for sa in itertools.product(range(2), repeat=2):
            for sb in itertools.product(range(2), repeat=2):
                da = np.mean([np.mean([_pk(*a[s][t], 2) for t in tt]) for s in sa])
                db = np.mean([np.mean([_pk(*b[s][t], 2) for t in tt]) for s in sb])
                exact.append(da - db)
    exact = np.array(exact)  # 64 equally likely outcomes
    reps, *_ = diff_draws(passk_matrix(a, "xy", 2), passk_matrix(b, "xy", 2), 40000, seed=1)
    assert reps.mean() == pytest.approx(exact.mean(), abs=4 * exact.std() / math.sqrt(40000))
    for x in np.quantile(exact, [0.1, 0.5, 0.9]):
        assert (reps <= x + 1e-12).mean() == pytest.approx((exact <= x + 1e-12).mean(), abs=0.01)
    iv = bootstrap_passk_diff(a, b, 2, draws=40000, seed=1)
    assert iv.estimate == pytest.approx(np.mean([[_pk(*t[k], 2) for k in "xy"] for t in a])
                                        - np.mean([[_pk(*t[k], 2) for k in "xy"] for t in b]))
    assert iv.lo == pytest.approx(np.quantile(exact, 0.025), abs=0.03)
    assert iv.hi == pytest.approx(np.quantile(exact, 0.975), abs=0.03)


def test_mean_diff_matches_enumeration():
    a, b = [0.1, 0.4, 0.35], [0.2, 0.05]
    exact = np.array([np.mean(x) - np.mean(y) for x in itertools.product(a, repeat=3)
                      for y in itertools.product(b, repeat=2)])
    iv = bootstrap_mean_diff(a, b, draws=40000, seed=2)
    assert iv.estimate == pytest.approx(np.mean(a) - np.mean(b), abs=1e-12)
    assert iv.lo == pytest.approx(np.quantile(exact, 0.025), abs=0.02)
    assert iv.hi == pytest.approx(np.quantile(exact, 0.975), abs=0.02)


def test_verdicts_read_the_interval():
    same = [{"t": (16, 8)}, {"t": (16, 8)}]
    iv = bootstrap_passk_diff(same, same, 4, draws=500)
    assert iv.estimate == 0 and verdict_of(iv) == NOT_DISTINGUISHABLE
    hi = [{f"t{i}": (16, 15) for i in range(20)}] * 3
    lo = [{f"t{i}": (16, 0) for i in range(20)}] * 3
    assert verdict_of(bootstrap_passk_diff(hi, lo, 4, draws=500)) == "higher"
    assert verdict_of(bootstrap_passk_diff(lo, hi, 4, draws=500)) == "lower"
    assert verdict_of(None) == "inconclusive"
    assert bootstrap_passk_diff([], hi, 4) is None
    assert "not" not in str(Interval(0.1, 0.05, 0.2, 0.95, 10, "seeds"))


def test_hard_tasks():
    assert hard_tasks({"a": (16, 3), "b": (16, 4), "c": (16, 0), "d": (0, 0)}) == ["a", "c"]
