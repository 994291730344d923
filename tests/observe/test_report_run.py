"""The report of one run: explained columns, the k the run evaluated, base vs final, sample episodes."""

import json
from argparse import Namespace

from mixrl.lab.study import report


def test_single_run_report(tmp_path):
    d = tmp_path / "word_problems"
    d.mkdir()
    rows = [{"step": s, "time": float(s), "rollout/reward": 0.1 * s, "mismatch/kl_k3": 1e-3,
             "cost/cumulative": 0.01 * s} for s in range(1, 21)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "eval.json").write_text(json.dumps({"k": 1, "base": {"pass@1": 0.21, "n_tasks": 50, "mean_reward": 0.2},
                                             "final": {"pass@1": 0.47, "n_tasks": 50, "mean_reward": 0.5}}))
    ep = {"step": 20, "prompt_id": "data/train/e0/3", "prompt": "<|user|>Ava has 3 pens. What is 3+4?<|end|>",
          "completion": "<calc>3+4</calc><|end|><|tool|>7<|end|><answer>7</answer>", "reward": 1.0,
          "status": "ok", "turns": 2, "group": "fp32"}
    (d / "episodes.jsonl").write_text(json.dumps(ep) + "\n")
    assert report.main(Namespace(dir=d, k=None, png=False)) == 0
    md, html = (d / "report.md").read_text(), (d / "report.html").read_text()
    header = md.split("## Runs")[1].strip().splitlines()[0]
    assert header.count("pass@1") == 1, header  # k = 1: one pass@1 column
    assert "pass@4" not in md  # the run evaluated k=1: no empty pass@4 column or plot
    for col in report.COLUMNS:
        assert col == "pass@4" or f"- **{col}**:" in md  # each column explained
    assert "base vs final (pass@1)" in md and "0.210" in md and "0.470" in md
    assert "Ava has 3 pens" in md and "<calc>3+4</calc>" in md and "Ava has 3 pens" in html
    assert "one run: word_problems" in html
