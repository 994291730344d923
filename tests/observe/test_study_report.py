"""The report's 2 x 2 section against a float64 brute force on synthetic per-run data files.

Reference: pass@k from binomial coefficients, the paired t-interval with Student's
quantile found by bisection on the numerically integrated density, and the
two-way bootstrap's variances from every resample enumerated (3^3 seed draws,
5^5 task draws) rather than sampled.
"""

import argparse
import itertools
import json
import math

import numpy as np
import pytest

from mixrl.lab.study import compare, paired, studydata, studyreport
from mixrl.telemetry.monitor import monitor_config, replay

TASKS = [f"t{i}" for i in range(5)]
SEEDS = 3
G, C, REF = "grpo", "sc+mis+top-p", "reference/on-policy"
P = {f"stress-sync/{G}": 0.15, f"stress-async/{G}": 0.10, f"stress-sync/{C}": 0.35,
     f"stress-async/{C}": 0.33, REF: 0.40}
EFFECTS = {"precision G": ([f"stress-sync/{G}"], [REF]), "precision C": ([f"stress-sync/{C}"], [REF]),
           "lag G": ([f"stress-async/{G}"], [f"stress-sync/{G}"]),
           "lag C": ([f"stress-async/{C}"], [f"stress-sync/{C}"]),
           "correction sync": ([f"stress-sync/{C}"], [f"stress-sync/{G}"]),
           "interaction": ([f"stress-async/{C}", f"stress-sync/{G}"], [f"stress-sync/{C}", f"stress-async/{G}"])}
COLLAPSE_AT = 40


def pk(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def t_ppf(p, df):
    """Student's t quantile: bisection on 1/2 + the trapezoid integral of the density from 0."""
    lc = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(q):
        x = np.linspace(0.0, q, 400_001)
        return 0.5 + np.trapezoid(np.exp(lc - (df + 1) / 2 * np.log1p(x * x / df)), x)

    lo, hi = 0.0, 200.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def exact_boot_var(x):
    """Bootstrap variance of the mean over all n^n resamples, times n / (n - 1)."""
    n = len(x)
    means = [np.mean([x[i] for i in idx]) for idx in itertools.product(range(n), repeat=n)]
    return float(np.var(means)) * n / (n - 1)


def rows(p, steps, collapse):
    out = []
    for i in range(1, steps + 1):
        bad = collapse and i >= COLLAPSE_AT
        out.append({"step": i, "time": 1.5 * i, "rollout/reward": 0.1 if bad else 0.6 + p / 10 + 0.001 * (i % 3),
                    "precision/kl_k3": 0.3 if bad else 0.01, "lag/kl_k3": 0.02, "precision/ratio_oob": 0.01,
                    "precision/tokens": 100.0, "optim/grad_norm": 0.5, "policy/entropy": 0.3,
                    "rollout/format_error_end": 0.0, "rollout/empty_last_reply": 0.0,
                    "rollout/staleness_mean": 0.0})
    return out


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    rng = np.random.default_rng(7)
    counts = {}
    for cell, p in P.items():
        for s in range(SEEDS):
            counts[cell, s] = {t: [16, int(rng.binomial(16, min(0.95, p + 0.1 * j)))] for j, t in enumerate(TASKS)}
            rs = rows(p, 60, collapse=cell == f"stress-sync/{G}" and s < 2)
            cols = {k: [r.get(k) for r in rs] for k in rs[0]}
            f = out / "data" / cell / f"seed{s}.json"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps({"run": {"name": f"{cell}/seed{s}", "mode": cell.split("/")[0].split("-")[-1],
                                             "steps": 60, "update_s": 1.5},
                                     "eval": {"k": 4, "final": counts[cell, s], "base": {}},
                                     "steps": cols, "fp32": {"60": {"mean_reward": p + 0.01 * s}}}))
    args = argparse.ArgumentParser()
    compare.configure(args)
    assert compare.main(args.parse_args(["--recompute", str(out)])) == 0
    return out, counts


def reference(counts, plus, minus, level=0.95, k=1):
    d = np.array([[sum(pk(*counts[c, s][t], k) for c in plus) - sum(pk(*counts[c, s][t], k) for c in minus)
                   for t in TASKS] for s in range(SEEDS)], dtype=np.float64)
    per_seed, per_task = d.mean(axis=1), d.mean(axis=0)
    est = float(per_seed.mean())
    half_t = t_ppf(1 - (1 - level) / 2, SEEDS - 1) * per_seed.std(ddof=1) / math.sqrt(SEEDS)
    vs, vt = exact_boot_var(per_seed), exact_boot_var(per_task)
    df = (vs + vt) ** 2 / (vs**2 / (SEEDS - 1) + vt**2 / (len(TASKS) - 1))
    return est, half_t, t_ppf(1 - (1 - level) / 2, df) * math.sqrt(vs + vt)


def test_effects_and_intervals_equal_brute_force(study):
    out, counts = study
    res = json.loads((out / "design.json").read_text())
    report = (out / "report.md").read_text()
    eff = res["fleets"]["stress"]["effects"]
    for name, (plus, minus) in EFFECTS.items():
        est, half_t, half_b = reference(counts, plus, minus)
        t, b = eff[name]["t"], eff[name]["boot"]
        assert t["method"] == paired.T_METHOD and b["method"] == paired.BOOT_METHOD
        assert t["estimate"] == pytest.approx(est, abs=1e-12) and b["estimate"] == pytest.approx(est, abs=1e-12)
        assert (t["lo"], t["hi"]) == pytest.approx((est - half_t, est + half_t), abs=1e-7), name
        # 2000 resamples against the exact enumeration: the half-width within 10%
        assert (b["hi"] - b["lo"]) / 2 == pytest.approx(half_b, rel=0.10), name
        assert f"| {name} | {est:+.3f} [{est - half_t:+.3f}, {est + half_t:+.3f}] |" in report, name
        # pass@1 is the primary outcome; pass@4 the secondary, with the same intervals
        est4, half4, _ = reference(counts, plus, minus, k=4)
        t4 = eff[name]["secondary"]["t"]
        assert eff[name]["k"] == 1 and eff[name]["secondary"]["k"] == 4
        assert (t4["estimate"], t4["lo"], t4["hi"]) == pytest.approx((est4, est4 - half4, est4 + half4), abs=1e-7)
    # FP32-sampler reward of the last checkpoint, paired over seeds: P[plus] - P[minus]
    assert eff["lag G"]["reward_fp32"]["estimate"] == pytest.approx(0.10 - 0.15, abs=1e-12)
    assert "paired t over seeds" in report and "Satterthwaite" in report
    assert "The seed's findings" not in report and "Per arm: mean over seeds" not in report


def test_cell_table_and_collapses(study):
    out, counts = study
    runs = studydata.load(out)
    cells = {r["cell"]: r for r in studyreport.cell_rows(runs, 4, {})}
    per_seed = [np.mean([pk(*counts[REF, s][t], 4) for t in TASKS]) for s in range(SEEDS)]
    m = float(np.mean(per_seed))
    half = t_ppf(0.975, SEEDS - 1) * float(np.std(per_seed, ddof=1)) / math.sqrt(SEEDS)
    iv = cells[REF]["pass@4"]
    assert (iv["estimate"], iv["lo"], iv["hi"]) == pytest.approx((m, m - half, m + half), abs=1e-7)
    # the injected collapse (training reward 0.6 -> 0.1 and precision KL x 30 from update 40) in seeds 0 and 1 only
    flagged = cells[f"stress-sync/{G}"]["collapsed"]
    assert flagged.startswith("2/3") and "seed2" not in flagged
    step = replay(next(r for r in runs if r.name == f"stress-sync/{G}/seed0").rows, monitor_config({}))[0]
    assert COLLAPSE_AT <= step.first_collapse_step <= 60 and f"seed0@{step.first_collapse_step}" in flagged
    assert all(cells[c]["collapsed"] == "0/3" for c in P if c != f"stress-sync/{G}")
    assert cells[f"stress-sync/{G}"]["precision_oob"] == pytest.approx(0.01)
    assert (out / "figures" / "study_stress.png").stat().st_size > 10_000
    assert "(figures/study_stress.png)" in (out / "report.md").read_text()
    assert "data:image/png;base64," in (out / "report.html").read_text()


def test_regime_against_the_probe_artifacts(study):
    out, _ = study
    real = json.loads(studyreport.PROBES["real"].read_text())["result"]["profiles"]["b200-nvfp4"]
    toy = json.loads(studyreport.PROBES["toy"].read_text())["result"]["profiles"]["b200-nvfp4"]
    reg = studyreport.regime(studydata.load(out))
    row = next(r for r in reg["probe"] if r["profile"] == "b200-nvfp4")
    assert row["real_kl"] == real["mismatch/kl_exact"] and row["real_oob"] == real["mismatch/ratio_oob"]
    assert row["kl_ratio"] == pytest.approx(real["mismatch/kl_exact"] / toy["mismatch/kl_exact"], rel=1e-12)
    assert 0.3 < row["real_kl"] < 0.35 and 0.09 < row["real_oob"] < 0.1 and row["toy_oob"] == 0.0
    assert "How far the toy's regime is" in (out / "report.md").read_text()
