import json
import random
from argparse import Namespace

from mixrl.lab.study import report
from mixrl.lab.study.findings import judge
from mixrl.lab.study.runs import load_runs

ARMS = ("grpo", "grpo+mis", "sc", "grpo+top-p", "sc+mis", "sc+mis+top-p")
GROUPS = {"b200-nvfp4": (0.2, 3e-3), "h100-fp8": (0.5, 1e-3), "h100-bf16": (0.3, 3e-4)}
TASKS = [f"t{i}" for i in range(30)]


def _per_task(rate, rng, n=16):
    # task difficulty varies; the arm's rate scales every task's chance
    return {t: [n, sum(rng.random() < min(1.0, rate * (0.2 + 1.6 * i / len(TASKS))) for _ in range(n))]
            for i, t in enumerate(TASKS)}


def _write_run(d, arm, fleet, collapse, seed, rate=0.4):
    rng = random.Random(seed)
    d.mkdir(parents=True)
    rows, cost = [], 0.0
    for step in range(1, 41):
        t = max(0, step - 15) / 25 if collapse else 0.0
        row = {"step": step, "time": step * 1.0,
               "rollout/reward": 0.5 - 0.4 * t + rng.gauss(0, 0.02),
               "precision/kl_k3": 1e-3 * (1 + 8 * t),
               "optim/grad_norm": 0.5 + t, "policy/entropy": 0.9, "rollout/length": 30.0,
               "precision/ratio_oob": 0.01, "rollout/format_error_end": 0.05 + 0.9 * t,
               "rollout/empty_last_reply": 0.02 + 0.5 * t, "rollout/turns": 2.0}
        cost += 0.01 if fleet == "mixed" else 0.02
        row["cost/cumulative"] = cost
        if fleet == "mixed":
            for g, (share, kl) in GROUPS.items():
                row[f"share/samples/{g}"] = share
                row[f"precision/kl_k3/{g}"] = kl
                row[f"precision/ratio_oob/{g}"] = kl * 10
                row[f"precision/tokens/{g}"] = 1000.0
                row[f"share/oob_tokens/{g}"] = kl / sum(v[1] for v in GROUPS.values())
        rows.append(row)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    final = {"pass@1": 0.3, "pass@4": 0.6, "n_tasks": 30, "per_task": _per_task(rate, rng)}
    base = {"pass@1": 0.2, "pass@4": 0.5, "n_tasks": 30, "per_task": _per_task(0.2, random.Random(99))}
    (d / "eval.json").write_text(json.dumps({"final": final, "base": base, "gain": 0.1}))
    (d / "config.toml").write_text(f'[loss]\npreset = "{arm}"\n')
    (d / "episodes.jsonl").write_text(json.dumps({"step": 40, "prompt_id": "t1", "status": "ok", "reward": 1.0,
        "turns": 2, "replies": [{"tokens": 5, "text": "x", "group": "g", "version": 3},
                                {"tokens": 1, "text": "", "group": "g", "version": 3}]}) + "\n")
    if collapse:
        (d / "collapse.jsonl").write_text(json.dumps({"step": 30, "signal": "collapse",
                                                      "active": True}) + "\n")


def _study(tmp_path, collapse_grpo=True, seeds=3):
    rates = {"grpo": 0.1 if collapse_grpo else 0.4, "sc+mis+top-p": 0.4, "on-policy": 0.4}
    for s in range(seeds):
        for arm in ("grpo", "sc+mis+top-p"):
            for fleet in ("mixed", "homogeneous"):
                c = collapse_grpo and arm == "grpo" and fleet == "mixed"
                _write_run(tmp_path / fleet / arm / f"seed{s}", arm, fleet, c, seed=100 * s + len(arm)
                           + len(fleet), rate=rates[arm])
        _write_run(tmp_path / "reference" / "on-policy" / f"seed{s}", "on-policy", "reference", False,
                   seed=7 + s, rate=0.4)


def test_study_with_seeds_has_intervals_and_verdicts(tmp_path):
    _study(tmp_path)
    assert report.main(Namespace(dir=tmp_path, k=4)) == 0
    md = (tmp_path / "report.md").read_text()
    assert "## Per arm: mean over seeds [95% bootstrap interval]" in md
    assert "| mixed/grpo | 3 |" in md and "| reference/on-policy | 3 |" in md
    assert "modelled" in md and "profiles.toml" in md
    runs = load_runs(tmp_path)
    assert len(runs) == 15 and {r.seed for r in runs} == {"seed0", "seed1", "seed2"}
    assert (tmp_path / "figures" / "timelines.png").stat().st_size > 5_000
    v = {f.title: f for f in judge(runs)}
    assert v["1. uncorrected GRPO collapses (mixed fleet)"].verdict == "reproduced"
    assert v["2. SC + MIS stays stable (mixed fleet)"].verdict == "reproduced"
    # homogeneous GRPO is as poor (rate 0.1) but never flagged: a deficit, not a collapse
    homo = v["1. uncorrected GRPO collapses (homogeneous fleet)"]
    assert homo.verdict == "not reproduced" and homo.interval.hi < 0
    f3 = v["3. mixed fleet matches homogeneous (quality; cost reported separately)"]
    assert f3.verdict == "not distinguishable" and f3.interval.contains_zero
    assert "Cost, separately" in f3.evidence and "not measured" in f3.evidence
    assert v["4. out-of-range rate follows precision KL (mixed fleet)"].verdict == "reproduced"
    assert all(f.interval is not None for f in v.values() if not f.title.startswith("4."))  # F4 is a count test


def test_no_collapse_is_not_distinguishable(tmp_path):
    _study(tmp_path, collapse_grpo=False)
    v = {f.title[:2]: f.verdict for f in judge(load_runs(tmp_path))}
    assert v["1."] == "not distinguishable" and v["2."] == "not distinguishable"


def test_report_has_every_arm_and_finding(tmp_path):
    for i, arm in enumerate(ARMS):
        for fleet in ("mixed", "homogeneous"):
            _write_run(tmp_path / fleet / arm, arm, fleet, collapse=arm == "grpo" and fleet == "mixed",
                       seed=i)
    assert report.main(Namespace(dir=tmp_path, k=4)) == 0
    md = (tmp_path / "report.md").read_text()
    html = (tmp_path / "report.html").read_text()
    for arm in ARMS:
        for fleet in ("mixed", "homogeneous"):
            assert f"{fleet}/{arm}" in md and f"{fleet}/{arm}" in html
    for n in ("1.", "2.", "3.", "4."):
        assert f"**{n}" in md
    for fig in ("curves.png", "groups.png", "passk_cost.png", "timelines.png", "precision_lag.png"):
        p = tmp_path / "figures" / fig
        assert p.exists() and p.stat().st_size > 10_000
    assert html.count("data:image/png;base64,") == 5
    run = next(r for r in load_runs(tmp_path) if r.name == "mixed/grpo")
    assert run.config == {"loss": {"preset": "grpo"}}
    assert run.eval["pass@4"] == 0.6 and run.evals[0]["pass@4"] == 0.5
    verdicts = {f.title[:2]: f.verdict for f in judge(load_runs(tmp_path))}
    # no on-policy reference: F1 cannot be judged; one seed, identical rates: F2, F3 undecided
    assert verdicts == {"1.": "inconclusive", "2.": "not distinguishable", "3.": "not distinguishable",
                        "4.": "reproduced"}


def test_findings_honest_when_nothing_collapses(tmp_path):
    for arm in ("grpo", "sc+mis+top-p"):
        for fleet in ("mixed", "homogeneous"):
            _write_run(tmp_path / fleet / arm, arm, fleet, collapse=False, seed=1)
    verdicts = {f.title[:2]: f.verdict for f in judge(load_runs(tmp_path))}
    assert verdicts["1."] == "inconclusive"  # no on-policy reference run
    assert verdicts["2."] == "not distinguishable"


def test_kl_growth_needs_measured_steps():
    import math
    from pathlib import Path

    from mixrl.lab.study.findings import kl_growth
    from mixrl.lab.study.runs import Run

    def run(kls):  # precision KL on some steps only, as async runs record it
        return Run(Path("r"), "mixed/grpo", rows=[{"step": i + 1, **({"precision/kl_k3": v} if v else {})}
                                                   for i, v in enumerate(kls)])

    assert math.isnan(kl_growth(run([0.01] + [None] * 23)))  # one measured step: not a ratio of 1
    assert kl_growth(run([1.0, None, 1.0, 3.0, None, 3.0])) == 3.0  # halves of the 4 measured steps
    long = [1.0] * 10 + [2.0] * 10 + [5.0] * 5 + [8.0] * 10  # skip 10, early 2.0, late 8.0
    assert kl_growth(run(long)) == 4.0
