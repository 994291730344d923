"""``mixrl eval CHECKPOINT --k 4``: pass@k of a policy on the held-out split.

CHECKPOINT is an HF model directory or ``"bundled"``. Each held-out task is
sampled ``n`` times (default ``n = k``) at temperature 1 through the built-in
engine, in the trainer's precision (profile ``fp32``; ``--precision bf16``
uses ``bf16``; ``--profile`` names any other), each sample a full episode
through the session runner. pass@k is the unbiased estimator of
``rollout/passk.py``; a sample counts as correct when its reward is >= 1.

Deterministic given ``--seed`` (and the thread count): every request gets its
own sampling seed from (seed, task, sample, turn), so neither batching nor
scheduling changes a token; the JSON carries the policy's digest. On another
CPU (other float32 kernels) a token can flip only where two candidates tie
within rounding.

Infrastructure failures (``infra_failed``) are not failures of the model:
they are left out of each task's n and reported; a task left with fewer than
k valid samples is left out of pass@k and counted in ``tasks_incomplete``.

The runtime calls ``evaluate(...)`` for the final held-out evaluation; the
command prints a table, or one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import logging
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from mixrl.envs.family import Active
from mixrl.envs.registry import make_env, make_task_source
from mixrl.models.chat import ChatFormat
from mixrl.models.policy import resolve
from mixrl.records.generation import SamplingParams
from mixrl.records.trajectory import UNREWARDED
from mixrl.rollout.failures import check_episodes
from mixrl.rollout.passk import mean_pass_at_k
from mixrl.rollout.session import run_episode
from mixrl.sampling.batching import BatchingSampler
from mixrl.sampling.factory import make_engine
from mixrl.system.jsonout import json_text
from mixrl.system.seeds import stable_seed

PRECISIONS = {"fp32": "fp32", "bf16": "bf16"}
log = logging.getLogger(__name__)


def _tokenizer_for(path: Path) -> Any:
    """The checkpoint's tokenizer; the bundled one if the directory has none but matches it."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError):
        from mixrl.models.tokenizer import build_tokenizer

        tok = build_tokenizer()
        if AutoConfig.from_pretrained(str(path)).vocab_size != len(tok):
            raise ValueError(f"checkpoint {str(path)!r} has no tokenizer and is not the bundled vocabulary") from None
        return tok


def _chat_format(path: Path, chat_template: str | None) -> Any:
    """The checkpoint's chat format; ``chat_template`` (a Jinja file) replaces the tokenizer's own."""

    tok = _tokenizer_for(path)
    if chat_template:
        from mixrl.models.loading import read_chat_template

        tok.chat_template = read_chat_template(chat_template)
    return ChatFormat(tok)


def weights_digest(path: Path) -> str | None:
    """The policy's digest: ``recipe.json``'s (the bundled policy), else sha256 of its
    safetensors files (None when they are over 2 GiB: not worth reading twice)."""
    meta = path / "recipe.json"
    if meta.is_file():
        got = json.loads(meta.read_text()).get("weights_sha256")
        if got:
            return str(got)
    files = sorted(path.glob("*.safetensors"))
    if not files or sum(f.stat().st_size for f in files) > 2 << 30:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return "files:" + h.hexdigest()


def request_seed(seed: int, request_id: str) -> int:
    """A 63-bit sampling seed from the evaluation seed and ``prompt_id/sample/turn``."""
    return stable_seed("eval", seed, request_id)


def summarize(by_task: dict[str, list[Any]], k: int) -> dict[str, Any]:
    """pass@1, pass@k and counts from trajectories grouped by task.

    Samples without a reward (``infra_failed``, ``reward_failed``, ``agent_failed``)
    are dropped from a task's n; tasks with fewer than k valid samples are left out
    of pass@k (``tasks_incomplete``).
    """

    counts, incomplete, per_task = [], 0, {}
    for task_id, trs in by_task.items():
        valid = [tr for tr in trs if tr.status not in UNREWARDED]  # no reward is not a failure
        if len(valid) < k:
            incomplete += 1
            continue
        counts.append((len(valid), sum(1 for tr in valid if (tr.reward or 0.0) >= 1.0)))
        per_task[str(task_id)] = list(counts[-1])  # [n, c]: bootstrap over tasks, hard subsets
    rows = [tr for trs in by_task.values() for tr in trs]
    rewards = [tr.reward for tr in rows if tr.reward is not None]
    return {
        "pass@1": mean_pass_at_k(counts, 1) if counts else float("nan"),
        f"pass@{k}": mean_pass_at_k(counts, k) if counts else float("nan"),
        "n_tasks": len(counts),
        "mean_reward": sum(rewards) / len(rewards) if rewards else float("nan"),
        "status": dict(Counter(tr.status for tr in rows)),
        "infra_failed": sum(tr.status == "infra_failed" for tr in rows),
        "tasks_incomplete": incomplete,
        "mean_turns": sum(tr.turns for tr in rows) / max(1, len(rows)),
        "mean_generated": sum(tr.num_generated for tr in rows) / max(1, len(rows)),
        "per_task": per_task,
    }


def results(trajs: list[Any], family: dict[str, str], k: int) -> dict[str, Any]:
    """``summarize`` of all trajectories, the reasons of unrewarded samples, and ``per_family``
    (``family``: prompt id -> task family)."""

    by_task: dict[str, list[Any]] = defaultdict(list)
    for tr in trajs:
        by_task[tr.prompt_id].append(tr)
    res = summarize(by_task, k)
    errors = Counter(str(tr.info.get("error", "no reason recorded")) for tr in trajs if tr.status in UNREWARDED)
    if errors:
        # Samples without a reward are left out of pass@k; their reasons must not be lost with them.
        res["errors"] = dict(errors.most_common(5))
        log.warning("evaluation: %d of %d samples have no reward; most common reasons: %s",
                    sum(errors.values()), len(trajs), res["errors"])
    fams = sorted(set(family.values()))
    res["per_family"] = {f: summarize({p: v for p, v in by_task.items() if family[p] == f}, k) for f in fams}
    return res


def evaluate(
    model_path: str | Path = "bundled",
    k: int = 4,
    n: int | None = None,
    n_tasks: int | None = None,
    seed: int = 0,
    *,
    task: str = "calc",
    precision: str = "fp32",
    profile: str | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 32,
    max_total_tokens: int = 256,
    max_turns: int = 4,
    env_options: dict[str, Any] | None = None,
    max_batch: int = 64,
    num_threads: int | None = None,
    chat_template: str | None = None,
    active: Active | None = None,
) -> dict[str, Any]:
    """pass@1 and pass@k of ``model_path`` on ``n_tasks`` held-out tasks of ``task`` (a run's dataset,
    rewards and env options: ``active``, from ``envs.registry.activate``).

    Returns a dict with ``pass@1``, ``pass@<k>``, ``n_tasks``, ``n``, ``k``,
    ``mean_reward``, ``status`` counts, ``infra_failed``, ``tasks_incomplete``,
    ``per_family`` (the same metrics per family) and ``wall_s``.
    ``top_p`` < 1 samples inside that nucleus; 1.0 scores the full ``p`` (docs/corrections.md §14).
    ``env_options`` go to ``make_env`` (they override ``max_turns``);
    ``chat_template`` (a Jinja file) replaces the tokenizer's own.
    """

    n = k if n is None else n
    if k < 1 or n < k:
        raise ValueError(f"evaluate: need 1 <= k <= n, got k={k}, n={n}")
    if precision not in PRECISIONS:
        raise ValueError(f"evaluate: precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    prof = profile or PRECISIONS[precision]
    t0 = time.perf_counter()
    path = resolve(model_path)
    chat = _chat_format(path, chat_template)
    src = make_task_source(task, "heldout", seed, active=active)
    n_tasks = len(src) if n_tasks is None else n_tasks
    if not 1 <= n_tasks <= len(src):
        raise ValueError(f"evaluate: n_tasks must be in [1, {len(src)}] for {task!r}, got {n_tasks}")
    tasks = [src[i] for i in range(n_tasks)]
    engine = make_engine(str(path), prof, prof, seed=seed, max_batch=max_batch, num_threads=num_threads)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, record="none")
    env_kw = {"max_turns": max_turns, **(env_options or {})}

    async def run_all() -> list[Any]:
        sampler = BatchingSampler(engine, max_batch=max_batch)

        async def generate(req: Any) -> Any:
            # Each request's own seed, from (seed, task, sample, turn): the tokens do not depend
            # on the order requests reach the engine, the batch they share, or the machine's timing.
            req.params = dataclasses.replace(req.params, seed=request_seed(seed, req.request_id))
            return await sampler.generate(req)

        try:
            coros = [
                run_episode(make_env(t, chat, active, **env_kw), generate, params,
                            prompt_id=t.prompt_id, sample_idx=j, max_total_tokens=max_total_tokens)
                for t in tasks for j in range(n)
            ]
            return list(await asyncio.gather(*coros))
        finally:
            await sampler.close()

    trajs = asyncio.run(run_all())
    check_episodes(trajs, getattr(active.rewards if active else None, "on_error", "fail"), "held-out evaluation")
    res = results(trajs, {t.prompt_id: t.family for t in tasks}, k)
    import torch

    res.update({"n": n, "k": k, "task": task, "model": str(path), "weights_sha256": weights_digest(path),
                "profile": prof, "top_p": top_p, "seed": seed, "threads": torch.get_num_threads(),
                "wall_s": time.perf_counter() - t0})
    return res


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help='an HF model directory, or "bundled"')
    parser.add_argument("--k", type=int, default=4, help="k of pass@k (default 4)")
    parser.add_argument("--n", type=int, default=None, help="samples per task (default k; >= k)")
    parser.add_argument("--tasks", type=int, default=None, help="held-out tasks (default all)")
    parser.add_argument("--task", default="calc", help="task family or mix (default calc)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    parser.add_argument("--profile", default=None, help="sampler profile name (overrides --precision)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sampling nucleus (default 1.0: the full distribution)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="per assistant turn")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (default 2: the same numbers on any machine)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def main(args: argparse.Namespace) -> int:
    try:
        res = evaluate(args.checkpoint, args.k, args.n, args.tasks, args.seed, task=args.task,
                       precision=args.precision, profile=args.profile, top_p=args.top_p,
                       max_new_tokens=args.max_new_tokens, num_threads=args.threads)
    except (ValueError, FileNotFoundError) as e:
        print(f"mixrl eval: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json_text(res))
        return 0
    k = res["k"]
    print(f"{res['model']}  profile {res['profile']}  n={res['n']}  seed {res['seed']}  "
          f"{res['wall_s']:.1f}s")
    print(f"{'family':<10}{'tasks':>7}{'pass@1':>9}{f'pass@{k}':>9}{'reward':>9}{'turns':>7}  status")
    rows = [(f, r) for f, r in res["per_family"].items()] + [("all", res)]
    for name, r in rows:
        print(f"{name:<10}{r['n_tasks']:>7}{r['pass@1']:>9.3f}{r[f'pass@{k}']:>9.3f}"
              f"{r['mean_reward']:>9.3f}{r['mean_turns']:>7.2f}  {r['status']}")
    return 0
