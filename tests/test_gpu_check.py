"""The GPU check's CPU-runnable parts, and its contract: one JSON object, exit 1 on any failure.

``scripts/gpu_check.sh`` runs ``mixrl.lab.gpu.check`` on CUDA; here the same
module runs with ``--device cpu``: the trainer steps against float64, the
embedded rank process, and (where vLLM runs FP8 on this CPU) the reload check.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch

from mixrl.lab.gpu import check as gpu_check

ROOT = Path(__file__).resolve().parents[1]


def test_trainer_and_rank_checks_pass_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = gpu_check.main(["--device", "cpu", "--only", "trainer,ranks", "--out", str(tmp_path)])
    res = json.loads(capsys.readouterr().out)  # exactly one JSON object on stdout
    assert rc == 0 and res["ok"], res
    assert set(res["checks"]) == {"trainer_step_fp32", "trainer_step_bf16", "trainer_step_fp16", "trainer_ranks"}
    for p in ("fp32", "bf16", "fp16"):
        row = res["checks"][f"trainer_step_{p}"]
        assert row["loss_rel_err"] <= gpu_check.TOLERANCE[p] and row["param_devices"] == ["cpu"]
    assert res["checks"]["trainer_ranks"]["where"][0]["optimizer_devices"] == ["cpu"]


def test_a_step_outside_its_tolerance_fails_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison can fail: a bf16 step judged by the fp32 bound."""
    monkeypatch.setitem(gpu_check.TOLERANCE, "bf16", gpu_check.TOLERANCE["fp32"])
    row = gpu_check.check_trainer_step("bundled", "cpu", "bf16", tmp_path)
    assert not row["ok"] and row["loss_rel_err"] > gpu_check.TOLERANCE["fp32"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable GPU")
def test_the_script_prints_one_json_object_and_fails_without_a_gpu(tmp_path: Path) -> None:
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--only", "trainer"],
                       capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin",
                       "PYTHON": str(Path(__import__("sys").executable)), "HOME": str(tmp_path)})
    assert p.returncode == 1, p.stderr
    res = json.loads(p.stdout)
    assert res["ok"] is False and "no NVIDIA GPU is visible" in res["error"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_fp8_reload_check_on_cpu(tmp_path: Path) -> None:
    from mixrl.lab.gpu.vllm import check_reload

    try:
        row = check_reload("bundled", "cpu", tmp_path)
    except gpu_check.Skip as e:  # FP8 on a CPU with AVX2 only
        pytest.skip(str(e))
    # the perturbed weights change what is sampled, or the log q of the same tokens
    assert row["perturbation_shown"], row
    assert row["reloaded_vs_baseline_match"] == 1.0 and row["reloaded_vs_baseline_max_abs_logq"] == 0.0
    # weights reloaded in place serve exactly what a fresh engine built from them serves (before
    # the tied head was refreshed after a reload: 7 of 8 requests' tokens, log q 0.04 apart)
    assert row["perturbed_vs_fresh_match"] == 1.0 and row["perturbed_vs_fresh_max_abs_logq"] <= 1e-3, row
    assert row["ok"], row


def test_a_package_this_machine_lacks_is_a_skip_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    rc = gpu_check.main(["--device", "cpu", "--only", "ray", "--out", str(tmp_path)])
    res = json.loads(capsys.readouterr().out)
    assert rc == 1 and res["ok"] is False and res["checks"] == {}  # nothing ran: not a pass
    assert res["skipped"] == {"trainer_ray": "ray not installed on this machine"}


def test_train_check_trains_checkpoints_and_resumes_on_cpu(tmp_path: Path) -> None:
    row = gpu_check.check_train("bundled", "cpu", tmp_path)
    assert row["ok"], row
    assert row["returncodes"] == [0, 0] and row["steps"] == [1, 2, 3, 4] and row["checkpoint_has_cuda_rng"] is False


def test_refresh_tied_redoes_only_layers_that_share_a_weight() -> None:
    """The layer-wise reload processes layers the checkpoint names; a tied head is redone after it."""
    from torch import nn

    from mixrl.sampling.vllm.weights import refresh_tied

    calls: list[nn.Module] = []

    class UnquantizedEmbeddingMethod:
        def process_weights_after_loading(self, layer: nn.Module) -> None:
            calls.append(layer)

    class Fp8LinearMethod(UnquantizedEmbeddingMethod):
        pass

    model = nn.Module()
    model.embed, model.mid, model.head = nn.Embedding(4, 3), nn.Linear(3, 3), nn.Linear(3, 4, bias=False)
    for m in (model.embed, model.mid, model.head):
        m.quant_method = UnquantizedEmbeddingMethod()
    model.head.weight = model.embed.weight  # tied
    assert refresh_tied(model) == ["head"] and calls == [model.head]
    model.head.quant_method = Fp8LinearMethod()
    with pytest.raises(RuntimeError, match="head shares its weight with embed under Fp8LinearMethod"):
        refresh_tied(model)
