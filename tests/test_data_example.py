"""The README's "Train on your data" example, as a user runs it, with a tiny budget.

``examples/word_problems``: generated JSONL data, a 10-line exact-match reward,
a config; ``mixrl train`` on the bundled policy, then ``mixrl eval`` of the
result on the example's held-out rows. The budget is CI-sized (3 updates of
4 prompts x 4 samples, 8 held-out rows); the gain itself is measured with the
config's own budget (the README's numbers), not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "word_problems"


def test_generated_files_are_what_the_script_writes(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_data", EXAMPLE / "make_data.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [mod.story(__import__("random").Random(i)) for i in range(50)]
    assert all(str(eval(r["expr"])) == r["answer"] for r in rows)  # noqa: S307 - digits and +-* only
    train = [json.loads(x) for x in (EXAMPLE / "data" / "train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (EXAMPLE / "data" / "test.jsonl").read_text().splitlines()]
    assert len(train) == 2000 and len(test) == 200
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert len((EXAMPLE / "reward.py").read_text().splitlines()) <= 12


def test_the_example_trains_and_evaluates(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = tmp_path / "run"
    tiny = ["--set", "runtime.steps=3", "--set", "rollout.prompts_per_step=4", "--set", "rollout.group_size=4",
            "--set", "runtime.eval.n_tasks=8", "--set", "runtime.eval.n=2", "--set", f'observe.run_dir="{run}"',
            "--set", "observe.progress=false", "--set", "fleet.groups.0.replicas=1"]
    p = subprocess.run([sys.executable, "-m", "mixrl.cli", "train", str(EXAMPLE / "config.toml"), *tiny, "--json"],
                       capture_output=True, text=True, env=env, timeout=1800)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["steps"] == 3 and out["eval"]["metric"] == "pass@1"
    assert 0.0 <= out["eval"]["base"] <= 1.0 and 0.0 <= out["eval"]["final"] <= 1.0
    assert out["next"][0] == f"mixrl report {run}"
    ev = subprocess.run([sys.executable, "-m", "mixrl.cli", "eval", str(run / "policy"), "--k", "1", "--n", "2",
                         "--tasks", "8", "--json"], capture_output=True, text=True, env=env, timeout=1800)
    assert ev.returncode == 0, ev.stderr[-2000:]
    res = json.loads(ev.stdout)
    assert res["task"] == "dataset" and res["n_tasks"] == 8 and res["config"] == str(run / "config.toml")
