"""The loss: objective × behaviour corrections (+ score centering) over a caller's D.

    loss = −(1/D) Σ_t m_t · s_t · f_seq(i) · [ w_tok(ρ_t) g_t − A_t Σ_v sg(c_t(v)) log p_θ(v) ]
                                                              └──── only with score centering

``m_t`` is the validity mask (generated and finite), ``s_t`` the aggregation's
per-token scale (1/L_i for ``seq_mean_token_mean``, else 1), ``f_seq`` the
sequence weights/masks, ``g_t`` the objective (section 5) and the bracket's
second term the centring of section 7. The optional regularizers of section 13
(KL to the initial policy, entropy bonus) are added over the same tokens, scale
and D (``mixrl.corrections.regularizers``).

Non-finite inputs (section 4): a position with a NaN/±inf trainer, old or
sampler log-prob, advantage, or candidate value is a data error. It is
replaced by 0 *before* any arithmetic (a NaN multiplied by a 0 mask is still
NaN, and so would be its gradient), excluded from every statistic, and
counted in ``corr/nonfinite_tokens``. It still counts in D (section 9). An
all-masked or empty batch returns a zero that is still attached to the graph,
so a distributed backward never waits on a rank that skipped it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mixrl.corrections.aggregation import token_scale
from mixrl.corrections.behaviour import Behaviour, apply_corrections
from mixrl.corrections.centering import candidate_validity, centering_coefficients, centering_term
from mixrl.corrections.metrics import collect_mismatch, drop_empty_splits, masked_mean, to_floats
from mixrl.corrections.objectives import ObjectiveInputs, surrogate
from mixrl.corrections.ratios import candidate_positions, clamp_log
from mixrl.corrections.regularizers import regularizer_loss
from mixrl.corrections.types import LossInputs

if TYPE_CHECKING:
    from mixrl.config.loss import LossConfig


def _zeros_where(mask: Tensor, x: Tensor) -> Tensor:
    return torch.where(mask, x, 0.0)


def _centering(
    inputs: LossInputs, cfg: LossConfig, cand_ok: Tensor | None, dt: torch.dtype
) -> Tensor:
    """Σ_v sg(c_t(v)) log p_θ(v) per position [N] over finite candidates (section 7)."""
    off, c_lp = inputs.cand_offsets, inputs.cand_trainer_logprobs
    c_old, c_q = inputs.cand_old_logprobs, inputs.cand_sampler_logprobs
    assert off is not None and c_lp is not None and c_old is not None and c_q is not None
    assert cand_ok is not None
    c_old = torch.where(cand_ok, c_old.detach().to(dt), 0.0)  # [K]
    c_q = torch.where(cand_ok, c_q.detach().to(dt), 0.0)  # [K]
    # positions of candidates: only the head form gathers a per-position α_t
    pos = candidate_positions(off, c_lp.shape[0]) if inputs.cand_kind == "head" else off[:0]
    rule = cfg.token_weight()
    coeff = centering_coefficients(
        inputs.cand_kind,
        rule,
        off,
        pos,
        c_old,
        c_q,
        clamp=cfg.log_ratio_clamp,
        tail_eps=cfg.tail_eps,
    )
    return centering_term(coeff, c_lp.to(dt), off, cand_ok)


def compute_loss(
    inputs: LossInputs, cfg: LossConfig, denom: float | Tensor
) -> tuple[Tensor, dict[str, float]]:
    """Scalar loss (to minimise) and the section 10 metrics of one (micro-)batch.

    ``denom`` is D from :func:`aggregation_denominator` over the whole optimizer
    batch (must be ≥ 0 and finite; D = 0 means nothing to train on and yields
    an attached zero). Raises ``ValueError`` on inconsistent inputs or when the
    config needs candidates the batch does not carry.
    """
    d_val = _checked_denominator(inputs, cfg, denom)
    clamp = cfg.log_ratio_clamp
    lp_raw = inputs.trainer_logprobs
    valid, cand_ok = _valid_tokens(inputs)  # [N], [K] or None

    # finite copies, in float32 at least (a bf16 ratio would carry ~1e-2 of rounding,
    # more than the mismatch being corrected); only lp carries the gradient
    dt = torch.promote_types(lp_raw.dtype, torch.float32)
    lp = _zeros_where(valid, lp_raw.to(dt))  # [N]
    old = _zeros_where(valid, inputs.old_logprobs.detach().to(dt))  # [N]
    lq = _zeros_where(valid, inputs.sampler_logprobs.detach().to(dt))  # [N]
    adv = _zeros_where(valid, inputs.advantages.detach().to(dt))  # [N]

    beh = apply_corrections(
        cfg.corrections, old - lq, valid, inputs.seq_ids, inputs.num_seqs, adv, clamp
    )
    x = ObjectiveInputs(lp, old, adv, valid, inputs.seq_ids, inputs.num_seqs, clamp)
    g, clipped = surrogate(cfg.objective, x)  # [N]
    per_token = beh.token_weight * g  # [N]
    if cfg.score_centering:
        per_token = per_token - adv * _centering(inputs, cfg, cand_ok, dt)
    factor = beh.seq_weight * valid.to(dt)  # [N]
    scale = token_scale(cfg.aggregation, inputs.loss_mask, inputs.seq_ids, inputs.num_seqs, dt)
    if scale is not None:
        factor = factor * scale
    total = -(per_token * factor).sum()
    if d_val == 0:  # nothing to train on: an attached zero (total is 0 or finite here)
        loss = total * 0.0
    else:
        loss = total / (
            denom.to(device=total.device, dtype=dt) if isinstance(denom, Tensor) else d_val
        )

    reg_metrics: dict[str, Tensor] = {}
    if cfg.ref_kl is not None or cfg.entropy_coef > 0:  # section 13; same tokens, scale and D
        reg_factor = valid.to(dt) if scale is None else valid.to(dt) * scale
        reg, reg_metrics = regularizer_loss(
            cfg, lp, inputs.ref_logprobs, inputs.entropy, valid, reg_factor, d_val
        )
        loss = loss + reg

    with torch.no_grad():
        metrics = collect_mismatch(inputs, valid, clamp)
        metrics.update(reg_metrics)
        metrics.update(_correction_metrics(inputs, valid, beh, clipped, lp.detach(), old, lq, clamp))
    return loss, drop_empty_splits(to_floats(metrics))


def _checked_denominator(inputs: LossInputs, cfg: LossConfig, denom: float | Tensor) -> float:
    """``denom`` as a float, after the input and candidate-kind checks; ``ValueError`` if any fails."""
    inputs.validate()
    if cfg.score_centering and inputs.cand_kind == "none":
        raise ValueError(
            "score_centering=True needs candidates of q, but LossInputs.cand_kind is 'none'"
        )
    if cfg.support_replay and inputs.cand_kind != "support":
        raise ValueError(f"support_replay=True needs cand_kind 'support', got {inputs.cand_kind!r}")
    d_val = float(denom)  # one host sync when D arrives as a tensor
    if not math.isfinite(d_val) or d_val < 0:
        raise ValueError(f"denom must be a finite number >= 0, got {d_val}")
    return d_val


def _valid_tokens(inputs: LossInputs) -> tuple[Tensor, Tensor | None]:
    """Loss tokens whose log-probs, advantage (and candidates) are all finite; candidate validity."""
    valid = inputs.loss_mask.clone()  # [N]
    for t in (inputs.trainer_logprobs, inputs.old_logprobs, inputs.sampler_logprobs, inputs.advantages):
        valid &= torch.isfinite(t.detach())
    cand_ok = None
    if inputs.has_candidates:
        assert inputs.cand_offsets is not None and inputs.cand_trainer_logprobs is not None
        assert inputs.cand_old_logprobs is not None and inputs.cand_sampler_logprobs is not None
        cand_ok, pos_ok = candidate_validity(
            inputs.cand_offsets,
            inputs.cand_trainer_logprobs.detach(),
            inputs.cand_old_logprobs,
            inputs.cand_sampler_logprobs,
        )  # [K], [N]
        valid &= pos_ok
    return valid, cand_ok


def _correction_metrics(inputs: LossInputs, valid: Tensor, beh: Behaviour, clipped: Tensor, lp: Tensor,
                        old: Tensor, lq: Tensor, clamp: float) -> dict[str, Tensor]:
    """The policy/ and corr/ metrics of one batch (no gradient); ``lp`` detached, all [N]."""
    dt = lp.dtype
    metrics: dict[str, Tensor] = {}
    w = beh.weight * valid.to(dt)  # [N] final behaviour weights
    n_valid = valid.sum().clamp_min(1)
    metrics["policy/tv"] = masked_mean(
        0.5 * (1.0 - torch.exp(clamp_log(lp.detach() - old, clamp))).abs(), valid
    )
    metrics["policy/clip_frac"] = masked_mean(clipped.to(dt), valid)
    metrics["corr/masked_frac"] = masked_mean(beh.masked.to(dt), valid)
    metrics["corr/truncated_frac"] = masked_mean(beh.truncated.to(dt), valid)
    has_tok = (
        valid.new_zeros(inputs.num_seqs, dtype=torch.int64).index_add(
            0, inputs.seq_ids, valid.long()
        )
        > 0
    )
    metrics["corr/seq_dropped_frac"] = masked_mean(beh.seq_dropped.to(dt), has_tok)
    # ESS is scale-free: divide by max w first, so (Σw)² and Σw² stay finite in float32
    wn = w / w.amax().clamp_min(1e-30) if w.numel() else w
    metrics["corr/ess"] = wn.sum() ** 2 / (n_valid * (wn * wn).sum()).clamp_min(1e-30)
    # the ±clamp zeroes the gradient of a token whose log-ratio is beyond it: count them
    beyond = ((old - lq).abs() > clamp) | ((lp.detach() - old).abs() > clamp)
    metrics["corr/clamped_tokens"] = (beyond & valid).sum()
    metrics["corr/nonfinite_tokens"] = (inputs.loss_mask & ~valid).sum()
    if inputs.entropy is not None:
        ent_ok = valid & torch.isfinite(inputs.entropy)
        metrics["policy/entropy"] = masked_mean(
            _zeros_where(ent_ok, inputs.entropy.detach().to(dt)), ent_ok
        )
    return metrics
