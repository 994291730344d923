"""``mixrl bench trainer [--json]``: trainer memory and throughput under a token budget.

The trainer is the one ``mixrl train`` builds (``runtime.trainer_state.build_trainer``
on the demo config, loss preset ``sc+mis+top-p``), fed real trajectories of the
calculator task sampled once from the bundled policy by the built-in engine
(multi-turn, top-p support recorded, the demo's token limits); larger batches
repeat them. Measurements, each a named entry of ``MEASUREMENTS`` (a function
``(args, data) -> dict`` whose keys go into the JSON object; add one there):

- ``memory``: peak memory of one update with 128 / 512 / 1,024 trajectories at
  the fixed budget ``--budget`` (``optim.micro_batch_tokens``), packing on. Each
  size runs in a fresh subprocess with glibc's mmap threshold at 128 KiB
  (``MALLOC_MMAP_THRESHOLD_``: large tensors are their own mappings and go back
  to the kernel when freed, so the resident set follows live tensors). The
  subprocess loads the model and the trajectories, runs one warm-up update
  (AdamW allocates its moments), resets the kernel's high-water mark
  (``/proc/self/clear_refs`` = 5) and runs one update: ``peak_mb_<n>`` is
  ``VmHWM`` minus the resident size before it (what one update adds: batch
  tensors, activations, gradients, metrics), ``rss_peak_mb_<n>`` the whole
  process's ``VmHWM``. ``peak_mb_1024_over_128`` is their ratio (goal <= 1.3),
  measured with ``optim.share_prefix = false`` so that every size fills the
  budget; ``shared_*`` are the same with the default shared prompt prefixes,
  where 128 trajectories feed fewer tokens than one budget holds (so its peak is
  lower and that ratio is not a bound check).
  ``--unbounded`` also measures 128 and 1,024 with no budget and no packing
  (one forward over the whole padded batch: the behaviour without a budget).
- ``packing``: trainer tokens/s (real tokens of the trajectories per second of
  ``Trainer.step``) on ``--batch`` trajectories, packed vs padded at the same
  budget, two trainers from the same weights measured alternately in one process
  (median of ``--repeats`` after one warm-up each), on two calculator length
  mixes: ``shipped_*`` (the episodes above, the demo's temperature: the shipped
  policy answers in 16-46 tokens) and ``variable_*`` (the same policy at
  ``--mix-temperature``, default 2.0: a spread of about 16-160 tokens). Padded is
  what the trainer does with ``optim.packing=false``: micro-batches cut by the
  same budget in arrival order, each padded to its longest trajectory
  (``packing_baseline``). Each mix gives its length distribution, the model-input
  tokens each variant spends (padding included), the padding fraction, packed
  row lengths and ``<mix>_packed_over_padded``; ``packed_over_padded`` (goal
  >= 1.3, stated for variable-length batches) is the variable mix's, and
  ``packed_over_padded_shipped`` the shipped one's.
- ``fsdp``, ``lora``: 2 FSDP2 ranks vs 1 trainer, LoRA vs full fine-tuning
  (``mixrl.lab.bench.trainer_dist``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixrl.lab.bench.trainer_dist import batch_of, measure_fsdp, measure_lora, run_config
from mixrl.system.jsonout import json_text

SIZES = (128, 512, 1024)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    # 4096: a budget the smallest batch (128 calculator episodes, ~8k tokens) fills, so every
    # size runs full micro-batches; at the config default (16384) 128 episodes use half of it
    parser.add_argument("--budget", type=int, default=4096, help="optim.micro_batch_tokens (default 4096)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="trajectories per update for memory")
    parser.add_argument("--batch", type=int, default=256, help="trajectories per update for tokens/s")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per variant (median)")
    parser.add_argument("--episodes", type=int, default=128, help="distinct calculator episodes sampled")
    # 2.0: the shipped policy's replies then run on to the demo's limits in part of the episodes,
    # a spread of lengths (about 16-160 tokens) like a policy early in training or a harder task
    parser.add_argument("--mix-temperature", type=float, default=2.0,
                        help="sampling temperature of the variable-length mix for packing (default 2.0)")
    parser.add_argument("--only", default=None, help=f"comma-separated measurements ({', '.join(MEASUREMENTS)})")
    parser.add_argument("--unbounded", action="store_true", help="also measure memory without a budget")
    parser.add_argument("--model", default="bundled", help='policy: "bundled" or an HF directory')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fsdp-steps", type=int, default=3, help="updates compared for fsdp")
    parser.add_argument("--fsdp-batch", type=int, default=16, help="trajectories per update for fsdp")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-budget", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-share-prefix", action="store_true", help=argparse.SUPPRESS)


# ------------------------------------------------------------------ shared pieces


def sample_episodes(model_path: str, n: int, seed: int, threads: int,
                    temperature: float | None = None) -> list[dict[str, Any]]:
    """``n`` calculator episodes (demo limits, the preset's top-p support recorded).

    ``temperature``: sample at that temperature instead of the demo's (``rollout.temperature``)."""
    import asyncio

    from mixrl.envs.registry import make_env, make_task_source
    from mixrl.models.chat import ChatFormat
    from mixrl.models.policy import load_policy
    from mixrl.records.generation import SamplingParams
    from mixrl.rollout.session import run_episode
    from mixrl.runtime.run import resolve_loss
    from mixrl.sampling.batching import BatchingSampler
    from mixrl.sampling.factory import make_engine

    cfg = run_config(model_path, None, True, seed, threads)
    if temperature is not None:
        cfg.rollout.temperature = temperature
    _, derived = resolve_loss(cfg)
    _, tok = load_policy(model_path)
    chat = ChatFormat(tok)
    src = make_task_source(cfg.env.name, "train", seed=seed)
    engine = make_engine(model_path, "fp32", "fp32", seed=seed, num_threads=threads)
    params = SamplingParams(temperature=cfg.rollout.temperature, top_p=derived.top_p,
                            max_new_tokens=cfg.rollout.max_new_tokens, record=derived.record,
                            stop_ids=(chat.end_of_turn_id,))
    G = cfg.rollout.group_size
    tasks = [src[i] for i in range((n + G - 1) // G)]

    async def run_all() -> list[Any]:
        sampler = BatchingSampler(engine)
        try:
            return list(await asyncio.gather(*[
                run_episode(make_env(t, chat, **cfg.env.options), sampler.generate, params, prompt_id=t.prompt_id,
                            sample_idx=j, max_total_tokens=cfg.rollout.max_total_tokens)
                for t in tasks for j in range(G)]))
        finally:
            await sampler.close()

    trajs = [t for t in asyncio.run(run_all()) if t.status != "infra_failed"][:n]
    return [t.to_dict() for t in trajs]


def make_trainer(model_path: str, budget: int | None, packing: bool, seed: int, threads: int) -> Any:
    from mixrl.runtime.run import resolve_loss
    from mixrl.runtime.trainer_state import build_trainer

    cfg = run_config(model_path, budget, packing, seed, threads)
    loss_cfg, _ = resolve_loss(cfg)
    if budget is None:  # no budget: the whole update in one forward
        cfg.optim.micro_batch_tokens = 1 << 26
    return build_trainer(cfg, model_path, loss_cfg)[0]


# ------------------------------------------------------------------ memory


def _status_kb() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in f) if k in ("VmRSS", "VmHWM")}


def _memory_child(args: argparse.Namespace) -> dict[str, float]:
    import gc

    data = json.loads(Path(args.data).read_text())
    budget = None if args.no_budget else args.budget
    trainer = make_trainer(args.model, budget, not args.no_budget, args.seed, args.threads)
    trainer.share_prefix = trainer.share_prefix and not args.no_share_prefix
    trajs, adv = batch_of(data, args.memory_child, args.seed)
    trainer.step(trajs, adv)  # warm-up: AdamW moments, thread pools
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    base = _status_kb()["VmRSS"]
    m = trainer.step(trajs, adv)
    st = _status_kb()
    return {"peak_mb": (st["VmHWM"] - base) / 1024, "rss_peak_mb": st["VmHWM"] / 1024,
            "tokens": m["train/tokens"]}


def _peak(args: argparse.Namespace, data_path: str, n: int, bounded: bool, share: bool = True) -> dict[str, float]:
    cmd = [sys.executable, "-m", "mixrl.lab.bench.trainer", "--memory-child", str(n), "--data", data_path,
           "--budget", str(args.budget), "--model", args.model, "--seed", str(args.seed),
           "--threads", str(args.threads)] + ([] if bounded else ["--no-budget"]) + (
           [] if share else ["--no-share-prefix"])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"memory subprocess for {n} trajectories failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_memory(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",")]
    res: dict[str, Any] = {"budget_tokens": args.budget}
    for n in sizes:
        for share, pre in ((False, ""), (True, "shared_")):
            r = _peak(args, data["path"], n, True, share)
            res[f"{pre}peak_mb_{n}"], res[f"{pre}rss_peak_mb_{n}"] = round(r["peak_mb"], 1), round(r["rss_peak_mb"], 1)
    if 128 in sizes and 1024 in sizes:
        res["peak_mb_1024_over_128"] = res["peak_mb_1024"] / max(res["peak_mb_128"], 1e-9)
        res["shared_peak_mb_1024_over_128"] = res["shared_peak_mb_1024"] / max(res["shared_peak_mb_128"], 1e-9)
    if args.unbounded:
        for n in (128, 1024):
            r = _peak(args, data["path"], n, False)
            res[f"unbounded_peak_mb_{n}"] = round(r["peak_mb"], 1)
    res["memory_method"] = "fresh subprocess per size, MALLOC_MMAP_THRESHOLD_=131072, VmHWM - VmRSS over one update"
    return res


# ------------------------------------------------------------------ packed vs padded


PADDED_BASELINE = ("optim.packing=false, the trainer without packing: micro-batches of at most budget_tokens "
                   "model-input tokens cut in arrival order, each padded to its longest trajectory")


def _lengths(trajs: list[Any]) -> dict[str, int]:
    lens = sorted(len(t.tokens) for t in trajs)
    return {"length_min": lens[0], "length_median": lens[len(lens) // 2], "length_max": lens[-1]}


def _packing_mix(args: argparse.Namespace, variants: dict[str, Any], episodes: list[dict[str, Any]],
                 prefix: str) -> dict[str, Any]:
    """Packed vs padded tokens/s on ``--batch`` trajectories of one length mix (keys ``prefix_*``)."""

    trajs, adv = batch_of(episodes, args.batch, args.seed)
    real = sum(len(t.tokens) for t in trajs)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for rnd in range(args.repeats + 1):
        for name, tr in variants.items():  # alternated: load from other processes hits both alike
            t0 = time.perf_counter()
            tr.step(trajs, adv)
            if rnd:  # round 0 is the warm-up
                times[name].append(time.perf_counter() - t0)
    res: dict[str, Any] = {f"{prefix}_{k}": v for k, v in _lengths(trajs).items()}
    res[f"{prefix}_real_tokens"] = real
    for name, tr in variants.items():
        records = tr._prepare(trajs, adv, False)[0]
        plan = tr._micro(records)  # the trainer's own plan, as its step cut it
        fed = sum(mb.tokens for mb in plan)
        s = statistics.median(times[name])
        res[f"{prefix}_{name}_tokens_per_s"] = real / s
        res[f"{prefix}_{name}_step_s"] = s
        res[f"{prefix}_{name}_model_tokens"], res[f"{prefix}_{name}_micro_batches"] = fed, len(plan)
        res[f"{prefix}_{name}_padding_frac"] = 1 - sum(mb.real_tokens for mb in plan) / fed if fed else 0.0
        if name == "packed":
            res[f"{prefix}_packed_row_lens"] = " ".join(str(mb.row_len) for mb in plan)
    res[f"{prefix}_packed_over_padded"] = res[f"{prefix}_packed_tokens_per_s"] / res[f"{prefix}_padded_tokens_per_s"]
    return res


def measure_packing(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    variants = {name: make_trainer(args.model, args.budget, packed, args.seed, args.threads)
                for name, packed in (("padded", False), ("packed", True))}
    res: dict[str, Any] = {"packing_batch": args.batch, "packing_baseline": PADDED_BASELINE,
                           "shipped_mix": "the --model policy's calculator episodes at the demo's temperature "
                                          "(the memory measurement's episodes)",
                           "variable_mix": f"the same policy's calculator episodes sampled at temperature "
                                           f"{args.mix_temperature:g} (replies run on to the demo's token limits)"}
    res.update(_packing_mix(args, variants, data["episodes"], "shipped"))
    res.update(_packing_mix(args, variants, data["variable"], "variable"))
    res["packed_over_padded"] = res["variable_packed_over_padded"]
    res["packed_over_padded_shipped"] = res["shipped_packed_over_padded"]
    res["packed_over_padded_is"] = ("the variable mix: the goal (>= 1.3) is stated for variable-length batches; "
                                    "packed_over_padded_shipped is the shipped policy's near-uniform episodes")
    return res


# name -> measurement; each returns keys of the JSON object (add new ones here)
MEASUREMENTS: dict[str, Callable[[argparse.Namespace, dict[str, Any]], dict[str, Any]]] = {
    "memory": measure_memory,
    "packing": measure_packing,
    "fsdp": measure_fsdp,  # bench.trainer_dist: 2 FSDP2 ranks vs 1 trainer
    "lora": measure_lora,  # bench.trainer_dist: LoRA vs full fine-tuning
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from mixrl.models.policy import resolve

    if args.budget < 16 or args.batch < 1 or args.repeats < 1 or args.episodes < 1:
        raise ValueError("--budget must be >= 16; --batch, --repeats and --episodes >= 1")
    if not 0 < args.mix_temperature <= 10:
        raise ValueError(f"--mix-temperature must be in (0, 10], got {args.mix_temperature}")
    names = list(MEASUREMENTS) if args.only is None else [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [n for n in names if n not in MEASUREMENTS]
    if unknown:
        raise ValueError(f"--only: unknown measurement(s) {unknown}; known: {list(MEASUREMENTS)}")
    torch.set_num_threads(args.threads)
    args.model = str(resolve(args.model))  # builds the bundled policy once, before the subprocesses
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    episodes = sample_episodes(args.model, args.episodes, args.seed, args.threads)
    lens = sorted(len(e["tokens"]) for e in episodes)
    res: dict[str, Any] = {"episodes": len(episodes), "length_min": lens[0], "length_median": lens[len(lens) // 2],
                           "length_max": lens[-1], "sample_s": time.perf_counter() - t0, "threads": args.threads}
    with tempfile.TemporaryDirectory(prefix="mixrl-bench-trainer-") as tmp:
        path = Path(tmp) / "episodes.json"
        path.write_text(json.dumps(episodes))
        data = {"episodes": episodes, "path": str(path)}
        if "packing" in names:
            data["variable"] = sample_episodes(args.model, args.episodes, args.seed, args.threads,
                                               temperature=args.mix_temperature)
        for name in names:
            res.update(MEASUREMENTS[name](args, data))
    res["loadavg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    return res


def main(args: argparse.Namespace) -> int:
    if args.memory_child is not None:
        print(json.dumps(_memory_child(args)))
        return 0
    try:
        res = run(args)
    except ValueError as e:
        print(f"mixrl bench trainer: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json_text(res))
        return 0
    for k, v in res.items():
        print(f"{k:26s} {v:.4g}" if isinstance(v, float) else f"{k:26s} {v}")
    return 0


if __name__ == "__main__":
    _p = argparse.ArgumentParser(prog="mixrl bench trainer")
    configure(_p)
    raise SystemExit(main(_p.parse_args()))
