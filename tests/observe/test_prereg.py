"""The pre-registered tests against float64 brute force, and the collapse monitor on committed data."""

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from mixrl.lab.study import outcome, prereg, studydata
from mixrl.lab.study.compare import study_table
from mixrl.telemetry.monitor import monitor_config, replay

ROOT = Path(__file__).resolve().parents[2]


def _t_sf(t, df):
    """P(T > t): the trapezoid integral of Student's density from t to a far tail."""
    lc = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    x = np.linspace(t, t + 4000.0, 4_000_001)
    return float(np.trapezoid(np.exp(lc - (df + 1) / 2 * np.log1p(x * x / df)), x))


@pytest.mark.parametrize("d", [[0.1, 0.05, 0.12, 0.02], [-0.03, 0.01, -0.02], [0.2, -0.1, 0.05, 0.0, 0.04]])
def test_paired_p_and_noninferiority_match_the_integrated_density(d):
    x = np.asarray(d, dtype=np.float64)
    se = x.std(ddof=1) / math.sqrt(len(x))
    t = x.mean() / se
    assert prereg.paired_p(d) == pytest.approx(2 * _t_sf(abs(t), len(x) - 1), rel=1e-6)
    tn = (x.mean() + 0.05) / se
    assert prereg.noninferiority_p(d, 0.05) == pytest.approx(_t_sf(tn, len(x) - 1), rel=1e-6)
    assert math.isnan(prereg.paired_p([0.1]))
    with pytest.raises(ValueError, match="margin"):
        prereg.noninferiority_p(d, 0.0)


def test_holm_equals_closed_testing_with_bonferroni():
    """Holm's adjusted p = the closed test's: max over every subset holding H_i of |S| min_{j in S} p_j."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        names = [f"H{i}" for i in range(int(rng.integers(1, 6)))]
        p = {n: float(v) for n, v in zip(names, rng.uniform(0, 0.3, len(names)), strict=True)}
        want = {}
        for n in names:
            subsets = (s for r in range(1, len(names) + 1) for s in itertools.combinations(names, r) if n in s)
            want[n] = max(min(1.0, len(s) * min(p[j] for j in s)) for s in subsets)
        assert prereg.holm(p) == pytest.approx(want, abs=1e-15)
    assert math.isnan(prereg.holm({"a": math.nan, "b": 0.01})["a"]) and prereg.holm({"a": math.nan, "b": 0.01})["b"] == 0.01


@pytest.mark.parametrize("table", [(2, 1, 0, 3), (5, 2, 1, 6), (0, 7, 0, 7), (3, 0, 0, 3)])
def test_fisher_equals_the_hypergeometric_enumeration(table):
    a, b, c, d = table
    row, col, n = a + b, a + c, a + b + c + d

    def prob(x):
        return math.comb(col, x) * math.comb(n - col, row - x) / math.comb(n, row)

    xs = range(max(0, row + col - n), min(row, col) + 1)
    p0 = prob(a)
    want = sum(prob(x) for x in xs if prob(x) <= p0 * (1 + 1e-7))
    assert prereg.fisher(a, b, c, d) == pytest.approx(min(1.0, want), rel=1e-9)


def test_trend_equals_sqrt_n_times_the_token_correlation():
    events, totals, scores = [3, 10, 30], [1000, 900, 800], [0.0, 1.0, 2.5]
    z, p = prereg.trend(events, totals, scores)
    y = np.concatenate([np.r_[np.ones(e), np.zeros(t - e)] for e, t in zip(events, totals, strict=True)])
    s = np.concatenate([np.full(t, sc) for t, sc in zip(totals, scores, strict=True)])
    assert z == pytest.approx(math.sqrt(len(y)) * np.corrcoef(s, y)[0, 1], rel=1e-12)
    assert p == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)), rel=1e-9)
    assert all(math.isnan(v) for v in prereg.trend([0, 0], [10, 10], [0, 1]))
    assert prereg.sign_p(3, 3) == pytest.approx(1 / 8) and prereg.sign_p(5, 7) == pytest.approx(29 / 128)


def test_the_monitor_flags_the_committed_stress_async_grpo_seed2_collapse():
    """Held-out pass@4 0.000, FP32-sampler reward 0.70 -> 0.00 (updates 125 -> 150), no precision KL
    on any token at its end: the lag KL growth is what the monitor sees."""
    data = ROOT / "docs/artifacts/study/data/stress-async/grpo/seed2.json"
    run = studydata.to_run(json.loads(data.read_text()))
    mon_cfg = monitor_config(study_table(None)["monitor"])
    mon, events = replay(run.rows, mon_cfg)
    assert mon.collapsed and 100 < mon.first_collapse_step <= 150
    assert any(e["signal"] == "collapse" for e in events)
    at = replay(run.rows[: mon.first_collapse_step], mon_cfg)[0].signals()
    assert at["reward_drop"] and at["lag_kl_growth"] and not at["kl_growth"]
    assert outcome.reasons(run, study_table(None), {}, math.nan) == ["monitor", "fp32"]
    # the same run with the lag KL removed: the precision KL alone misses it
    blind = [{k: v for k, v in r.items() if not k.startswith("lag/")} for r in run.rows]
    assert not replay(blind, mon_cfg)[0].collapsed
