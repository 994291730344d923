"""``mixrl bench sampler --device cuda``: the built-in engine against HF ``generate`` on an accelerator.

The CPU bench (``sampler``) reports tokens per wall and per CPU second against the machine's
GEMM floor; on an accelerator the CPU second and that floor mean nothing, so this one
reports, side by side on the same model, prompts and device, after one warm-up and the best
of ``repeats`` interleaved runs: generated tokens per wall second of the built-in engine in
FP32 and in each of ``profiles`` (real FP8 ``h100-fp8-scaled``, BF16 ``h100-bf16``), of HF
``generate`` in FP32, and each side's peak device memory (``torch.cuda.max_memory_allocated``,
reset before each side; 0 off CUDA). Every run ends with the token ids on the host, so the
wall clock includes the device's work.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import Any

PROFILES = ("fp32", "h100-bf16", "h100-fp8-scaled")


def device_problem(device: str) -> str | None:
    """None when ``device`` can run the bench here, else one line saying why not."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        return f"--device {device!r}: not a torch device (cpu, cuda, cuda:N)"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"--device {device!r}: this machine shows no CUDA device"
    return None


def _peak_reset(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mb(device: Any) -> float:
    import torch

    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else 0.0


def run_device(args: Any, resolve_model: Callable[[str, str, int], tuple[str, str]],
               profiles: tuple[str, ...] = PROFILES) -> dict[str, Any]:
    """``resolve_model``: (model spec, work dir, seed) -> (HF directory, description), the CPU bench's."""
    import torch
    from transformers import AutoModelForCausalLM

    from mixrl.records.generation import GenerationRequest, SamplingParams
    from mixrl.sampling.builtin.engine import BuiltinEngine
    from mixrl.sampling.profiles import get_profile

    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        path, desc = resolve_model(args.model, tmp, args.seed)
        engines = {p: BuiltinEngine(path, get_profile(p), "bench", stop_on_eos=False, device=str(device))
                   for p in profiles}
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
        g = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(0, engines[profiles[0]].vocab, (args.batch, args.prompt_len), generator=g).tolist()
        new = args.new_tokens
        params = SamplingParams(temperature=1.0, max_new_tokens=new, record="none")

        def builtin(e: BuiltinEngine) -> int:
            return sum(len(r.token_ids) for r in e.generate_batch([GenerationRequest(x, params) for x in prompts]))

        runs: dict[str, Callable[[], int]] = {f"builtin_{p}": (lambda e=e: builtin(e)) for p, e in engines.items()}
        runs["hf"] = lambda: _hf_device(hf, prompts, new, device)
        best = dict.fromkeys(runs, 0.0)
        peak = dict.fromkeys(runs, 0.0)
        for fn in runs.values():  # warm-up (kernels, allocator)
            fn()
        for _ in range(args.repeats):
            for name, fn in runs.items():
                _peak_reset(device)
                t0 = time.perf_counter()
                n = fn()
                best[name] = max(best[name], n / (time.perf_counter() - t0))
                peak[name] = max(peak[name], _peak_mb(device))
    out: dict[str, Any] = {"model": desc, "device": str(device), "batch": args.batch, "prompt_len": args.prompt_len,
                           "new_tokens": new, "repeats": args.repeats,
                           "hf_setup": "generate, FP32, dynamic cache, on the same device"}
    for name in runs:
        out[f"{name}_tok_s"] = round(best[name], 1)
        out[f"{name}_peak_mb"] = peak[name]
    for p in profiles:
        out[f"builtin_{p}_over_hf"] = round(best[f"builtin_{p}"] / best["hf"], 3)
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def _hf_device(model: Any, prompts: list[list[int]], new: int, device: Any) -> int:
    """HF ``generate`` as in ``sampler._hf_run``, with the prompts on ``device``."""
    import copy

    import torch

    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id, gc.pad_token_id = None, 0
    gc.do_sample, gc.temperature, gc.top_k, gc.top_p, gc.max_new_tokens = True, 1.0, 0, 1.0, new
    ids = torch.tensor(prompts, device=device)
    with torch.no_grad():  # (not inference mode: the test's stand-in device refuses it inside generate)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    return int(out[:, ids.shape[1]:].cpu().numel())
