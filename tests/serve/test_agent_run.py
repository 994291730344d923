"""The example agent (examples/openai_agent) trains through ``mixrl train``, exactly on-policy at FP32.

A sync run whose only sampler group is FP32 (the trainer's numerics): the agent's
episodes go agent -> openai client -> HTTP -> in-run endpoint -> fleet -> record ->
trainer, and every update must see every ratio within 1e-5 of 1 and k3 < 1e-8.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
from serve_helpers import train_and_keep

torch.set_num_threads(1)
pytest.importorskip("openai")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_agent"
STEPS = 2


def test_example_agent_trains_on_policy_at_fp32(tiny: Path, tmp_path: Path) -> None:
    from mixrl.config import build_config, resolve_paths

    raw = tomllib.loads((EXAMPLE / "config.toml").read_text())
    raw["model"] = {"path": str(tiny)}
    raw["rollout"].update(group_size=2, prompts_per_step=2, max_new_tokens=12, max_total_tokens=320)
    raw["fleet"] = {"groups": [{"name": "fp32", "profile": "fp32", "replicas": 1, "min_replicas": 1,
                                "max_replicas": 1}]}
    raw["loss"] = {"preset": "sc+mis", "overrides": {"entropy_coef": 0.05}}
    raw["optim"] = {"lr": 3e-2}
    raw["runtime"] = {"mode": "sync", "steps": STEPS, "seed": 0, "eval": {"enabled": False}}
    raw["observe"] = {"run_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False}
    cfg = build_config(raw)
    resolve_paths(cfg, EXAMPLE)
    summary, seen = train_and_keep(cfg)
    history = summary["history"]
    assert len(history) == STEPS
    assert seen and all(t.task == "openai_agent:" + str(EXAMPLE / "agent.py") + ":run" or t.task for t in seen)
    statuses = {t.status for t in seen}
    assert statuses <= {"ok", "truncated", "agent_failed"}, statuses
    trained = [t for t in seen if t.status != "agent_failed"]
    assert trained and all(sum(t.loss_mask) > 0 for t in trained)
    worst = 0.0
    for m in history:
        assert m["lag/tokens"] == 0 and m["precision/tokens"] > 0
        assert m["precision/kl_k3"] < 1e-8
        assert m["mismatch/log_ratio_max"] < 1e-5  # every ratio within 1e-5 of 1
        worst = max(worst, m["mismatch/log_ratio_max"])
    print(f"agent identity: max |log ratio| {worst:.2e} over {STEPS} updates, "
          f"{sum(sum(t.loss_mask) for t in trained)} generated tokens")
