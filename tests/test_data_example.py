"""The README's "Train on your data" example, as a user runs it, with a tiny budget.

``examples/arithmetic``: generated JSONL data, a 10-line exact-match reward,
a config; ``mixrl train`` on the bundled policy, then ``mixrl eval`` of the
result on the example's held-out rows. The budget is CI-sized (3 updates of
4 prompts x 4 samples, 8 held-out rows); the gain itself is measured with the
config's own budget (the README's table, from docs/artifacts/), not here.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "arithmetic"


def _load(path: Path, name: str):  # noqa: ANN202 - a module loaded from a file
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_data_is_what_the_script_writes(tmp_path: Path) -> None:
    _load(EXAMPLE / "make_data.py", "make_data").main(tmp_path)
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLE / "data" / name).read_bytes(), name
    train = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (tmp_path / "test.jsonl").read_text().splitlines()]
    assert len(train) == 4000 and len(test) == 1000
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    from mixrl.envs.calc import evaluate_expr

    for r in train[:200] + test[:200]:
        expr = r["prompt"].removeprefix("What is ").removeprefix("Compute ").rstrip("?.= ")
        assert str(int(evaluate_expr(expr))) == r["answer"] and r["skill"].count("b") == 1, r
    assert len((EXAMPLE / "reward.py").read_text().splitlines()) <= 12


def test_the_reward_file_scores_like_trl_would_call_it() -> None:
    fn = _load(EXAMPLE / "reward.py", "reward").exact_match
    got = fn(completions=["<calc>2+3</calc> ... <answer>5</answer>", "<answer>6</answer>", "5"],
             prompts=["What is 2+3?"] * 3, answer=["5", "5", "5"], skill=["a+b"] * 3)
    assert got == [1.0, 0.0, 0.0]


def test_wilson_interval_against_brute_force() -> None:
    """The README table's 95% interval: the p whose score test accepts the observed rate, on a fine grid."""
    wilson = _load(ROOT / "scripts" / "readme_tables.py", "readme_tables").wilson
    for p_hat, n in ((0.2, 1000), (0.5, 100), (0.03, 300), (1.0, 50)):
        grid = [i / 200_000 for i in range(200_001)]
        inside = [p for p in grid if abs(p_hat - p) <= 1.96 * math.sqrt(p * (1 - p) / n)]
        lo, hi = wilson(p_hat, n)
        assert abs(lo - min(inside)) < 1e-5 and abs(hi - max(inside)) < 1e-5, (p_hat, n, lo, hi)


def test_the_example_trains_and_evaluates(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = tmp_path / "run"
    tiny = ["--set", "runtime.steps=3", "--set", "rollout.prompts_per_step=4", "--set", "rollout.group_size=4",
            "--set", "runtime.eval.n_tasks=8", "--set", f'observe.run_dir="{run}"', "--set", "observe.progress=false"]
    p = subprocess.run([sys.executable, "-m", "mixrl.commands.main", "train", str(EXAMPLE / "config.toml"), *tiny, "--json"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["steps"] == 3 and out["eval"]["metric"] == "pass@1"
    assert 0.0 <= out["eval"]["base"] <= 1.0 and 0.0 <= out["eval"]["final"] <= 1.0
    assert out["next"][0] == f"mixrl report {run}"
    # The user's reward reached the trainer: the base policy solves about one question in five.
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and max(m["rollout/reward"] for m in metrics) > 0.0
    assert sum(m["rollout/status/reward_failed"] for m in metrics) == 0
    ev = subprocess.run([sys.executable, "-m", "mixrl.commands.main", "eval", str(run / "policy"), "--k", "1",
                         "--tasks", "8", "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert ev.returncode == 0, ev.stderr[-2000:]
    res = json.loads(ev.stdout)
    assert res["task"] == "dataset" and res["n_tasks"] == 8 and res["config"] == str(run / "config.toml")
    assert res["infra_failed"] == 0 and "reward_failed" not in res["status"], res["status"]
