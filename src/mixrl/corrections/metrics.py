"""Mismatch and correction metrics (docs/corrections.md section 10; the names are the contract).

Token-level estimators over valid generated tokens, with ``ρ_t = p_old(y_t)/q(y_t)``:

    mismatch/kl_k1     mean (log q − log p_old)                KL(q‖p_old), unbiased, noisy
    mismatch/kl_k3     mean (ρ − 1) − log ρ                    ≥ 0, low variance (Schulman's k3)
    mismatch/kl_exact  mean_t Σ_{v∈S_t} q(v) log(q(v)/p̃_old(v))  support recorded only
    mismatch/tv        ½ mean |1 − ρ|                          estimate of TV(q, p_old)
    mismatch/ratio_oob share with ρ ∉ [0.2, 5]

Per sampler group ``g`` the same means over g's tokens are named ``<metric>/<g>``,
plus ``share/samples/<g>`` (g's share of the trajectories; a trajectory whose
tokens came from several groups is split by token share) and
``share/oob_tokens/<g>`` (g's share of the out-of-range tokens; 0 when there are none).

Precision vs lag. In an asynchronous run a token may come from an older
weights version than the one the trainer scores it with, so ``mismatch/*``
mixes two sources: the sampler's numerics and policy lag. When the inputs carry
``staleness`` (trainer version − token version), every metric above is also
reported over staleness-0 tokens as ``precision/<m>`` (what the group's
numerics cost) and over stale tokens as ``lag/<m>``, globally and per group,
with ``<m>`` in kl_k1, kl_k3, kl_exact, tv, ratio_oob and ``tokens`` (how many
tokens the mean is over). Tokens of unknown version (< 0) are in neither. A
split (or a group of a split) without tokens reports only ``tokens`` = 0: a
mean over nothing is left out rather than written as 0.

``kl_k3`` and ``tv`` are formed from the clamped log-ratio
(``clamp(log p_old − log q, ±log_ratio_clamp)``), the same value the
corrections see; beyond the clamp they understate the true divergence, and
``corr/clamped_tokens`` counts how often that happens. ``mismatch/log_ratio_max``
is the largest |log ρ_t| (unclamped) of the batch.

All values are gathered into one tensor and copied to the host once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mixrl.corrections.ratios import clamp_log, segment_sum
from mixrl.corrections.types import LossInputs

OOB_LO, OOB_HI = 0.2, 5.0
GROUP_METRICS = (
    "mismatch/kl_k1",
    "mismatch/kl_k3",
    "mismatch/kl_exact",
    "mismatch/tv",
    "mismatch/ratio_oob",
)
SPLITS = ("precision", "lag")  # staleness 0, staleness > 0


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` [N] over ``mask`` [N] (0-d tensor; 0 when the mask is empty)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)


def group_means(x: Tensor, mask: Tensor, group_ids: Tensor, num_groups: int) -> Tensor:
    """Per-group mean [G] of ``x`` [N] over ``mask``; 0 for a group without tokens."""
    m = mask.to(x.dtype)
    total = x.new_zeros(num_groups).index_add(0, group_ids, x * m)
    count = x.new_zeros(num_groups).index_add(0, group_ids, m)
    return total / count.clamp_min(1.0)


def mismatch_terms(
    inputs: LossInputs, valid: Tensor, clamp: float = 20.0
) -> dict[str, tuple[Tensor, Tensor]]:
    """Per-position terms ``{name: (value [N], mask [N])}`` of the mismatch metrics (detached, float32+)."""
    dt = torch.promote_types(inputs.old_logprobs.dtype, torch.float32)
    old = torch.where(valid, inputs.old_logprobs.detach().to(dt), 0.0)
    lq = torch.where(valid, inputs.sampler_logprobs.detach().to(dt), 0.0)
    log_rho = clamp_log(old - lq, clamp)  # [N]
    rho = torch.exp(log_rho)
    terms = {
        "mismatch/kl_k1": (lq - old, valid),
        "mismatch/kl_k3": ((rho - 1.0) - log_rho, valid),
        "mismatch/tv": (0.5 * (1.0 - rho).abs(), valid),
        "mismatch/ratio_oob": (((rho < OOB_LO) | (rho > OOB_HI)).to(dt), valid),
    }
    if inputs.cand_kind == "support":
        assert inputs.cand_offsets is not None and inputs.cand_sampler_logprobs is not None
        assert inputs.cand_old_logprobs is not None
        cq, cp = (
            inputs.cand_sampler_logprobs.detach().to(dt),
            inputs.cand_old_logprobs.detach().to(dt),
        )
        ok = torch.isfinite(cq + cp)  # [K] log-probs: the sum is finite iff both are
        bad = segment_sum((~ok).to(dt), inputs.cand_offsets)  # [N]
        contrib = torch.where(ok, torch.exp(cq) * (cq - cp), 0.0)  # [K]
        kl = segment_sum(contrib, inputs.cand_offsets)  # [N] Σ_v q log(q/p̃_old)
        terms["mismatch/kl_exact"] = (kl, valid & (bad == 0))
    return terms


def _grouped(out: dict[str, Tensor], terms: dict[str, tuple[Tensor, Tensor]],
             inputs: LossInputs) -> None:
    """Global and per-group means of ``terms`` into ``out`` (in place)."""
    for name, (v, m) in terms.items():
        out[name] = masked_mean(v, m)
    if inputs.group_ids is None or not inputs.group_names:
        return
    names, gid, ng = inputs.group_names, inputs.group_ids, len(inputs.group_names)
    for name, (v, m) in terms.items():
        for g, val in zip(names, group_means(v, m, gid, ng).unbind(0), strict=True):
            out[f"{name}/{g}"] = val


def _split(terms: dict[str, tuple[Tensor, Tensor]], keep: Tensor, prefix: str,
           valid: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """``terms`` restricted to ``keep`` under ``prefix/``; ``prefix/tokens`` counts them."""
    out = {f"{prefix}/{n.split('/', 1)[1]}": (v, m & keep) for n, (v, m) in terms.items()}
    ones = torch.ones_like(terms["mismatch/kl_k1"][0])
    out[f"{prefix}/tokens"] = (ones, valid & keep)
    return out


def collect_mismatch(inputs: LossInputs, valid: Tensor, clamp: float = 20.0) -> dict[str, Tensor]:
    """All mismatch metrics, global and per group (and split by staleness), as 0-d tensors."""
    terms = mismatch_terms(inputs, valid, clamp)
    out: dict[str, Tensor] = {}
    _grouped(out, terms, inputs)
    dt = terms["mismatch/kl_k1"][0].dtype
    raw = (inputs.old_logprobs.detach().to(dt) - inputs.sampler_logprobs.detach().to(dt)).abs()
    out["mismatch/log_ratio_max"] = torch.where(valid, raw, 0.0).amax() if raw.numel() else raw.new_zeros(())
    if inputs.staleness is not None:
        st = inputs.staleness
        for split, keep in (("precision", st == 0), ("lag", st > 0)):
            sub = _split(terms, keep, split, valid)
            _grouped(out, sub, inputs)
            _tokens_as_counts(out, sub[f"{split}/tokens"][1], split, inputs)
    if inputs.group_ids is None or not inputs.group_names:
        return out
    names, gid, ng = inputs.group_names, inputs.group_ids, len(inputs.group_names)
    oob_v, oob_m = terms["mismatch/ratio_oob"]
    oob = oob_v.new_zeros(ng).index_add(0, gid, oob_v * oob_m.to(oob_v.dtype))  # [G]
    share_oob = oob / oob.sum().clamp_min(1.0)
    # share of trajectories: each trajectory's generated tokens split 1/L_i across their groups
    lm = inputs.loss_mask.to(oob_v.dtype)
    length = lm.new_zeros(inputs.num_seqs).index_add(0, inputs.seq_ids, lm)  # [S] L_i
    per_tok = lm / length.clamp_min(1.0)[inputs.seq_ids]
    share = lm.new_zeros(ng).index_add(0, gid, per_tok) / (length > 0).sum().clamp_min(1)
    for i, g in enumerate(names):
        out[f"share/samples/{g}"] = share[i]
        out[f"share/oob_tokens/{g}"] = share_oob[i]
    return out


def _tokens_as_counts(out: dict[str, Tensor], mask: Tensor, split: str, inputs: LossInputs) -> None:
    """``<split>/tokens`` (and per group) are token counts, not means of ones."""
    m = mask.to(torch.float64)
    out[f"{split}/tokens"] = m.sum()
    if inputs.group_ids is not None and inputs.group_names:
        ng = len(inputs.group_names)
        counts = m.new_zeros(ng).index_add(0, inputs.group_ids, m)
        for i, g in enumerate(inputs.group_names):
            out[f"{split}/tokens/{g}"] = counts[i]


def to_floats(metrics: dict[str, Tensor]) -> dict[str, float]:
    """One host copy for all 0-d tensors."""
    if not metrics:
        return {}
    values = torch.stack(
        [v.detach().to(torch.float64).reshape(()) for v in metrics.values()]
    ).tolist()
    return dict(zip(metrics.keys(), values, strict=True))


def drop_empty_splits(metrics: dict[str, float]) -> dict[str, float]:
    """Remove ``precision/*`` and ``lag/*`` means whose token count is 0 (see module doc)."""
    out = {}
    for k, v in metrics.items():
        parts = k.split("/")
        if parts[0] in SPLITS and parts[1] != "tokens":
            count = f"{parts[0]}/tokens" + (f"/{'/'.join(parts[2:])}" if len(parts) > 2 else "")
            if metrics.get(count, 1.0) == 0.0:
                continue
        out[k] = v
    return out


def mismatch_metrics(
    inputs: LossInputs, valid: Tensor | None = None, clamp: float = 20.0
) -> dict[str, float]:
    """Section 10 mismatch metrics (+ per group) of a batch, as floats.

    ``valid`` [N] defaults to ``loss_mask`` with finite ``old``/``sampler`` log-probs.
    """
    inputs.validate()
    if valid is None:
        valid = (
            inputs.loss_mask
            & torch.isfinite(inputs.old_logprobs)
            & torch.isfinite(inputs.sampler_logprobs)
        )
    return drop_empty_splits(to_floats(collect_mismatch(inputs, valid, clamp)))
