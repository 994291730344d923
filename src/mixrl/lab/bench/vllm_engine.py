"""vLLM sampler figures: tokens/s, log-prob agreement with the trainer's FP32 forward, update time.

``bench_vllm(model_path, prompts, params)`` runs one batch of ``prompts``
(token-id lists) through a ``VLLMEngine`` in ``profile`` (default
``cpu-vllm-fp32`` from ``vllm/profiles.toml``) and returns

- ``vllm_tok_s``: generated tokens / wall seconds of the timed batch (after a
  short warm-up batch, so first-call set-up is not counted);
- ``vllm_logprob_max_abs_err_fp32``: max over generated tokens of
  ``|log q_vllm(y) - log q_hf(y)|``, where ``log q_hf`` is the HF FP32 forward
  over prompt + generated tokens, put through the same temperature / top-k /
  top-p (``sample.sampling_logprobs``) in float64 — the trainer's side of the
  off-policy ratio;
- ``vllm_weight_update_s``: one in-place ``load_weights`` of the same weights;
- ``vllm_startup_s``, ``vllm_tokens``, ``vllm_generate_s`` and ``vllm_generate_cpu_s``
  (CPU seconds the process spent in the timed batch: on a shared machine,
  ``vllm_tokens / vllm_generate_cpu_s`` is the steadier figure).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from mixrl.records.generation import GenerationRequest, GenerationResult, SamplingParams


def hf_logprobs(
    model: Any, prompts: list[list[int]], outs: list[GenerationResult], params: list[SamplingParams]
) -> list[list[float]]:
    """log q of every generated token under an HF model (its dtype), float64 after the logits."""
    import torch

    from mixrl.sampling.builtin.sample import sampling_logprobs

    res: list[list[float]] = []
    with torch.inference_mode():
        for ids, out, p in zip(prompts, outs, params, strict=True):
            n = len(out.token_ids)
            if n == 0:
                res.append([])
                continue
            x = torch.tensor([list(ids) + list(out.token_ids)])
            logits = model(x).logits[0, len(ids) - 1 : len(ids) - 1 + n].double()  # [n, V]
            t = torch.full((n,), p.temperature, dtype=torch.float64)
            logq, _ = sampling_logprobs(
                logits, t, torch.full((n,), p.top_k), torch.full((n,), p.top_p, dtype=torch.float64)
            )
            res.append(logq.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1).tolist())
    return res


def abs_errs(outs: list[GenerationResult], ref: list[list[float]]) -> list[float]:
    """|log q_engine - log q_ref| of every generated token, request by request."""
    pairs = [zip(o.logprobs, r, strict=True) for o, r in zip(outs, ref, strict=True)]
    return [abs(a - b) for pr in pairs for a, b in pr]


def max_abs_err(outs: list[GenerationResult], ref: list[list[float]]) -> float:
    errs = abs_errs(outs, ref)
    return max(errs) if errs else float("nan")


def bench_vllm(
    model_path: str,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    profile: Any = "cpu-vllm-fp32",
    num_threads: int | None = None,
    seed: int = 0,
    stop_on_eos: bool = False,
) -> dict[str, float]:
    """See the module doc. ``profile``: a Profile or a name in the vLLM catalogue. EOS
    does not stop a row by default, so every row generates ``max_new_tokens`` as the
    built-in and HF sides of ``mixrl bench sampler`` do."""
    import torch
    from transformers import AutoModelForCausalLM

    from mixrl.sampling.profiles import load_profiles
    from mixrl.sampling.vllm.engine import VLLMEngine, vllm_profiles_path

    if not prompts:
        raise ValueError("bench_vllm: prompts is empty")
    if isinstance(profile, str):
        profile = load_profiles(vllm_profiles_path())[profile]
    t0 = time.perf_counter()
    eng = VLLMEngine(
        model_path, profile, "bench", seed=seed, max_batch=len(prompts),
        num_threads=num_threads, stop_on_eos=stop_on_eos,
    )  # fmt: skip
    startup = time.perf_counter() - t0
    try:
        warm = replace(params, max_new_tokens=min(4, params.max_new_tokens))
        eng.generate_batch([GenerationRequest(list(p), warm) for p in prompts[:2]])
        reqs = [
            GenerationRequest(list(p), params, request_id=f"bench-{i}")
            for i, p in enumerate(prompts)
        ]
        t0, c0 = time.perf_counter(), time.process_time()
        outs = eng.generate_batch(reqs)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        bad = [o.error for o in outs if o.finish_reason not in ("stop", "length")]
        if bad:
            raise RuntimeError(f"bench_vllm: {len(bad)} requests failed, first: {bad[0]}")
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        errs = abs_errs(outs, hf_logprobs(hf, prompts, outs, [params] * len(prompts)))
        eng.load_weights(hf.state_dict(), 1)
        ntok = sum(len(o.token_ids) for o in outs)
        return {
            "vllm_tok_s": ntok / dt,
            "vllm_logprob_max_abs_err_fp32": max(errs),
            "vllm_logprob_mean_abs_err_fp32": sum(errs) / len(errs),
            "vllm_weight_update_s": eng.last_update_s,
            "vllm_startup_s": startup,
            "vllm_tokens": float(ntok),
            "vllm_generate_s": dt,
            "vllm_generate_cpu_s": cpu,  # CPU seconds of this process: robust to a busy machine
        }
    finally:
        eng.close()


def profile_spec(spec: str) -> Any:
    """``NAME`` or ``NAME+field=value+...`` from the vLLM catalogue. A weight format that
    numerics does not list yet (``int8``) is accepted here without validation, since only
    the vLLM engine reads it."""
    from mixrl.sampling.profiles import Profile, load_profiles, with_overrides
    from mixrl.sampling.vllm.engine import vllm_profiles_path
    from mixrl.sampling.vllm.formats import INT8_NAMES

    name, *kvs = spec.split("+")
    prof = load_profiles(vllm_profiles_path())[name]
    changes = dict(kv.split("=", 1) for kv in kvs)
    int8 = (
        changes.pop("weight_format", None) if changes.get("weight_format") in INT8_NAMES else None
    )
    prof = with_overrides(prof, **changes) if changes else prof
    if int8:
        prof = Profile.model_construct(**{**prof.model_dump(), "weight_format": int8})
    return prof


def main(argv: list[str] | None = None) -> int:
    """``python -m mixrl.lab.bench.vllm_engine --model bundled --profiles cpu-vllm-fp32,cpu-vllm-bf16``"""
    import argparse
    import json

    import torch

    ap = argparse.ArgumentParser(description="vLLM sampler figures on one model (see module doc)")
    ap.add_argument("--model", default="bundled", help="HF directory or 'bundled'")
    ap.add_argument(
        "--profiles",
        default="cpu-vllm-fp32",
        help="comma-separated vLLM profiles, each NAME or NAME+field=value (e.g. cpu-vllm-bf16+weight_format=int8)",
    )
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from mixrl.models.policy import resolve

    path = str(resolve(a.model))
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(a.seed)
    prompts = torch.randint(0, vocab, (a.batch, a.prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens, record="none")
    for name in a.profiles.split(","):
        prof = profile_spec(name)
        res = bench_vllm(path, prompts, params, profile=prof, num_threads=a.threads, seed=a.seed)
        print(json.dumps({"profile": name, **{k: round(v, 9) for k, v in res.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def bench_fields(model_path: str, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """The ``mixrl bench sampler`` hook: ``bench_vllm`` at temperature 1, whole vocabulary."""
    return bench_vllm(model_path, prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, record="none"))
