"""Regularizers added to the policy loss: KL to the initial policy, entropy bonus (docs/corrections.md section 13).

Both are per-token surrogates ``ℓ_t`` aggregated like the policy term, over the
same valid tokens, with the same per-token scale and the caller's denominator D:
``loss += Σ_t m_t s_t ℓ_t / D``.

Reference KL (``loss.ref_kl = {coef, estimator}``), ``d_t = log p_ref(y_t) − log p_θ(y_t)``
clamped to ±``log_ratio_clamp``:

    k3   ℓ_t = coef · (e^{d_t} − d_t − 1)          GRPO (arXiv 2402.03300 eq. 4); value ≥ 0;
                                                    E_{y~p_θ}[∇ℓ] = coef · ∇KL(p_ref ‖ p_θ)
    k1   ℓ_t = coef · sg(−d_t) · log p_θ(y_t)      score-function form: E_{y~p_θ}[∇ℓ] = coef · ∇KL(p_θ ‖ p_ref)
                                                    (a plain k1 loss −d_t has zero expected gradient)

Entropy bonus (``loss.entropy_coef``): the trainer's entropy ``H_t`` is computed
without ``[N, V]`` logits and carries no gradient, so the bonus uses the
score-function identity ``∇H = −E_{y~p}[(log p(y) + H) ∇log p(y)]``:

    ℓ_t = coef · sg(log p_θ(y_t) + H_t) · log p_θ(y_t)      E_{y~p_θ}[∇ℓ] = −coef · ∇H

Assumption and edge cases: the expectations hold for ``y ~ p_θ``; tokens come
from ``q``, which is close to ``p_θ`` by construction (the corrections measure
how close), so both are estimates off-policy. A non-finite reference log-prob
makes the token invalid for the penalty only (masked and counted in
``reg/nonfinite_ref``). With support replay ``log p_θ`` is the renormalised
``p̃`` and so is ``p_ref`` (the trainer replays the same support).

Metrics: ``reg/ref_kl`` (the mean of the chosen estimator's value: k3, or k1
``log p_θ − log p_ref``), ``reg/entropy`` (mean H over the tokens) and the
two weighted terms ``reg/ref_kl_loss``, ``reg/entropy_loss``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mixrl.corrections.metrics import masked_mean
from mixrl.corrections.ratios import clamp_log

if TYPE_CHECKING:
    from mixrl.config.loss import LossConfig


def ref_kl_surrogate(lp: Tensor, ref_lp: Tensor, estimator: str, clamp: float) -> tuple[Tensor, Tensor]:
    """Per-token (surrogate ℓ/coef [N], estimator value [N]); ``lp`` carries the gradient."""
    d = clamp_log(ref_lp.detach() - lp, clamp)  # [N] log(p_ref / p_θ)
    if estimator == "k3":
        k3 = torch.exp(d) - d - 1.0
        return k3, k3.detach()
    if estimator == "k1":
        k1 = (-d).detach()  # log p_θ − log p_ref
        return k1 * lp, k1
    raise ValueError(f"ref_kl estimator {estimator!r} is not one of ('k1', 'k3')")


def entropy_surrogate(lp: Tensor, entropy: Tensor) -> Tensor:
    """Per-token surrogate [N] whose expected gradient under ``y ~ p_θ`` is ``−∇H``."""
    return (lp.detach() + entropy.detach()) * lp


def regularizer_loss(
    cfg: LossConfig, lp: Tensor, ref_lp: Tensor | None, entropy: Tensor | None,
    valid: Tensor, factor: Tensor, denom: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``Σ_t factor_t ℓ_t / D`` of the enabled regularizers (a 0-d tensor) and their metrics.

    ``factor`` [N] is the per-token aggregation scale times ``valid``; ``lp`` [N]
    the finite trainer log-probs (0 where invalid).
    """
    total = lp.new_zeros(())
    metrics: dict[str, Tensor] = {}
    d = max(denom, 0.0)
    if cfg.ref_kl is not None:
        if ref_lp is None:
            raise ValueError("loss.ref_kl is set but LossInputs.ref_logprobs is None")
        ok = valid & torch.isfinite(ref_lp.detach())
        ref = torch.where(ok, ref_lp.detach().to(lp.dtype), lp.detach())
        sur, value = ref_kl_surrogate(lp, ref, cfg.ref_kl.estimator, cfg.log_ratio_clamp)
        term = cfg.ref_kl.coef * (torch.where(ok, sur, 0.0) * factor).sum()
        total = total + (term / d if d > 0 else term * 0.0)
        metrics["reg/ref_kl"] = masked_mean(torch.where(ok, value, 0.0), ok)
        metrics["reg/ref_kl_loss"] = (term / d if d > 0 else term * 0.0).detach()
        metrics["reg/nonfinite_ref"] = (valid & ~ok).sum()
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("loss.entropy_coef > 0 but LossInputs.entropy is None")
        ok = valid & torch.isfinite(entropy.detach())
        ent = torch.where(ok, entropy.detach().to(lp.dtype), 0.0)
        term = cfg.entropy_coef * (torch.where(ok, entropy_surrogate(lp, ent), 0.0) * factor).sum()
        total = total + (term / d if d > 0 else term * 0.0)
        metrics["reg/entropy"] = masked_mean(ent, ok)
        metrics["reg/entropy_loss"] = (term / d if d > 0 else term * 0.0).detach()
    return total, metrics
