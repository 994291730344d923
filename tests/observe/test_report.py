import json
import random
from argparse import Namespace

from mixrl.observe import report
from mixrl.observe.findings import judge
from mixrl.observe.runs import load_runs

ARMS = ("grpo", "grpo+mis", "sc", "grpo+top-p", "sc+mis", "sc+mis+top-p")
GROUPS = {"b200-nvfp4": (0.2, 3e-3), "h100-fp8": (0.5, 1e-3), "h100-bf16": (0.3, 3e-4)}


def _write_run(d, arm, fleet, collapse, seed):
    rng = random.Random(seed)
    d.mkdir(parents=True)
    rows, cost = [], 0.0
    for step in range(1, 41):
        t = max(0, step - 15) / 25 if collapse else 0.0
        row = {"step": step, "time": step * 1.0,
               "rollout/reward": 0.5 - 0.4 * t + rng.gauss(0, 0.02),
               "mismatch/kl_k3": 1e-3 * (1 + 8 * t),
               "optim/grad_norm": 0.5 + t, "policy/entropy": 0.9, "rollout/length": 30.0,
               "mismatch/ratio_oob": 0.01, "rollout/format_error_end": 0.05 + 0.9 * t}
        cost += 0.01 if fleet == "mixed" else 0.02
        row["cost/cumulative"] = cost
        if fleet == "mixed":
            for g, (share, kl) in GROUPS.items():
                row[f"share/samples/{g}"] = share
                row[f"mismatch/kl_k3/{g}"] = kl
                row[f"mismatch/ratio_oob/{g}"] = kl * 10
                row[f"share/oob_tokens/{g}"] = kl / sum(v[1] for v in GROUPS.values())
        rows.append(row)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    final = {"pass@1": 0.3, "pass@4": 0.6, "n_tasks": 64}
    base = {"pass@1": 0.2, "pass@4": 0.5, "n_tasks": 64}
    (d / "eval.json").write_text(json.dumps({"final": final, "base": base, "gain": 0.1}))
    (d / "config.toml").write_text(f'[loss]\npreset = "{arm}"\n')
    if collapse:
        (d / "collapse.jsonl").write_text(json.dumps({"step": 30, "signal": "collapse",
                                                      "active": True}) + "\n")


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
    for fig in ("curves.png", "groups.png", "passk_cost.png"):
        p = tmp_path / "figures" / fig
        assert p.exists() and p.stat().st_size > 10_000
    assert html.count("data:image/png;base64,") == 3
    run = next(r for r in load_runs(tmp_path) if r.name == "mixed/grpo")
    assert run.config == {"loss": {"preset": "grpo"}}
    assert run.eval["pass@4"] == 0.6 and run.evals[0]["pass@4"] == 0.5
    verdicts = {f.title[:2]: f.verdict for f in judge(load_runs(tmp_path))}
    assert verdicts == {"1.": "reproduced", "2.": "reproduced", "3.": "reproduced",
                        "4.": "reproduced"}


def test_findings_honest_when_nothing_collapses(tmp_path):
    for arm in ("grpo", "sc+mis+top-p"):
        for fleet in ("mixed", "homogeneous"):
            _write_run(tmp_path / fleet / arm, arm, fleet, collapse=False, seed=1)
    verdicts = {f.title[:2]: f.verdict for f in judge(load_runs(tmp_path))}
    assert verdicts["1."] == "not reproduced"
    assert verdicts["2."] == "inconclusive"
