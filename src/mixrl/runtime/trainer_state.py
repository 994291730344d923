"""Building the trainer from a run config (both backends; the Ray trainer actor and each
rank call it in their own process). What a built trainer offers a backend is
``mixrl.train.surface.TrainerSurface``."""

from __future__ import annotations

import random
from typing import Any

from mixrl.config import RunConfig
from mixrl.models.policy import load_policy
from mixrl.train.schedule import lr_factor
from mixrl.train.trainer import Trainer


def build_trainer(cfg: RunConfig, model_path: str, loss_cfg: Any, factory: Any = None, **extra: Any) -> tuple[Any, Any]:
    """(Trainer, tokenizer) for ``cfg`` starting from the policy at ``model_path``.

    ``factory`` replaces the ``Trainer`` class (``RankTrainer`` on FSDP2 ranks, with
    its ``extra`` keywords); ``[trainer.lora]`` wraps the model in peft adapters first.
    """
    import torch


    torch.set_num_threads(cfg.runtime.torch_threads)
    torch.manual_seed(cfg.runtime.seed)
    random.seed(cfg.runtime.seed)
    model, tok = load_policy(model_path, device=extra.get("device"), precision=cfg.optim.precision)
    if cfg.trainer.lora is not None:
        from mixrl.train.lora import LoraTrainer, apply_lora

        model = apply_lora(model, cfg.trainer.lora)
        factory = factory or LoraTrainer
    o = cfg.optim
    trainer = (factory or Trainer)(
        model,
        loss_cfg,
        seed=cfg.runtime.seed,
        pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
        lr=o.lr,
        weight_decay=o.weight_decay,
        grad_clip=o.grad_clip,
        precision=o.precision,
        epochs=o.epochs,
        minibatches=o.minibatches,
        micro_batch_tokens=o.micro_batch_tokens,
        forward_micro_batch_tokens=o.forward_micro_batch_tokens,
        packing=o.packing,
        share_prefix=o.share_prefix,
        temperature=cfg.rollout.temperature,
        max_malformed_frac=0.5,  # a step that drops more than half its batch fails the run
        gen_budget=generation_budget(cfg),
        lr_schedule=lr_schedule(cfg),
        **extra,
    )
    return trainer, tok


def lr_schedule(cfg: RunConfig) -> Any:
    """``optim.schedule`` as a function of the update index (None: constant lr, no warm-up)."""
    import functools


    o = cfg.optim
    if o.schedule == "constant" and o.warmup_steps == 0:
        return None
    return functools.partial(lr_factor, schedule=o.schedule, total=cfg.runtime.steps,
                             warmup=o.warmup_steps, min_ratio=o.min_lr_ratio)


def generation_budget(cfg: RunConfig) -> int:
    """Most tokens one episode can generate: the Dr. GRPO ``max_len`` (docs/corrections.md section 9).

    ``rollout.max_total_tokens`` caps prompt + generated + tool tokens; with a
    ``max_turns`` env option, ``max_turns * rollout.max_new_tokens`` caps it too.
    """
    turns = cfg.env.options.get("max_turns")
    budget = cfg.rollout.max_total_tokens
    if isinstance(turns, int) and turns > 0:
        budget = min(budget, turns * cfg.rollout.max_new_tokens)
    return budget
