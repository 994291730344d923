"""``mixrl bench e2e [--json]``: end-to-end throughput of the runtime.

Three measurements in one invocation, all on the bundled policy:

1. **async vs sync**: the same short run (the demo's mixed fleet, fewer steps,
   no evaluation) in sync mode (samplers wait for every update) and in async
   mode; samples/s of each (trajectories trained on per second of training,
   setup excluded), their ratio ``async_over_sync`` (goal >= 1.6) and the
   async trainer's idle fraction (time spent waiting for a batch; goal <= 0.15).
2. **mixrl vs TRL**: TRL's ``GRPOTrainer`` (CPU, no vLLM, FP32, no gradient
   checkpointing) and mixrl on the same model, the same single-turn task
   (``reverse``), the same batch (B prompts x G samples) and completion
   length: RL steps/s over the steps after the first (warm-up excluded),
   ratio ``mixrl_over_trl`` (goal >= 2). TRL runs in one process, so it is
   measured with 1 torch thread and with one per core and the faster counts
   (``trl_steps_per_s_by_threads``). Without ``trl`` installed the JSON
   says so instead.
3. **weight publication**: from publish to every replica serving the new
   version, on an idle fleet of worker processes (the demo's four groups, and
   one BF16 replica): the version written once into shared memory, quantized
   once per format (by the first worker process of that format; at most one
   quantizing per core, ``quantize_slots``, the slowest format first), mapped by
   every replica. ``publish_s`` spans the whole publication: the copy into
   shared memory, the quantizations and every replica's engine load, until the
   last replica serves the version. Against the floor, one state-dict copy plus
   one quantization per format in the fleet, each measured alone:
   ``publish_over_floor`` (goal <= 1.5); ``publish_over_copy`` is kept for
   comparison with older runs. The JSON also gives each replica's own load time
   (``engine_load_s``), each format's quantization as it ran in the
   publication (``quantize_in_run_s``) and the publication's own copy into
   shared memory (``shm_copy_s``).

   The floor's quantizations run with ``runtime.torch_threads`` torch threads,
   the count the quantizing worker process has (``quantize_s``), not the bench
   process's default count (one per core), which no worker has: on small tensors the extra intra-op thread costs more than it gives
   (NVFP4 of the bundled policy: ~5 ms with 2 threads, ~3 ms with 1), and on a
   busy 2-core machine its barrier waits made the figure erratic. That older
   definition is still reported side by side: ``quantize_s_default_threads``,
   ``publish_floor_default_threads_s``, ``publish_over_floor_default_threads``.

``peak_pss_gb``: the peak memory of the bench process and every worker process it
started, shared memory counted once (PSS, ``bench/memwatch.py``), overall and per phase
(``peak_pss_gb_by_phase``). A larger model than the bundled policy may need
``--set optim.micro_batch_tokens=...`` and shorter rollouts (``--set`` applies to every arm).

``load_avg`` is the machine's load average at the end (the ratios are measured
side by side, but a busy machine moves them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mixrl.records.run_dir import RunDir
from mixrl.system.jsonout import json_text


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, default=20, help="updates per run (default 20)")
    parser.add_argument("--prompts", type=int, default=8, help="B: prompts per update")
    parser.add_argument("--group-size", type=int, default=8, help="G: samples per prompt")
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL comparison")
    parser.add_argument("--out", default=None, help="keep the run directories here")
    parser.add_argument("--model", default="bundled",
                        help='policy: "bundled" or any model.path (HF directory, .gguf, pkg:...)')
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config field in every arm, as mixrl train --set (repeatable)")


def _cfg(base: list[str], run_dir: Path, extra: list[str]) -> Any:
    from mixrl.config import load_config

    return load_config(None, [*base, f'observe.run_dir="{run_dir.as_posix()}"', *extra])


def _steps_per_s(history: list[dict[str, Any]], times: list[float]) -> float:
    """Steps per second after the first step (warm-up excluded)."""
    if len(times) < 2:
        return float("nan")
    return (len(times) - 1) / max(times[-1] - times[0], 1e-9)


def run_mixrl(base: list[str], run_dir: Path, extra: list[str]) -> dict[str, Any]:
    from mixrl.runtime.run import train

    s = train(_cfg(base, run_dir, extra), evaluate=False, progress=False)
    recs = [json.loads(x) for x in RunDir(run_dir).metrics.read_text().splitlines()]
    times = [r["time"] for r in recs]
    # per-version publish latencies (publish -> every replica serves it)
    pub = [r["fleet/publish_s"] for r in recs if r.get("fleet/publish_s") is not None]
    return {
        "samples_per_s": s["samples_per_s"],
        "steps_per_s": _steps_per_s(s["history"], times),
        "trainer_idle_frac": s["trainer_idle_frac"],
        "elapsed_s": s["elapsed_s"],
        "publish_s": statistics.median(pub) if pub else float("nan"),
        "steps": s["steps"],
        **_cpu(s, recs),
        # the trainer's tensors at the end of the run, measured (gradients: the last update's)
        "trainer_tensor_mb": _mb(s.get("trainer_bytes")),
    }


def _mb(d: dict[str, Any] | None) -> dict[str, float] | None:
    return None if d is None else {k: round(v / 2**20, 1) if isinstance(v, (int, float)) else v for k, v in d.items()}


def _cpu(summary: dict[str, Any], recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the time goes: the trainer update's median wall and CPU seconds (the updating
    thread's; with one torch thread, wall / CPU above 1: it waited for a core or the
    interpreter lock), the process's CPU over the update (intra-op workers and the event
    loop included), and CPU seconds per step of the orchestrator process (trainer + event
    loop), of the updates alone, of the sampler workers."""
    wall = [r["perf/train_step_s"] for r in recs if "perf/train_step_s" in r]
    cpu = [r["perf/train_step_cpu_s"] for r in recs if "perf/train_step_cpu_s" in r]
    proc = [r["perf/train_step_process_cpu_s"] for r in recs if "perf/train_step_process_cpu_s" in r]
    n = max(int(summary["steps"]), 1)
    per = {k.removesuffix("_s"): (None if v is None else v / n) for k, v in (summary.get("cpu") or {}).items()}
    return {"train_step_s": statistics.median(wall) if wall else None,
            "train_step_cpu_s": statistics.median(cpu) if cpu else None,
            "train_step_process_cpu_s": statistics.median(proc) if proc else None, "cpu_s_per_step": per}


def cpu_ceiling(sync: dict[str, Any], asyn: dict[str, Any], cores: int | None = None) -> dict[str, Any]:
    """What the machine's cores allow the async arm, from both arms' own CPU figures.

    Each arm's CPU seconds per step (orchestrator process, trainer included, plus the
    sampler workers) over ``cores`` x its wall seconds per step is its utilization of the
    machine. The async arm cannot go faster than its CPU per step spread over every core:
    ``async_ceiling_samples_per_s`` = its samples/s over its utilization, and
    ``async_over_sync_cpu_ceiling`` that over the sync arm's samples/s. With the async arm
    near utilization 1, async_over_sync can only grow by spending less CPU per step
    (which speeds the sync arm's phases too) or with more cores."""
    from mixrl.runtime.backends.embedded.slots import usable_cores

    n = usable_cores() if cores is None else cores
    out: dict[str, Any] = {"cores": n}
    for name, arm in (("sync", sync), ("async", asyn)):
        per = arm["cpu_s_per_step"]
        cpu = (per.get("orchestrator") or 0.0) + (per.get("samplers") or 0.0)
        wall = arm["elapsed_s"] / max(int(arm["steps"]), 1)
        out[name] = {"cpu_s_per_step": cpu, "wall_s_per_step": wall, "utilization": cpu / (n * wall)}
    ceiling = asyn["samples_per_s"] / out["async"]["utilization"]
    out["async_ceiling_samples_per_s"] = ceiling
    out["async_over_sync_cpu_ceiling"] = ceiling / sync["samples_per_s"]
    return out


def copy_time(model_path: str, repeats: int = 5) -> float:
    """Median time of a raw detached copy of the policy's state dict."""
    from mixrl.models.policy import load_policy
    from mixrl.weights.store import copy_state_dict

    model, _ = load_policy(model_path)
    sd = model.state_dict()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy_state_dict(sd)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure_publish(base: list[str], model_path: str, groups: list[str] | None, repeats: int = 5) -> dict[str, Any]:
    """Publish -> every replica serving, on an idle fleet (no traffic): median seconds.

    ``groups``: the demo's groups to keep (None = all); each gets one replica, a
    worker process of the embedded backend. One publication is what a run does:
    the trainer's state dict written once into shared memory, one quantization per
    format the fleet has (in the worker process of the first replica of that format
    to ask), every replica mapping the result. The floor is one state-dict copy plus, per distinct
    format, one quantization of the version (measured alone, same functions, with the
    workers' torch thread count; also with this process's default count, the older figure).
    """
    import asyncio

    from mixrl.config import load_config
    from mixrl.fleet.fleet import Fleet, GroupSpec
    from mixrl.models.policy import load_policy
    from mixrl.runtime.backends.embedded import EmbeddedBackend
    from mixrl.runtime.run import group_profiles
    from mixrl.weights.formats import format_key, quantizer
    from mixrl.weights.shared import SharedVersion
    from mixrl.weights.store import WeightStore

    cfg = load_config(None, base)
    if groups is not None:
        cfg = cfg.model_copy(update={"fleet": cfg.fleet.model_copy(
            update={"groups": [g for g in cfg.fleet.groups if g.name in groups]})})
    profiles = group_profiles(cfg)
    model, _ = load_policy(model_path)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    formats = {}
    for g in cfg.fleet.groups:
        key = format_key(profiles[g.name], tied)
        if key is not None:
            formats.setdefault(key, quantizer(profiles[g.name]))

    async def main() -> dict[str, Any]:
        backend = EmbeddedBackend(cfg, model_path, None, workers="process")
        specs = [GroupSpec(g.name, float(profiles[g.name].relative_throughput), 1, 1, 1) for g in cfg.fleet.groups]
        fleet = Fleet(specs, backend.make_sampler, WeightStore(put=None))
        fleet.publish(0, SharedVersion.from_state_dict(model.state_dict()))
        await fleet.start()
        lat, quant, shm = [], [], []
        for v in range(1, repeats + 1):
            t0 = time.perf_counter()
            ref = SharedVersion.from_state_dict(model.state_dict())
            fleet.publish(v, ref)
            await fleet.wait_synced(v)
            lat.append(time.perf_counter() - t0)
            quant.append(dict(ref.quantize_s))
            shm.append(ref.copy_s)
        load_s = {n: statistics.median(h.load_s[-repeats:]) for n, h in backend.samplers.items() if h.load_s}
        worker_mem = {n: _worker_memory((await h.stats()).get("memory")) for n, h in backend.samplers.items()}
        await fleet.close()
        await backend.shutdown()
        return {"replicas": len(specs), "groups": [g.name for g in cfg.fleet.groups],
                "publish_s": statistics.median(lat), "formats": sorted(formats),
                "quantize_slots": backend.quantize_slots.n,
                "quantize_in_run_s": {f: statistics.median(q.get(f, float("nan")) for q in quant) for f in formats},
                "engine_load_s": load_s, "shm_copy_s": statistics.median(shm), "worker_memory_mb": worker_mem}

    res = asyncio.run(main())
    # the floor's parts, measured alone: one copy of the version, one quantization per format
    import torch

    from mixrl.runtime.backends.embedded.slots import usable_cores

    sd = model.state_dict()
    # torch's default count in a fresh process (one per core), not this process's current count:
    # the runs above set it to runtime.torch_threads, as every run's orchestrator does
    default, current = usable_cores(), torch.get_num_threads()

    def quantize_alone(threads: int) -> dict[str, float]:
        torch.set_num_threads(threads)
        try:
            qs = {}
            for f, q in formats.items():
                ts = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    for k, t in sd.items():
                        q(k, t)
                    ts.append(time.perf_counter() - t0)
                qs[f] = statistics.median(ts)
            return qs
        finally:
            torch.set_num_threads(current)

    res["quantize_s"] = quantize_alone(cfg.runtime.torch_threads)  # as the quantizing worker runs it
    res["quantize_s_default_threads"] = quantize_alone(default)  # the older floor's figure
    res["quantize_threads"] = {"worker": cfg.runtime.torch_threads, "default": default}
    return res


def _worker_memory(m: dict[str, Any] | None) -> dict[str, Any] | None:
    """A worker's self-measured memory (``worker.WorkerServer.memory``) in MB: its PSS parts and
    its engine's tensors (weights it owns, weights mapped from shared memory, the idle KV pool)."""
    if m is None:
        return None
    pss = _mb(m.get("pss")) or {}
    return {**{f"pss_{k}" if k != "pss" else k: v for k, v in pss.items()},
            **(_mb({k: v for k, v in m.items() if k not in ("pid", "pss", "free_before_load")}) or {})}


def run_trl(model_path: str, steps: int, prompts: int, group: int, max_new: int, lr: float,
            threads: int = 1) -> dict[str, Any]:
    """TRL GRPOTrainer on the reverse task: steps/s after the first step."""
    try:
        import trl
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        return {"available": False, "reason": f"trl is not installed ({e}); pip install trl==1.16.0"}
    import asyncio

    import torch

    from mixrl.envs.registry import make_env, make_task_source
    from mixrl.models.chat import ChatFormat
    from mixrl.models.policy import load_policy

    model, tok = load_policy(model_path)
    chat = ChatFormat(tok)
    src = make_task_source("reverse", "train", seed=0)
    tasks = [src.next() for _ in range(prompts * (steps + 1))]
    by_prompt = {}
    rows = []
    for t in tasks:
        ids = asyncio.run(make_env(t, chat).reset())
        text = tok.decode(ids, skip_special_tokens=False)
        by_prompt[text] = t
        rows.append({"prompt": text})

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        out = []
        for p, c in zip(prompts, completions, strict=True):
            env = make_env(by_prompt[p], chat)
            asyncio.run(env.reset())
            ids = tok(c, add_special_tokens=False)["input_ids"]
            step = asyncio.run(env.step(ids, "stop"))
            out.append(float(step.reward or 0.0))
        return out

    times: list[float] = []

    class _Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            times.append(time.perf_counter())

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, use_cpu=True, use_vllm=False, bf16=False, gradient_checkpointing=False,
            report_to="none", num_generations=group, per_device_train_batch_size=prompts * group,
            max_completion_length=max_new, max_steps=steps, learning_rate=lr, logging_steps=1,
            save_strategy="no", disable_tqdm=True, seed=0, temperature=1.0, beta=0.0,
            # stop at the end of the assistant turn, as mixrl's sessions do
            generation_kwargs={"eos_token_id": sorted({chat.end_of_turn_id, chat.eos_id})},
        )
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward, args=args,  # type: ignore[arg-type]
            train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[_Clock()],
        )
        t0 = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - t0
    return {"available": True, "version": trl.__version__, "steps_per_s": _steps_per_s([], times),
            "elapsed_s": total, "steps": len(times), "threads": threads}


def main(args: argparse.Namespace) -> int:
    # Everything the runs print goes to stderr: with --json, stdout is one JSON object.
    from mixrl.config import ConfigError

    with contextlib.redirect_stdout(sys.stderr):
        try:
            res = _measure(args)
        except ConfigError as e:  # a bad --set or --model: one line, exit status 2
            print(f"mixrl bench e2e: {e}", file=sys.stderr)
            return 2
    if args.json:
        print(json_text(res))
    else:
        print(json_text(res, indent=2))
    return 0


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    from mixrl.lab.bench.memwatch import PeakMemory, shm_bytes

    with PeakMemory(extra_bytes=shm_bytes) as mem:
        res = _measure_all(args, mem)
    res.update(mem.gb())  # the bench process and its workers, shared memory counted once (PSS)
    res["memory_at_peak_mb"] = mem.breakdown()  # per process, at the overall peak's sample
    res["tensor_floor"] = tensor_floor(res)
    return res


def tensor_floor(res: dict[str, Any]) -> dict[str, Any]:
    """The tensors this configuration holds at once, measured in the same run: the async
    trainer's (parameters, gradients, optimizer state, master copies, reference model) and each
    replica's served weights (``weights_owned``, in its compute dtype, from the publish fleet:
    the run's groups, one replica each). No runtime, activation, KV cache or published version
    is counted: the peak cannot go below it without smaller tensors (a 16-bit compute dtype for
    the samplers, replicas of one format sharing one copy, a smaller optimizer state).
    ``peak_over_tensor_floor``: ``peak_pss_gb`` over it."""
    trainer = (res.get("async") or {}).get("trainer_tensor_mb") or {}
    workers = ((res.get("publish") or {}).get("mixed_fleet") or {}).get("worker_memory_mb") or {}
    t_mb = sum(v for v in trainer.values() if isinstance(v, int | float))
    w_mb = {n: m.get("weights_owned", 0.0) for n, m in workers.items() if m}
    if not t_mb or not w_mb:
        return {"gb": None, "reason": "the run measured no trainer or replica tensors"}
    gb = (t_mb + sum(w_mb.values())) / 1024
    peak = res.get("peak_pss_gb")
    return {"gb": round(gb, 2), "trainer_mb": round(t_mb, 1), "replica_weights_mb": w_mb,
            "peak_over_tensor_floor": None if not peak else round(peak / gb, 2)}


def _measure_all(args: argparse.Namespace, mem: Any) -> dict[str, Any]:
    from mixrl.config import load_config
    from mixrl.models.policy import resolve

    out_root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="mixrl-bench-e2e-"))
    base = [f'model.path="{args.model}"', f"runtime.steps={args.steps}", f"rollout.prompts_per_step={args.prompts}",
            f"rollout.group_size={args.group_size}", "runtime.checkpoint_every=0",
            "runtime.eval.enabled=false", "observe.tensorboard=false", "observe.progress=false",
            *args.overrides]
    load_config(None, base)  # a bad --set fails here, before any run
    model_path = str(resolve(args.model))
    res: dict[str, Any] = {"steps": args.steps, "prompts_per_step": args.prompts, "group_size": args.group_size,
                           "model": args.model, "overrides": list(args.overrides)}
    mem.phase("sync")
    sync = run_mixrl(base, out_root / "sync", ['runtime.mode="sync"'])
    mem.phase("async")
    asyn = run_mixrl(base, out_root / "async", ['runtime.mode="async"'])
    mem.phase("publish")
    res["sync"], res["async"] = sync, asyn
    res["async_over_sync"] = asyn["samples_per_s"] / sync["samples_per_s"]
    res["trainer_idle_frac"] = asyn["trainer_idle_frac"]
    res["cpu_ceiling"] = cpu_ceiling(sync, asyn)
    copy_s = copy_time(model_path)
    mixed = measure_publish(base, model_path, None)
    plain = measure_publish(base, model_path, ["b200-bf16"])
    res["publish"] = {"mixed_fleet": mixed, "one_bf16_replica": plain, "in_sync_run_s": sync["publish_s"]}
    res["publish_s"], res["copy_s"] = mixed["publish_s"], copy_s
    res["publish_over_copy"] = mixed["publish_s"] / copy_s
    # the floor: one state-dict copy plus one quantization per format in the fleet
    res["publish_floor_s"] = copy_s + sum(mixed["quantize_s"].values())
    res["publish_over_floor"] = mixed["publish_s"] / res["publish_floor_s"]
    # the older definition, side by side: quantizations at this process's default thread count
    res["publish_floor_default_threads_s"] = copy_s + sum(mixed["quantize_s_default_threads"].values())
    res["publish_over_floor_default_threads"] = mixed["publish_s"] / res["publish_floor_default_threads_s"]
    # mixrl vs TRL: one fp32 replica (the trainer's own precision), single-turn task, same batch.
    max_new = 16
    single = ['env.name="reverse"', "env.options={}", f"rollout.max_new_tokens={max_new}",
              "rollout.max_total_tokens=64", 'loss.preset="grpo"',
              'fleet.groups=[{name="fp32", profile="fp32", replicas=1, min_replicas=1, max_replicas=1}]']
    if args.no_trl:
        res["trl"] = {"available": False, "reason": "skipped (--no-trl)"}
    else:
        # TRL is one process: give it its best torch thread count (mixrl's processes use every core)
        from mixrl.runtime.backends.embedded.slots import usable_cores
        mem.phase("trl")
        tries = [run_trl(model_path, args.steps, args.prompts, args.group_size, max_new, 1e-4, threads=t)
                 for t in sorted({1, usable_cores()})]
        res["trl"] = max(tries, key=lambda r: r.get("steps_per_s") or 0.0)
        res["trl_steps_per_s_by_threads"] = {r.get("threads"): r.get("steps_per_s") for r in tries}
    if res["trl"].get("available"):
        mem.phase("vs_trl")
        mine = run_mixrl(base, out_root / "vs-trl", [*single, "optim.lr=1e-4"])
        res["mixrl_single_turn"] = mine
        res["mixrl_over_trl"] = mine["steps_per_s"] / res["trl"]["steps_per_s"]
    else:
        res["mixrl_over_trl"] = None
    res["goals"] = {
        "async_over_sync>=1.6": res["async_over_sync"] >= 1.6,
        "trainer_idle_frac<=0.15": res["trainer_idle_frac"] <= 0.15,
        "mixrl_over_trl>=2": None if res["mixrl_over_trl"] is None else res["mixrl_over_trl"] >= 2,
        "publish_over_floor<=1.5": res["publish_over_floor"] <= 1.5,
    }
    res["load_avg"] = list(os.getloadavg())  # the machine is shared: ratios are side by side, but say how busy
    res["run_dirs"] = str(out_root)
    return res
