"""``mixrl probe``: how far each precision profile's sampler is from the trainer.

For every profile, the built-in engine generates from the same prompts with the
same per-request seeds (common random numbers: profiles differ only through
their numerics), recording log q of the sampled token and of its whole support.
The trainer's full forward (FP32, or BF16 with ``--trainer-dtype bf16``) then
scores exactly those tokens, and the docs/corrections.md §10 metrics are computed
with ``mixrl.corrections.metrics.mismatch_metrics``:

    mismatch/kl_k1, mismatch/kl_k3, mismatch/kl_exact, mismatch/tv, mismatch/ratio_oob

plus ``max_abs_log_ratio`` (max_t |log p̃(y_t) − log q(y_t)|) and ``tokens``.
The trainer's distribution is the support-replayed p̃ (§3): log-softmax of
logits/T renormalised on the recorded support (the whole vocabulary at
temperature sampling without top-p/top-k, where p̃ = p).

    mixrl probe                                       # bundled policy, every profile this machine runs
    mixrl probe --profiles fp32,h100-bf16,h100-fp8,b200-nvfp4 --json
    mixrl probe --model DIR --prompts prompts.jsonl   # JSON lists of token ids

With no ``--profiles`` every profile this machine can run is probed and the
others are listed as skipped with the reason (vLLM missing, or a format the
platform cannot run, e.g. FP8 on a CPU without AVX-512); exit status 0. A
profile named in ``--profiles`` that cannot run is an error: the reason, exit 2.

k1 is noisy at a few thousand tokens and can be negative; read k3 or kl_exact.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from mixrl.corrections.metrics import mismatch_metrics
from mixrl.corrections.types import LossInputs
from mixrl.models.policy import resolve
from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.sampling import factory
from mixrl.sampling.builtin.engine import request_seed
from mixrl.sampling.profiles import get_profile, load_profiles, with_overrides
from mixrl.system.jsonout import json_text

METRICS = (
    "mismatch/kl_k1",
    "mismatch/kl_k3",
    "mismatch/kl_exact",
    "mismatch/tv",
    "mismatch/ratio_oob",
)


def configure(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default="bundled", help="HF model directory, or 'bundled' (default)")
    a("--profiles", default="", help="comma-separated profile names (default: all this machine runs)")
    a("--profiles-file", default=None, help="TOML merged over the profile catalogue")
    a("--prompts", default="tasks", help="'tasks' (bundled held-out tasks), 'random', or a "
      "file: a JSON list of token-id lists, or JSON lines of lists")  # fmt: skip
    a("--task", default="mix", help="task family for --prompts tasks (default: mix)")
    a("--num-prompts", type=int, default=64, help="prompts to use (default 64)")
    a("--max-new-tokens", type=int, default=48, help="tokens generated per prompt (default 48)")
    a("--temperature", type=float, default=1.0, help="sampling temperature (default 1)")
    a("--trainer-dtype", choices=("fp32", "bf16"), default="fp32", help="trainer forward dtype")
    a("--compute-dtype", choices=("profile", "float32", "bfloat16"), default="profile",
      help="override every profile's compute dtype (e.g. float32 for fast CPU runs)")  # fmt: skip
    a("--override", action="append", default=[], metavar="FIELD=VALUE",
      help="set a Profile field on every probed profile, e.g. quantize_lm_head=true, "
      "activation_format=fp8_e4m3 (repeatable)")  # fmt: skip
    a("--seed", type=int, default=0, help="seed of prompts and sampling")
    a("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    a("--device", default="cpu", help="where built-in engine profiles compute: cpu (default), cuda, cuda:N "
      "(the FP32 trainer reference stays on the CPU; vLLM picks its own device)")  # fmt: skip
    a("--json", action="store_true", help="print one JSON object {'profiles': {NAME: {...}}}")


def _positive(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0, got {args.temperature}")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["quantize_lm_head=true", "compute_dtype=float32"]`` -> typed dict (bool, number, str)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--override {item!r}: expected FIELD=VALUE")
        val: Any = raw.strip()
        if val.lower() in ("true", "false"):
            val = val.lower() == "true"
        else:
            with contextlib.suppress(ValueError):
                val = float(val)
        out[key.strip()] = val
    return out


def skip_reason(profile: Any, model_path: str | Path) -> str | None:
    """Why this machine cannot run ``profile`` (None when it can).

    The built-in engine emulates every format, so only vLLM profiles are refused:
    vLLM missing, or a format the platform check (``vllm.formats``) refuses, e.g.
    FP8 weights or an FP8 KV cache on a CPU without AVX-512."""
    if getattr(profile, "engine", "builtin") != "vllm":
        return None
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return f"profile {profile.name!r} (engine='vllm'): vLLM is not installed (scripts/install_vllm.sh)"
    from mixrl.sampling.vllm.formats import UnsupportedFormatError, detect_platform, vllm_options
    from mixrl.sampling.vllm.weights import model_shape

    try:
        vllm_options(profile, detect_platform(), head_dim=model_shape(str(model_path))["head_dim"])
    except UnsupportedFormatError as e:
        return str(e)
    return None


def select_profiles(args: argparse.Namespace) -> list[Any]:
    """Profiles named by ``--profiles`` (all when empty), with the overrides applied."""

    extra, names = args.profiles_file, args.profiles
    if names.strip():
        chosen = [get_profile(n.strip(), extra) for n in names.split(",") if n.strip()]
    else:
        chosen = list(load_profiles(extra).values())
    changes = parse_overrides(args.override)
    if args.compute_dtype != "profile":
        changes["compute_dtype"] = args.compute_dtype
    return [with_overrides(p, **changes) if changes else p for p in chosen]


def load_prompts(
    spec: str, model_path: Path, args: argparse.Namespace
) -> tuple[list[list[int]], tuple[int, ...]]:
    """(prompts, extra stop ids). See ``--prompts``."""
    import torch

    n = args.num_prompts
    if spec == "tasks":
        import asyncio

        from transformers import AutoTokenizer

        from mixrl.envs.registry import make_env, make_task_source
        from mixrl.models.chat import ChatFormat

        chat = ChatFormat(AutoTokenizer.from_pretrained(str(model_path)))
        src = make_task_source(args.task, "heldout", seed=args.seed)
        prompts = [asyncio.run(make_env(src[i % len(src)], chat).reset()) for i in range(n)]
        return prompts, (chat.end_of_turn_id,)
    if spec == "random":
        from transformers import AutoConfig

        vocab = int(AutoConfig.from_pretrained(str(model_path)).vocab_size)
        g = torch.Generator().manual_seed(args.seed)
        return [torch.randint(0, vocab, (8,), generator=g).tolist() for _ in range(n)], ()
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--prompts {spec!r} is neither 'tasks', 'random' nor an existing file")
    text = path.read_text()
    try:
        rows = json.loads(text) if text.lstrip().startswith("[[") else [
            json.loads(line) for line in text.splitlines() if line.strip()
        ]  # fmt: skip
    except json.JSONDecodeError as e:
        raise ValueError(f"--prompts {spec}: not JSON token-id lists ({e})") from e
    for i, r in enumerate(rows):
        if not (isinstance(r, list) and r and all(isinstance(t, int) and t >= 0 for t in r)):
            raise ValueError(
                f"--prompts {spec}: entry {i} is not a non-empty list of ids >= 0: {r!r}"
            )
    return rows[:n], ()


def _trainer_log_softmax(
    model: Any, seqs: list[list[int]], starts: list[int], temperature: float, batch: int
) -> list[Any]:
    """log softmax(z/T) rows predicting ``seq[start:]`` for each sequence: [len - start, V] fp32.

    Sequences are right-padded in batches: causal attention keeps every real
    position blind to the padding after it, so padding changes no score."""
    import torch

    dev = next(model.parameters()).device
    rows: list[Any] = []
    for b in range(0, len(seqs), batch):
        chunk = seqs[b : b + batch]
        width = max(len(x) for x in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)  # [B, W], 0 = any in-vocab id
        att = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, x in enumerate(chunk):
            ids[j, : len(x)], att[j, : len(x)] = torch.tensor(x), 1
        with torch.inference_mode():
            logits = model(input_ids=ids.to(dev), attention_mask=att.to(dev)).logits  # [B, W, V]
        for j, x in enumerate(chunk):
            z = logits[j, starts[b + j] - 1 : len(x) - 1].float().cpu()  # [G, V]
            rows.append(torch.log_softmax(z / temperature, dim=-1))
    return rows


def score_support(
    model: Any, prompts: list[list[int]], results: list[Any], temperature: float, batch: int = 32
) -> dict[str, Any]:
    """Trainer log p̃ of each sampled token and of each recorded candidate, float64.

    Returns flat tensors over the N generated tokens / K candidates:
    ``logp`` [N], ``logq`` [N], ``cand_logp`` [K], ``cand_logq`` [K], ``offsets`` [N+1],
    ``seq_ids`` [N].
    """
    import torch

    keep = [i for i, r in enumerate(results) if r.token_ids]
    seqs = [prompts[i] + results[i].token_ids for i in keep]
    lsms = _trainer_log_softmax(model, seqs, [len(prompts[i]) for i in keep], temperature, batch)
    logp, logq, clp, clq, offs, seq = [], [], [], [], [torch.zeros(1, dtype=torch.long)], []
    base = 0
    for i, lsm in zip(keep, lsms, strict=True):
        res, g = results[i], len(results[i].token_ids)
        lsm = lsm.double()  # [G, V]
        o = torch.tensor(res.cand_offsets, dtype=torch.long)  # [G+1]
        cid = torch.tensor(res.cand_ids, dtype=torch.long)  # [K_i]
        pos = torch.repeat_interleave(torch.arange(g), o[1:] - o[:-1])  # [K_i]
        c = lsm[pos, cid]  # [K_i] log p(v), v in S_t
        log_z = (
            torch.zeros(g, dtype=torch.float64).index_add(0, pos, c.exp()).log()
        )  # [G] log p(S_t)
        tok = torch.tensor(res.token_ids, dtype=torch.long)
        logp.append(lsm[torch.arange(g), tok] - log_z)  # log p̃(y_t)
        clp.append(c - log_z[pos])
        logq.append(torch.tensor(res.logprobs, dtype=torch.float64))
        clq.append(torch.tensor(res.cand_logprobs, dtype=torch.float64))
        offs.append(o[1:] + base)
        base += int(o[-1])
        seq.append(torch.full((g,), i, dtype=torch.long))
    cat = lambda xs, dt: torch.cat(xs) if xs else torch.zeros(0, dtype=dt)  # noqa: E731
    return {
        "logp": cat(logp, torch.float64), "logq": cat(logq, torch.float64),
        "cand_logp": cat(clp, torch.float64), "cand_logq": cat(clq, torch.float64),
        "offsets": torch.cat(offs), "seq_ids": cat(seq, torch.long), "num_seqs": len(prompts),
    }  # fmt: skip


def metrics_of(scored: dict[str, Any]) -> dict[str, float]:
    """§10 mismatch metrics of one profile, plus max |log ratio| and the token count."""
    import torch


    n = int(scored["logp"].shape[0])
    inputs = LossInputs(
        trainer_logprobs=scored["logp"], old_logprobs=scored["logp"],
        sampler_logprobs=scored["logq"], advantages=torch.zeros(n, dtype=torch.float64),
        loss_mask=torch.ones(n, dtype=torch.bool), seq_ids=scored["seq_ids"],
        num_seqs=scored["num_seqs"], cand_kind="support", cand_offsets=scored["offsets"],
        cand_trainer_logprobs=scored["cand_logp"], cand_old_logprobs=scored["cand_logp"],
        cand_sampler_logprobs=scored["cand_logq"],
    )  # fmt: skip
    out = {k: float(v) for k, v in mismatch_metrics(inputs).items() if k in METRICS}
    diff = (scored["logp"] - scored["logq"]).abs()
    out["max_abs_log_ratio"] = float(diff[torch.isfinite(diff)].max()) if n else 0.0
    out["tokens"] = n
    return out


def probe(args: argparse.Namespace, skipped: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Rows per profile. With no ``--profiles``, profiles this machine cannot run go to
    ``skipped`` (name -> reason); a profile named explicitly that cannot run raises."""
    import torch
    from transformers import AutoModelForCausalLM


    _positive(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    profiles = select_profiles(args)
    path = resolve(args.model)
    explicit = bool(args.profiles.strip())
    runnable = []
    for prof in profiles:
        why = skip_reason(prof, path)
        if why is None:
            runnable.append(prof)
        elif explicit:
            raise ValueError(why)
        elif skipped is not None:
            skipped[prof.name] = why
    profiles = runnable
    prompts, stops = load_prompts(args.prompts, path, args)
    dtype = torch.float32 if args.trainer_dtype == "fp32" else torch.bfloat16
    trainer = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    out: dict[str, dict[str, Any]] = {}
    for prof in profiles:
        device = getattr(args, "device", "cpu")
        on = {"device": device} if prof.engine == "builtin" and device != "cpu" else {}
        engine = factory.make_engine(str(path), prof, group=prof.name, seed=args.seed, **on)
        try:
            out[prof.name] = _probe_one(engine, prof, trainer, prompts, stops, args)
        finally:  # a vLLM engine holds its GPU memory until closed: the next profile needs it
            close = getattr(engine, "close", None)
            if close is not None:
                close()
    return out


def _probe_one(engine: Any, prof: Any, trainer: Any, prompts: Any, stops: Any,
               args: argparse.Namespace) -> dict[str, Any]:
    """One profile's row: generate with ``engine``, score against ``trainer``."""

    reqs = [
        GenerationRequest(p, SamplingParams(
            temperature=args.temperature, max_new_tokens=args.max_new_tokens, stop_ids=stops,
            record="support", seed=request_seed(args.seed, i)), request_id=str(i))
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    t0 = time.perf_counter()
    results = engine.generate_batch(reqs)
    gen_s = time.perf_counter() - t0
    failed = [r for r in results if r.finish_reason == "error"]
    if failed:
        raise RuntimeError(
            f"profile {prof.name}: {len(failed)} requests failed: {failed[0].error}"
        )
    row = metrics_of(score_support(trainer, prompts, results, args.temperature))
    row.update(
        weight_format=prof.weight_format, kv_format=prof.kv_format,
        compute_dtype=prof.compute_dtype, activation_format=prof.activation_format,
        quantize_lm_head=prof.quantize_lm_head, numerical_errors=sum(
            r.finish_reason == "numerical_error" for r in results),
        generate_seconds=round(gen_s, 3),
    )  # fmt: skip
    print(f"probe: {prof.name} done ({row['tokens']} tokens, {gen_s:.1f}s)", file=sys.stderr)
    return row


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

    t = Table(title="sampler-trainer mismatch (trainer scores the sampled tokens)")
    for col in ("profile", "weights", "kv", "compute", "tokens", "kl_k1", "kl_k3", "kl_exact",
                "tv", "ratio_oob", "max|log ρ|"):  # fmt: skip
        t.add_column(
            col, justify="left" if col in ("profile", "weights", "kv", "compute") else "right"
        )
    for name, r in rows.items():
        t.add_row(
            name, r["weight_format"], r["kv_format"], short[r["compute_dtype"]], str(r["tokens"]),
            *(f"{r[m]:.2e}" for m in METRICS[:4]), f"{r['mismatch/ratio_oob']:.4f}",
            f"{r['max_abs_log_ratio']:.3f}",
        )  # fmt: skip
    Console(width=max(Console().width, 130)).print(t)


def _quiet_libraries() -> None:
    """Mute per-load progress bars and torchao's CUDA-extension warnings on CPU hosts."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):  # before transformers imports torchao
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def main(args: argparse.Namespace) -> int:
    try:
        # progress and any build logs go to stderr: with --json, stdout is one JSON object
        with contextlib.redirect_stdout(sys.stderr):
            _quiet_libraries()
            skipped: dict[str, str] = {}
            rows = probe(args, skipped)
    except (ValueError, FileNotFoundError) as e:
        print(f"mixrl probe: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json_text({"profiles": rows, "skipped": skipped}))
    else:
        print_table(rows)
        for name, why in skipped.items():
            print(f"skipped {name}: {why}")
    return 0
