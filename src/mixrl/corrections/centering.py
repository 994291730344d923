"""Score centering (docs/corrections.md section 7; arXiv:2609.20807).

At each position t the weighted score is centred by its expectation under q:

    ĝ_t = A_t ( w(y_t) ∇log p_θ(y_t) − Σ_v c_t(v) ∇log p_θ(v) ),   c_t(v) = q(v) w(v)

This module returns the centring surrogate ``Σ_v sg(c_t(v)) log p_θ(v)`` [N];
the loss subtracts ``A_t`` times it. ``w`` is the token rule's weight
(none / tis / mis) evaluated at each candidate's own ratio ``ρ(v) = p_old(v)/q(v)``.

**support** (exact): ``q`` is recorded on the whole support ``S_t`` and
``log p_θ`` is the replayed ``p̃``; the sum is the exact expectation.

**head** (modelled tail): ``q`` is known on the head ``H_t`` only. With
``q(v) ≈ κ_t p(v)`` off the head, ``κ_t = (1 − q(H_t)) / (1 − p(H_t))``, every tail
token has ratio ``1/κ_t`` and, since ``Σ_{v∉H} ∇p(v) = −Σ_{v∈H} ∇p(v)``,

    Σ_v c_t(v) ∇log p(v) = Σ_{v∈H} ( q(v) w(v) − α_t p(v) ) ∇log p(v),   α_t = κ_t w(1/κ_t)

The coefficient uses ``p = p_old`` (the point where the gradient is taken:
one step per batch). ``1 − q(H)`` and ``1 − p(H)`` are formed in float64 and
clamped below at ``tail_eps``: when the head holds (almost) all of both
distributions, κ_t → 1 and the tail term (of size ~ α_t·p(tail)) vanishes.
Requires temperature 1 and no top-p/top-k at sampling time (else use support replay).

Edge cases: a position with no candidates centres by 0 (plain PG there); a
position whose candidates hold a non-finite value is invalid upstream
(``candidate_validity``) and contributes nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mixrl.corrections.behaviour import token_rule_weight
from mixrl.corrections.ratios import clamp_log, segment_sum


def candidate_validity(cand_offsets: Tensor, *cand_values: Tensor) -> tuple[Tensor, Tensor]:
    """``(cand_ok [K] bool, position_ok [N] bool)``: all candidate values finite.

    A position is not OK when any of its candidates has a NaN/±inf entry. The
    values are log-probabilities (<= 0 when finite), so their sum is finite
    exactly when each one is: one ``isfinite`` instead of one per input.
    """
    total = cand_values[0]
    for v in cand_values[1:]:
        total = total + v
    cand_ok = torch.isfinite(total)  # [K]
    bad = segment_sum((~cand_ok).to(total.dtype), cand_offsets)  # [N] non-finite candidates
    return cand_ok, bad == 0


def centering_coefficients(
    kind: str,
    rule: Any,
    cand_offsets: Tensor,
    cand_pos: Tensor,
    cand_old: Tensor,
    cand_sampler: Tensor,
    *,
    clamp: float,
    tail_eps: float,
) -> Tensor:
    """Detached coefficients ``c`` [K] with ``Σ_k c_k ∇log p_θ(v_k)`` = the centring gradient.

    ``cand_old``/``cand_sampler`` [K] must be finite; ``cand_pos`` [K] is each
    candidate's position. ``kind`` is "support" (exact) or "head" (tail
    modelled, coefficient ``q w − α p``).
    """
    cand_old, cand_sampler = cand_old.detach(), cand_sampler.detach()
    rho_v = torch.exp(clamp_log(cand_old - cand_sampler, clamp))  # [K] ρ(v)
    w_v, _, _ = token_rule_weight(rule, rho_v)  # [K] w(v)
    coeff = torch.exp(cand_sampler) * w_v  # [K] q(v) w(v)
    if kind == "support":
        return coeff
    if kind != "head":
        raise ValueError(f"score centering needs cand_kind 'support' or 'head', got {kind!r}")
    f64 = torch.float64
    q_head = segment_sum(torch.exp(cand_sampler.to(f64)), cand_offsets)  # [N] q(H_t)
    p_head = segment_sum(torch.exp(cand_old.to(f64)), cand_offsets)  # [N] p(H_t)
    kappa = (1.0 - q_head).clamp_min(tail_eps) / (1.0 - p_head).clamp_min(tail_eps)  # [N] κ_t
    w_tail, _, _ = token_rule_weight(rule, 1.0 / kappa)  # [N] w(1/κ_t)
    alpha = (kappa * w_tail).to(coeff.dtype)  # [N] α_t
    return coeff - alpha[cand_pos] * torch.exp(cand_old)  # [K] q w − α p


def centering_term(
    coeff: Tensor, cand_trainer: Tensor, cand_offsets: Tensor, cand_ok: Tensor
) -> Tensor:
    """Surrogate ``Σ_{v∈cands(t)} sg(c_t(v)) log p_θ(v)`` per position, [N] (carries grad).

    Non-finite candidates are replaced before the product so that neither the
    value nor the gradient ever sees a NaN (a NaN times 0 is still NaN).
    """
    safe = torch.where(cand_ok, cand_trainer, 0.0)  # [K]
    c = torch.where(cand_ok, coeff.detach(), 0.0).to(safe.dtype)
    return segment_sum(c * safe, cand_offsets)
