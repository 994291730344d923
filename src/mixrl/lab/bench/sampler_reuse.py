"""``mixrl bench sampler --workload multiturn``: the built-in engine with KV reuse on vs off.

Two workloads, each run by two engines on the same weights that differ only in
``prefix_reuse`` (``sampling/builtin/prefix_cache``), in one invocation, the arms
alternating (off/on, then on/off, ...) for ``--repeats`` rounds after one warm-up each:

- ``multiturn``: ``--episodes`` calculator episodes (``envs.calc``) of exactly ``--turns``
  turns: each turn the model replies (at most ``--reply-tokens``, stopping at the chat's
  end of turn), the environment answers (the calculator's value, an error or a reminder);
  an episode the environment ends early gets the next question of the task stream as a user
  turn, so every episode has ``--turns`` turns. Each episode is a session: a turn joins the
  running batch as soon as the previous one finished (continuous batching, ``stream``), as
  a run's sessions do;
- ``group``: ``--groups`` prompts (calculator questions) x G = ``--group-size`` samples of
  one reply each (``--reply-tokens`` at most), all submitted at once (a GRPO step's first turns).

Every request has its own seed, so both arms draw the same uniforms: ``identical_tokens``
asserts that they generated the same tokens (and ``max_abs_logprob_diff`` how far their
log q differ, FP32 rounding). Per workload: ``samples_per_s`` of each arm (best round) and
``reuse_over_no_reuse`` (median over the rounds of the pair ratio, with its order-statistic
interval where the rounds allow one), the same on CPU time (``*_cpu``: less disturbed by other
processes), ``prefill_tokens`` / ``reused_tokens`` of the reuse arm and ``prefill_saved_frac``
(prompt tokens not computed / prompt tokens), the KV kept between turns at its peak against
``--kv-budget-mb`` (``kv_retained_peak_bytes``, ``kv_budget_bytes``), and where the time
goes: ``prefill_frac_off``, the share of the no-reuse arm's wall time spent in prefills
(``path.begin``), and ``ratio_from_prefill_time`` = 1 / (1 - prefill_frac_off x
prefill_saved_frac), the ratio that the prefill time saved alone accounts for. The measured
ratio can exceed it: rows that join a running batch with a shorter prefill also copy fewer
columns into it and allocate smaller activations, outside ``begin``.

Model: the demo's bundled policy (``--model auto`` or ``bundled``; a calculator episode then
looks like a run's), ``random``: a random Qwen3 of the reference size (4 layers, hidden 256)
with the bundled tokenizer, or an HF directory with a tokenizer; FP32, ``--threads`` threads.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from typing import Any

from mixrl.lab.bench.fixtures import REFERENCE

FOLLOW_UP = "Next question: {q}"




def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--episodes", type=int, default=32,
                        help="multiturn: episodes (sessions) per round; 32 = one replica's share of the demo's "
                             "16 prompts x 8 samples over 4 groups")  # fmt: skip
    parser.add_argument("--turns", type=int, default=4, help="multiturn: turns per episode")
    parser.add_argument("--reply-tokens", type=int, default=24, help="multiturn and group: max tokens per reply")
    parser.add_argument("--groups", type=int, default=8, help="group: prompts per round")
    parser.add_argument("--group-size", type=int, default=8, help="group: samples per prompt (G)")
    parser.add_argument("--kv-budget-mb", type=float, default=64.0, help="bytes of sessions' KV kept, in MiB")


def check(args: argparse.Namespace) -> str | None:
    """The first bad option, as one line; None when all are valid."""
    for name in ("episodes", "turns", "reply_tokens", "groups", "group_size"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if not args.kv_budget_mb > 0:
        return f"--kv-budget-mb must be > 0, got {args.kv_budget_mb}"
    if args.model not in ("auto", "bundled", "random") and not os.path.exists(
        os.path.join(args.model, "tokenizer_config.json")
    ):
        return f"--model {args.model!r} has no tokenizer_config.json (the workload needs a chat template)"
    return None


def _model(spec: str, workdir: str, seed: int) -> tuple[str, str]:
    if spec in ("auto", "bundled"):  # the demo's policy, shipped with its tokenizer and chat template
        from mixrl.models.policy import resolve

        return str(resolve("bundled")), "bundled policy (the demo's, shipped)"
    if spec != "random":
        return spec, f"HF directory {spec}"
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mixrl.models.tokenizer import save_tokenizer

    tok = save_tokenizer(workdir)
    torch.manual_seed(seed)
    cfg = Qwen3Config(**{**REFERENCE, "vocab_size": len(tok)}, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id)  # fmt: skip
    Qwen3ForCausalLM(cfg).save_pretrained(workdir)
    return workdir, f"random Qwen3, reference size (4 layers, hidden 256), bundled tokenizer (vocab {len(tok)})"


class _Timed:
    """Wraps a path's ``begin`` (the prefill) to add up the seconds it takes."""

    def __init__(self, begin: Any) -> None:
        self.begin, self.s = begin, 0.0

    def __call__(self, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.begin(*a, **kw)
        finally:
            self.s += time.perf_counter() - t0


async def _drive(engine: Any, chat: Any, tasks: list[Any], extra: list[Any], turns: int, reply: int,
                 copies: int) -> list[list[Any]]:
    """Run the episodes through one continuous batch; per request (in a fixed order) its result."""
    from mixrl.envs.calc import CalcEnv
    from mixrl.records.generation import GenerationRequest, SamplingParams

    envs = [CalcEnv(t, chat, max_turns=turns) for t in tasks]
    convs = [await env.reset() for env in envs]
    out: list[list[Any]] = [[] for _ in range(len(tasks) * copies)]
    run = engine.stream()

    def request(k: int) -> GenerationRequest:
        t = len(out[k])
        p = SamplingParams(max_new_tokens=reply, stop_ids=tuple(chat.stop_ids), record="none", seed=1000 * k + t)
        return GenerationRequest(list(convs[k // copies] if copies > 1 else convs[k]), p, f"{k}/{t}", session=f"s{k}")

    run.add([(k, request(k)) for k in range(len(out))])
    nxt = 0
    while not run.idle:
        run.fill()
        if not run.rows:
            continue
        for k, res in run.step():
            out[k].append(res)
            if len(out[k]) >= turns:
                continue
            step = await envs[k].step(res.token_ids, res.finish_reason)
            more = step.tokens
            if step.done:  # keep the episode going: the next question of the stream
                more = more + chat.user_turn(FOLLOW_UP.format(q=extra[nxt % len(extra)].data["question"]))
                nxt += 1
            convs[k] = convs[k] + res.token_ids + more
            run.add([(k, request(k))])
    return out


def _round(engine: Any, timer: _Timed, work: tuple[Any, ...], budget: int) -> dict[str, Any]:
    from mixrl.sampling.builtin.prefix_cache import PrefixStore

    if engine.prefix_reuse:  # each round starts with nothing kept
        engine.kv_store = PrefixStore(budget, engine.kv_store.across_versions if engine.kv_store else False)
    timer.s = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    out = asyncio.run(_drive(engine, *work))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    res = [r for rs in out for r in rs]
    return {"wall_s": wall, "cpu_s": cpu, "prefill_s": timer.s, "samples": len(out),
            "tokens": [r.token_ids for r in res], "logprobs": [r.logprobs for r in res],
            "prefill_tokens": sum(r.timings["prefill_tokens"] for r in res),
            "reused_tokens": sum(r.timings["reused_tokens"] for r in res),
            "kv_evictions": sum(r.timings["kv_evictions"] for r in res),
            "kv_peak": engine.kv_store.peak if engine.kv_store is not None else 0}  # fmt: skip


def _compare(name: str, arms: dict[str, Any], timers: dict[str, _Timed], work: tuple[Any, ...], repeats: int,
             budget: int) -> dict[str, Any]:
    from mixrl.lab.bench.stats import median_interval

    for arm in ("off", "on"):  # warm-up
        _round(arms[arm], timers[arm], work, budget)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for i in range(repeats):
        for arm in ("off", "on") if i % 2 == 0 else ("on", "off"):
            runs[arm].append(_round(arms[arm], timers[arm], work, budget))
    off, on = runs["off"][0], runs["on"][0]
    same = all(a["tokens"] == b["tokens"] for a in runs["on"] for b in runs["off"][:1])
    diff = max((abs(x - y) for a, b in zip(on["logprobs"], off["logprobs"], strict=True)
                for x, y in zip(a, b, strict=True)), default=0.0)  # fmt: skip
    pairs = [b["wall_s"] / a["wall_s"] for a, b in zip(runs["on"], runs["off"], strict=True)]
    pairs_cpu = [b["cpu_s"] / a["cpu_s"] for a, b in zip(runs["on"], runs["off"], strict=True)]
    prompt = on["prefill_tokens"] + on["reused_tokens"]
    saved = on["reused_tokens"] / prompt
    frac_off = statistics.median(r["prefill_s"] / r["wall_s"] for r in runs["off"])
    ci = median_interval(pairs)
    return {
        "workload": name, "samples": on["samples"], "requests": len(on["tokens"]),
        "identical_tokens": same and off["tokens"] == on["tokens"], "max_abs_logprob_diff": diff,
        "samples_per_s_off": max(r["samples"] / r["wall_s"] for r in runs["off"]),
        "samples_per_s_on": max(r["samples"] / r["wall_s"] for r in runs["on"]),
        "reuse_over_no_reuse": statistics.median(pairs), "reuse_over_no_reuse_rounds": [round(x, 3) for x in pairs],
        "reuse_over_no_reuse_ci95": [ci[0], ci[1]] if ci else None,
        "reuse_over_no_reuse_cpu": statistics.median(pairs_cpu),
        "prompt_tokens": prompt, "prefill_tokens": on["prefill_tokens"], "reused_tokens": on["reused_tokens"],
        "prefill_saved_frac": saved, "kv_evictions": on["kv_evictions"],
        "kv_retained_peak_bytes": max(r["kv_peak"] for r in runs["on"]), "kv_budget_bytes": budget,
        "prefill_frac_off": frac_off, "ratio_from_prefill_time": 1.0 / (1.0 - frac_off * saved),
        "prefill_s_off": statistics.median(r["prefill_s"] for r in runs["off"]),
        "prefill_s_on": statistics.median(r["prefill_s"] for r in runs["on"]),
    }  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from mixrl.envs.calc import make_task
    from mixrl.models.chat import ChatFormat
    from mixrl.sampling.builtin.engine import BuiltinEngine
    from mixrl.sampling.profiles import get_profile

    budget = int(args.kv_budget_mb * (1 << 20))
    with tempfile.TemporaryDirectory() as tmp:
        path, desc = _model(args.model, tmp, args.seed)
        chat = ChatFormat(AutoTokenizer.from_pretrained(path))
        arms, timers = {}, {}
        for arm in ("off", "on"):
            arms[arm] = BuiltinEngine(path, get_profile("fp32"), "bench", num_threads=args.threads, seed=args.seed,
                                      prefix_reuse=arm == "on", kv_retain_bytes=budget)  # fmt: skip
            timers[arm] = arms[arm].path.begin = _Timed(arms[arm].path.begin)
        tasks = [make_task(args.seed, "train", i) for i in range(max(args.episodes, args.groups))]
        extra = [make_task(args.seed + 1, "train", i) for i in range(64)]
        multi = (chat, tasks[: args.episodes], extra, args.turns, args.reply_tokens, 1)
        group = (chat, tasks[: args.groups], extra, 1, args.reply_tokens, args.group_size)
        out = {
            "model": desc, "threads": torch.get_num_threads(), "repeats": args.repeats,
            "episodes": args.episodes, "turns": args.turns, "reply_tokens": args.reply_tokens,
            "groups": args.groups, "group_size": args.group_size,
            "load_avg_1m_start": os.getloadavg()[0],
            "multiturn": _compare("multiturn", arms, timers, multi, args.repeats, budget),
            "group": _compare("group", arms, timers, group, args.repeats, budget),
            "load_avg_1m_end": os.getloadavg()[0],
        }  # fmt: skip
    m, g = out["multiturn"], out["group"]
    for w, r in (("multiturn", m), ("group", g)):  # the headline figures, also at the top level
        for k in ("prefill_saved_frac", "reuse_over_no_reuse", "reuse_over_no_reuse_cpu", "ratio_from_prefill_time",
                  "identical_tokens", "kv_retained_peak_bytes"):
            out[f"{w}_{k}"] = r[k]
        out[f"{w}_reuse_over_no_reuse_ci95"] = r["reuse_over_no_reuse_ci95"]
    out["goals"] = {"multiturn.prefill_saved_frac>=0.5": m["prefill_saved_frac"] >= 0.5,
                    "multiturn.reuse_over_no_reuse>=1.3": m["reuse_over_no_reuse"] >= 1.3,
                    "group.reuse_over_no_reuse>=1.15": g["reuse_over_no_reuse"] >= 1.15,
                    "identical_tokens": m["identical_tokens"] and g["identical_tokens"],
                    "kv_within_budget": m["kv_retained_peak_bytes"] <= budget}  # fmt: skip
    return out
