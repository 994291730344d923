"""Behaviour corrections: constraint 2, behaviour q vs reference p_old (docs/corrections.md section 6).

Each rule maps the behaviour log-ratios ``log ρ_t = log p_old(y_t) - log q(y_t)``
to a detached token weight and/or a per-sequence factor. They compose as

    w_t = w_tok(ρ_t) · f_seq(i(t))          token weight × sequence weights/masks

Masked or dropped tokens keep their place in the denominator D (the caller
forms D from ``loss_mask`` alone, section 9): masking removes a token's
gradient, it does not re-normalise the others. ``tests/corrections`` checks it.

To add a rule: write ``_rule(cfg, ctx) -> _Effect`` and register it in ``RULES``;
add its config class to ``mixrl.config.loss.Correction``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mixrl.corrections.ratios import clamp_log, seq_extreme, seq_log_ratio, seq_mean


@dataclass
class _Ctx:
    log_rho: Tensor  # [N] log p_old - log q, finite (0 at invalid positions), detached
    valid: Tensor  # [N] bool: generated, finite
    seq_ids: Tensor  # [N] long
    num_seqs: int  # S
    advantages: Tensor  # [N] detached
    clamp: float  # log-ratio clamp


@dataclass
class _Effect:
    token: Tensor | None = None  # [N] token weight
    seq: Tensor | None = None  # [S] sequence factor (0 = dropped)
    masked: Tensor | None = None  # [N] bool, token zeroed by a token mask
    truncated: Tensor | None = None  # [N] bool, weight truncated at a cap
    dropped: Tensor | None = None  # [S] bool, sequence dropped


@dataclass
class Behaviour:
    """Result of all rules; every tensor detached."""

    token_weight: Tensor  # [N] w_tok(ρ_t) (1 without a token rule)
    seq_weight: Tensor  # [N] f_seq of the token's sequence (1 without sequence rules)
    masked: Tensor  # [N] bool
    truncated: Tensor  # [N] bool
    seq_dropped: Tensor  # [S] bool

    @property
    def weight(self) -> Tensor:
        """The final per-token weight: the token rule's weight times its sequence's factor."""
        return self.token_weight * self.seq_weight  # [N]


def token_rule_weight(rule: Any, rho: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``w(ρ)`` of a token rule (``None``, tis, mis) on any shape; also used by SC for ``w(v)``.

    Returns ``(w, masked, truncated)``. ``tis``: ``min(ρ, C)``; ``mis``:
    ``ρ·1[lo <= ρ <= hi]`` (IcePop); no rule: ``1``.
    """
    false = torch.zeros_like(rho, dtype=torch.bool)
    if rule is None:
        return torch.ones_like(rho), false, false
    if rule.type == "tis":
        return rho.clamp_max(rule.cap), false, rho > rule.cap
    if rule.type == "mis":
        keep = (rho >= rule.lo) & (rho <= rule.hi)
        return torch.where(keep, rho, 0.0), ~keep, false
    raise ValueError(f"not a token rule: {rule.type!r}")


def _token(cfg: Any, ctx: _Ctx) -> _Effect:
    w, masked, truncated = token_rule_weight(cfg, torch.exp(clamp_log(ctx.log_rho, ctx.clamp)))
    return _Effect(token=w, masked=masked, truncated=truncated)


def _seq_ratio(ctx: _Ctx) -> tuple[Tensor, Tensor]:
    log_seq, log_geo = seq_log_ratio(ctx.log_rho, ctx.seq_ids, ctx.num_seqs, ctx.valid, ctx.clamp)
    return torch.exp(log_seq), torch.exp(log_geo)  # [S], [S]


def _seq_tis(cfg: Any, ctx: _Ctx) -> _Effect:
    rho_i, _ = _seq_ratio(ctx)
    return _Effect(seq=rho_i.clamp_max(cfg.cap), truncated=(rho_i > cfg.cap)[ctx.seq_ids])


def _seq_mis(cfg: Any, ctx: _Ctx) -> _Effect:
    rho_i, _ = _seq_ratio(ctx)
    keep = (rho_i >= cfg.lo) & (rho_i <= cfg.hi)
    return _Effect(seq=torch.where(keep, rho_i, 0.0), dropped=~keep)


def _geo_mask(cfg: Any, ctx: _Ctx) -> _Effect:
    _, geo = _seq_ratio(ctx)
    keep = (geo >= cfg.lo) & (geo <= cfg.hi)
    kept_weight = geo if cfg.weight == "ratio" else torch.ones_like(geo)
    return _Effect(seq=torch.where(keep, kept_weight, 0.0), dropped=~keep)


def _veto(cfg: Any, ctx: _Ctx) -> _Effect:
    # compared in log space: min_t ρ_t < τ  <=>  min_t log ρ_t < log τ
    lo = seq_extreme(ctx.log_rho, ctx.seq_ids, ctx.num_seqs, ctx.valid, "amin")
    drop = lo < math.log(cfg.tau)
    if cfg.tau_hi is not None:
        hi = seq_extreme(ctx.log_rho, ctx.seq_ids, ctx.num_seqs, ctx.valid, "amax")
        drop = drop | (hi > math.log(cfg.tau_hi))
    return _Effect(seq=(~drop).to(ctx.log_rho.dtype), dropped=drop)


def _opsm(cfg: Any, ctx: _Ctx) -> _Effect:
    # mean_t (log q - log p_old) = -mean_t log ρ_t: the sequence's k1 estimate of KL(q || p_old)
    kl = -seq_mean(ctx.log_rho, ctx.seq_ids, ctx.num_seqs, ctx.valid)  # [S]
    adv = seq_mean(ctx.advantages, ctx.seq_ids, ctx.num_seqs, ctx.valid)  # [S] A_i
    drop = (adv < 0) & (kl > cfg.delta)
    return _Effect(seq=(~drop).to(ctx.log_rho.dtype), dropped=drop)


RULES: dict[str, Callable[[Any, _Ctx], _Effect]] = {
    "tis": _token,
    "mis": _token,
    "seq_tis": _seq_tis,
    "seq_mis": _seq_mis,
    "geo_mask": _geo_mask,
    "veto": _veto,
    "opsm": _opsm,
}


def apply_corrections(
    corrections: list[Any],
    log_rho: Tensor,
    valid: Tensor,
    seq_ids: Tensor,
    num_seqs: int,
    advantages: Tensor,
    clamp: float,
) -> Behaviour:
    """Compose the configured rules into one :class:`Behaviour` (all [N] / [S], detached).

    ``log_rho`` [N] must already be finite (0) at invalid positions; invalid
    positions never influence a sequence statistic.
    """
    ctx = _Ctx(log_rho.detach(), valid, seq_ids, num_seqs, advantages.detach(), clamp)
    n_ones = torch.ones_like(ctx.log_rho)
    token, seq = n_ones, n_ones.new_ones(num_seqs)
    masked = torch.zeros_like(valid)
    truncated = torch.zeros_like(valid)
    dropped = torch.zeros(num_seqs, dtype=torch.bool, device=valid.device)
    for cfg in corrections:
        if cfg.type not in RULES:
            raise ValueError(f"unknown correction type {cfg.type!r}; known: {sorted(RULES)}")
        eff = RULES[cfg.type](cfg, ctx)
        token = token * eff.token if eff.token is not None else token
        seq = seq * eff.seq if eff.seq is not None else seq
        masked = masked | eff.masked if eff.masked is not None else masked
        truncated = truncated | eff.truncated if eff.truncated is not None else truncated
        dropped = dropped | eff.dropped if eff.dropped is not None else dropped
    return Behaviour(token, seq[seq_ids], masked & valid, truncated & valid, dropped)
