"""The device check's steps (``scripts/gpu_check.sh``, ``mixrl.lab.gpu.steps``).

Here the CPU mode runs end to end (the same steps as on a GPU: the gpu-marked tests, two
built-in groups trained with a resume, the probe, the sampler bench); a step that fails for a
real reason stops the script. The tests marked ``gpu`` are the device's own: they skip on a CPU.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _script(tmp_path: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args, "--work", str(tmp_path / "w")],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_cpu_mode_runs_every_step_and_writes_one_json_object(tmp_path: Path) -> None:
    p = _script(tmp_path, "--cpu", "--model", "bundled", "--updates", "4", "--out", "steps.json")
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)  # the whole of stdout is one JSON object
    assert json.loads((tmp_path / "steps.json").read_text()) == res  # --out relative to the caller's folder
    assert res["ok"] is True and res["failed"] is None and res["mode"] == "cpu"
    assert res["command"] == "scripts/gpu_check.sh --cpu --model bundled --updates 4"
    assert list(res["steps"]) == ["setup", "tests", "train", "probe", "bench"]
    for name, row in res["steps"].items():
        assert row["status"] == "ok" and _number(row["seconds"]), name
        assert f"gpu_check: step {name} ok" in p.stderr

    t = res["steps"]["tests"]
    assert t["failed"] == 0 and t["collected"] == t["passed"] + t["skipped"] and t["passed"] >= 3
    if not CUDA:
        assert t["skipped"] >= 2  # this file's CUDA tests, collected and skipped

    tr = res["steps"]["train"]
    assert tr["steps"] == [1, 2, 3, 4] and tr["resumed_at"] == 2 and tr["trainer_precision"] == "bf16"
    assert tr["checkpoints"] == ["step_000002", "step_000004"]
    assert set(tr["groups"]) == {"fp8-scaled", "bf16"}
    assert tr["groups"]["fp8-scaled"]["profile"] == "h100-fp8-scaled"
    for g in tr["groups"].values():
        assert g["tokens"] > 0 and all(_number(g[k]) and g[k] >= 0 for k in ("kl_k3", "tv", "ratio_oob"))
    assert all(_number(tr[k]) for k in ("loss_last", "reward_mean", "reward_last"))
    assert all(_number(x) and x > 0 for x in tr["wall_s"] + tr["train_wall_s"])

    pr = res["steps"]["probe"]
    assert set(pr["profiles"]) == {"h100-fp8-scaled", "h100-fp8-w8a8", "h100-bf16"}
    for row in pr["profiles"].values():
        assert row["tokens"] > 0 and all(_number(row[k]) and row[k] >= 0 for k in ("kl_exact", "tv", "ratio_oob"))
    assert _number(pr["real_over_emulated"]) and pr["real_over_emulated"] > 0 and pr["builtin_device"] == "cpu"

    b = res["steps"]["bench"]
    assert b["device"] == "cpu" and _number(b["builtin_tok_s"]) and b["builtin_tok_s"] > 0
    assert _number(b["builtin_over_hf"]) and b["batch"] == 8


def test_a_failing_step_stops_the_script_and_names_itself(tmp_path: Path) -> None:
    """An unknown profile fails the probe (mixrl probe exits 2): the bench after it does not run."""
    p = _script(tmp_path, "--cpu", "--model", "bundled", "--steps", "probe,bench",
                "--profiles", "h100-fp8-scaled,no-such-profile", timeout=200)
    assert p.returncode == 1
    line = [x for x in p.stderr.splitlines() if x.startswith("gpu_check: step probe failed: ")]
    assert line and "unknown profile 'no-such-profile'" in line[0], p.stderr[-2000:]
    res = json.loads(p.stdout)
    assert res["ok"] is False and res["failed"] == "probe"
    assert res["steps"]["probe"]["status"] == "failed" and "no-such-profile" in res["steps"]["probe"]["reason"]
    assert res["steps"]["bench"] == {"status": "not_run"}
    assert "gpu_check: step bench" not in p.stderr


def test_a_model_that_is_not_there_fails_before_any_step(tmp_path: Path) -> None:
    p = _script(tmp_path, "--cpu", "--model", str(tmp_path / "no-model"), "--steps", "bench", timeout=120)
    assert p.returncode == 1
    res = json.loads(p.stdout)
    assert res["failed"] == "setup" and res["steps"]["bench"] == {"status": "not_run"}
    assert f"gpu_check: step setup failed: --model {tmp_path / 'no-model'}: " in p.stderr


@pytest.mark.skipif(CUDA, reason="this machine has a usable GPU")
def test_without_a_gpu_the_default_mode_fails_saying_so(tmp_path: Path) -> None:
    p = _script(tmp_path, "--steps", "bench", timeout=120)
    assert p.returncode == 1 and json.loads(p.stdout)["failed"] == "setup"
    assert "gpu_check: step setup failed: " in p.stderr and "--cpu runs the same steps" in p.stderr


@pytest.mark.gpu
@needs_cuda
def test_the_lower_level_gpu_assertions_pass(tmp_path: Path) -> None:
    """mixrl.lab.gpu.check on CUDA: trainer steps against float64, the rank process, FP8 GEMMs."""
    p = subprocess.run([sys.executable, "-m", "mixrl.lab.gpu.check", "--only", "trainer,ranks,fp8_gemm",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=240)
    res = json.loads(p.stdout)
    assert p.returncode == 0 and res["ok"], {k: v for k, v in res.get("checks", {}).items() if not v.get("ok")}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("profile", ["h100-fp8-scaled", "h100-bf16"])
def test_a_builtin_engine_samples_on_the_gpu_as_on_the_cpu(profile: str) -> None:
    """Same prompts, seeds and profile on cuda and on the CPU: the first tokens agree, log q finite."""
    from mixrl.models.policy import resolve
    from mixrl.records.generation import GenerationRequest, SamplingParams
    from mixrl.sampling.builtin.engine import BuiltinEngine
    from mixrl.sampling.profiles import get_profile

    if "device" not in inspect.signature(BuiltinEngine).parameters:
        pytest.skip("BuiltinEngine has no device parameter")
    reqs = [GenerationRequest([1 + i, 2, 3, 4], SamplingParams(max_new_tokens=8, seed=i), f"r{i}") for i in range(8)]
    path, prof = str(resolve("bundled")), get_profile(profile)
    gpu = BuiltinEngine(path, prof, "g", stop_on_eos=False, device="cuda").generate_batch(reqs)
    cpu = BuiltinEngine(path, prof, "g", stop_on_eos=False).generate_batch(reqs)
    assert all(len(r.token_ids) == 8 and all(math.isfinite(x) and x <= 1e-4 for x in r.logprobs) for r in gpu)
    assert sum(g.token_ids[0] == c.token_ids[0] for g, c in zip(gpu, cpu, strict=True)) >= 6
