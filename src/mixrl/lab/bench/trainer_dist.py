"""``mixrl bench trainer`` measurements for FSDP2 ranks and LoRA (``--only fsdp,lora``).

Both feed the trainer ``mixrl train`` builds the calculator trajectories the
bench sampled (``bench.trainer``), side by side in one invocation:

- ``fsdp``: the same ``--fsdp-steps`` updates of ``--fsdp-batch`` trajectories
  through one in-process trainer and through 2 FSDP2 ranks (gloo, spawned
  processes). ``fsdp_max_abs_diff`` is the largest parameter difference after
  them (goal <= 1e-5); ``fsdp_param_mem_ratio`` is the larger rank's
  parameter-shard + AdamW-state bytes over the single trainer's (goal <= 0.6);
  ``fsdp_update_max_abs`` shows how far the updates moved the weights.
- ``lora``: a full fine-tuning trainer and a ``[trainer.lora]`` trainer (rank
  16, alpha 32, attention projections) from the same weights, timed
  alternately (median of ``--repeats`` after one warm-up each):
  ``lora_trainable_frac`` (adapter parameters over the base model's) and
  ``lora_step_over_full`` (step time ratio; report only).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any


def run_config(model_path: str, budget: int | None, packing: bool, seed: int, threads: int) -> Any:
    """The demo's run config with the trainer settings under test."""
    from mixrl.config import load_config

    sets = [f'model.path="{model_path}"', f"runtime.seed={seed}", f"runtime.torch_threads={threads}",
            f"optim.packing={'true' if packing else 'false'}"]
    if budget is not None:
        sets.append(f"optim.micro_batch_tokens={budget}")
    return load_config(None, sets)


def batch_of(data: list[dict[str, Any]], n: int, seed: int) -> tuple[list[Any], list[float]]:
    """``n`` trajectories (the sampled ones, repeated) and seeded advantages."""
    import torch

    from mixrl.records.trajectory import Trajectory

    trajs = [Trajectory.from_dict(data[i % len(data)]) for i in range(n)]
    for i, t in enumerate(trajs):  # repeats are new groups
        t.prompt_id = f"{t.prompt_id}/{i // len(data)}"
    adv = torch.randn(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return trajs, adv


def measure_fsdp(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    from mixrl.runtime.ranks import LocalRanks
    from mixrl.runtime.run import resolve_loss
    from mixrl.runtime.trainer_state import build_trainer

    steps, n = getattr(args, "fsdp_steps", 3), getattr(args, "fsdp_batch", 16)
    cfg = run_config(args.model, args.budget, True, args.seed, args.threads)
    with tempfile.TemporaryDirectory(prefix="mixrl-bench-fsdp-") as tmp:
        cfg.observe.run_dir = tmp
        loss_cfg, _ = resolve_loss(cfg)
        single = build_trainer(cfg, args.model, loss_cfg)[0]
        start = single.state_dict_for_samplers()
        cfg2 = cfg.model_copy(deep=True)
        cfg2.trainer.world_size = 2
        batches = [batch_of(data["episodes"], n, args.seed + s) for s in range(steps)]

        async def two_ranks() -> tuple[dict[str, Any], list[int], float]:
            ranks = await LocalRanks(cfg2, args.model, loss_cfg).started()
            try:
                t0 = time.perf_counter()
                for trajs, adv in batches:
                    await ranks.step(trajs, adv)
                dt = time.perf_counter() - t0
                return await ranks.weights(), ranks.call("memory_bytes"), dt
            finally:
                await ranks.close()

        t0 = time.perf_counter()
        for trajs, adv in batches:
            single.step(trajs, adv)
        dt1 = time.perf_counter() - t0
        w2, mem, dt2 = asyncio.run(two_ranks())
    w1 = single.state_dict_for_samplers()
    diff = max(float((w1[k].double() - w2[k].double()).abs().max()) for k in w1)
    moved = max(float((w1[k].double() - start[k].double()).abs().max()) for k in w1)
    mem1 = sum(p.numel() * p.element_size() for p in single.model.parameters())
    for st in single.optimizer.state.values():
        mem1 += sum(v.numel() * v.element_size() for v in st.values() if hasattr(v, "dim") and v.dim() > 0)
    return {"fsdp_max_abs_diff": diff, "fsdp_update_max_abs": moved, "fsdp_param_mem_ratio": max(mem) / mem1,
            "fsdp_rank_param_optim_mb": [round(m / 2**20, 3) for m in mem], "fsdp_single_param_optim_mb": round(mem1 / 2**20, 3),
            "fsdp_steps": steps, "fsdp_batch": n, "fsdp_steps_s_1rank": dt1, "fsdp_steps_s_2ranks": dt2}


def measure_lora(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    from mixrl.config import LoraConfig
    from mixrl.runtime.run import resolve_loss
    from mixrl.runtime.trainer_state import build_trainer

    full_cfg = run_config(args.model, args.budget, True, args.seed, args.threads)
    lora_cfg = full_cfg.model_copy(deep=True)
    lora_cfg.trainer.lora = LoraConfig()
    loss_cfg, _ = resolve_loss(full_cfg)
    trainers = {"full": build_trainer(full_cfg, args.model, loss_cfg)[0],
                "lora": build_trainer(lora_cfg, args.model, loss_cfg)[0]}
    trajs, adv = batch_of(data["episodes"], args.batch, args.seed)
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for rep in range(args.repeats + 1):  # the first round is the warm-up
        for name, tr in trainers.items():
            t0 = time.perf_counter()
            tr.step(trajs, adv)
            if rep:
                times[name].append(time.perf_counter() - t0)
    lt = trainers["lora"]
    adapters = sum(p.numel() for p in lt.params)
    base = sum(p.numel() for n, p in lt.model.named_parameters() if ".lora_" not in n)
    full_s, lora_s = statistics.median(times["full"]), statistics.median(times["lora"])
    return {"lora_trainable_frac": adapters / base, "lora_trainable_params": adapters,
            "lora_step_s": lora_s, "full_step_s": full_s, "lora_step_over_full": lora_s / full_s,
            "lora_batch": args.batch}
