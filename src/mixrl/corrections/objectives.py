"""Base objectives: constraint 1, target p_θ vs reference p_old (docs/corrections.md section 5).

Each objective returns the per-token surrogate ``g_t`` [N] (its gradient is the
update direction; the loss is ``-Σ m_t w_t g_t / D``) and a bool [N] telling
which tokens were clipped (their gradient is 0 or frozen), for metrics.

    pg        g_t = A_t log p_θ(y_t)                              (REINFORCE, one step per batch)
    ppo_clip  g_t = min(r_t A_t, clip(r_t, 1-ε_lo, 1+ε_hi) A_t)    arXiv 1707.06347 eq. 7
              dual clip (arXiv 1912.09729 eq. 6): g_t = max(g_t, c A_t) where A_t < 0
    gspo      s_i = exp(mean_t log r_t) (arXiv 2507.18071 eq. 7), token form
              s_{i,t} = sg(s_i) p_θ(y_t)/sg(p_θ(y_t)), clipped like ppo_clip
    cispo     g_t = sg(clip(r_t, 1-ε_lo, 1+ε_hi)) A_t log p_θ(y_t)  arXiv 2506.13585 eq. 4

At ``p_θ == p_old`` (one step per batch) ``r_t = 1`` and every objective has
the gradient of ``pg``; they differ only after the first step of an epoch.

To add one: write ``_name(cfg, x) -> (g, clipped)`` and register it in ``OBJECTIVES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mixrl.corrections.ratios import clamp_log, seq_mean


@dataclass
class ObjectiveInputs:
    """What every base objective reads, per generated token (fields in the comments)."""

    logp: Tensor  # [N] log p_θ(y_t), carries grad, finite (0 at invalid positions)
    old_logp: Tensor  # [N] log p_old(y_t), detached, finite
    advantages: Tensor  # [N] A_t, detached, finite
    valid: Tensor  # [N] bool
    seq_ids: Tensor  # [N] long
    num_seqs: int  # S
    clamp: float  # log-ratio clamp


def _clipped_surrogate(
    ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    g = torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)  # [N]
    clipped = ((ratio > hi) & (adv > 0)) | ((ratio < lo) & (adv < 0))
    return g, clipped


def _pg(cfg: Any, x: ObjectiveInputs) -> tuple[Tensor, Tensor]:
    return x.advantages * x.logp, torch.zeros_like(x.valid)


def _ppo_clip(cfg: Any, x: ObjectiveInputs) -> tuple[Tensor, Tensor]:
    r = torch.exp(clamp_log(x.logp - x.old_logp, x.clamp))  # [N]
    g, clipped = _clipped_surrogate(r, x.advantages, cfg.eps_low, cfg.eps_high)
    if cfg.dual_clip is not None:
        floor = cfg.dual_clip * x.advantages  # [N] lower bound c·A for A < 0
        dual = (x.advantages < 0) & (g < floor)
        g = torch.where(dual, floor, g)
        clipped = clipped | dual
    return g, clipped


def _gspo(cfg: Any, x: ObjectiveInputs) -> tuple[Tensor, Tensor]:
    log_r = (x.logp - x.old_logp).detach()  # [N]
    log_s = clamp_log(seq_mean(log_r, x.seq_ids, x.num_seqs, x.valid), x.clamp)  # [S]
    # value sg(s_i), gradient s_i ∇log p_θ(y_t): the GSPO-token form
    s_tok = torch.exp(log_s[x.seq_ids] + x.logp - x.logp.detach())  # [N]
    return _clipped_surrogate(s_tok, x.advantages, cfg.eps_low, cfg.eps_high)


def _cispo(cfg: Any, x: ObjectiveInputs) -> tuple[Tensor, Tensor]:
    r = torch.exp(clamp_log(x.logp - x.old_logp, x.clamp)).detach()  # [N]
    lo = None if cfg.eps_low is None else 1.0 - cfg.eps_low
    w = r.clamp(min=lo, max=1.0 + cfg.eps_high)
    clipped = r > 1.0 + cfg.eps_high
    if lo is not None:
        clipped = clipped | (r < lo)
    return w * x.advantages * x.logp, clipped


OBJECTIVES: dict[str, Callable[[Any, ObjectiveInputs], tuple[Tensor, Tensor]]] = {
    "pg": _pg,
    "ppo_clip": _ppo_clip,
    "gspo": _gspo,
    "cispo": _cispo,
}


def surrogate(cfg: Any, x: ObjectiveInputs) -> tuple[Tensor, Tensor]:
    """``(g [N], clipped [N] bool)`` of the objective named by ``cfg.type``."""
    if cfg.type not in OBJECTIVES:
        raise ValueError(f"unknown objective type {cfg.type!r}; known: {sorted(OBJECTIVES)}")
    return OBJECTIVES[cfg.type](cfg, x)
