"""Log-space ratios and segment reductions (docs/corrections.md section 4).

Every ratio is formed as ``exp(clamp(log a - log b, -c, c))`` with ``c = 20``
by default: ``e^20 ≈ 4.9e8`` is far beyond any cap or mask bound in use, yet it
keeps ``exp`` and its square (ESS) finite in float32.

Segment reductions run over ``seq_ids`` with ``index_add_``/``scatter_reduce_``
(one kernel, no Python loop over tokens). Positions outside ``mask`` contribute
nothing; a segment with no kept position gets the reduction's identity
(sum 0, mean 0, min +inf, max -inf) and callers decide what that means.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0


def clamp_log(x: Tensor, clamp: float = LOG_RATIO_CLAMP) -> Tensor:
    """``x`` clamped to ``[-clamp, clamp]`` (gradient 0 where clamped)."""
    return x.clamp(-clamp, clamp)


def ratio(log_num: Tensor, log_den: Tensor, clamp: float = LOG_RATIO_CLAMP) -> Tensor:
    """``exp(clamp(log_num - log_den))`` elementwise; same shape as the inputs."""
    return torch.exp(clamp_log(log_num - log_den, clamp))


def seq_sum(values: Tensor, seq_ids: Tensor, num_seqs: int, mask: Tensor | None = None) -> Tensor:
    """``out[i] = Σ_{t: seq_ids[t]=i, mask[t]} values[t]``; values [N] -> [S]."""
    if mask is not None:
        values = torch.where(mask, values, 0.0)
    out = values.new_zeros(num_seqs)
    return out.index_add(0, seq_ids, values)


def seq_count(seq_ids: Tensor, num_seqs: int, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Number of kept positions per sequence, [S] in ``dtype``."""
    return seq_sum(mask.to(dtype), seq_ids, num_seqs)


def seq_mean(values: Tensor, seq_ids: Tensor, num_seqs: int, mask: Tensor) -> Tensor:
    """Mean over the kept positions of each sequence, [S]; 0 for an empty sequence."""
    total = seq_sum(values, seq_ids, num_seqs, mask)
    count = seq_count(seq_ids, num_seqs, mask, values.dtype)
    return total / count.clamp_min(1.0)


def seq_extreme(
    values: Tensor, seq_ids: Tensor, num_seqs: int, mask: Tensor, reduce: str
) -> Tensor:
    """Per-sequence ``amin``/``amax`` over kept positions, [S]; ±inf for an empty sequence."""
    fill = float("inf") if reduce == "amin" else float("-inf")
    src = torch.where(mask, values, fill)
    out = torch.full((num_seqs,), fill, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, seq_ids, src, reduce=reduce, include_self=True)


def seq_log_ratio(
    log_rho: Tensor, seq_ids: Tensor, num_seqs: int, mask: Tensor, clamp: float = LOG_RATIO_CLAMP
) -> tuple[Tensor, Tensor]:
    """Sequence and geometric log-ratios, both [S] and clamped to ±clamp.

    ``log ρ_i = Σ_t m_t log ρ_t`` (the product of token ratios, formed in log
    space so a long sequence never under/overflows) and
    ``log ρ̄_i = log ρ_i / Σ_t m_t``. The per-token inputs are summed unclamped
    (they are finite after masking) and the sum is clamped once.
    """
    total = seq_sum(log_rho, seq_ids, num_seqs, mask)
    count = seq_count(seq_ids, num_seqs, mask, log_rho.dtype).clamp_min(1.0)
    return clamp_log(total, clamp), clamp_log(total / count, clamp)


def candidate_positions(cand_offsets: Tensor, num_candidates: int) -> Tensor:
    """Position index of each candidate, [K] long, from ``cand_offsets`` [N+1].

    ``pos[k] = #{r in 1..N-1 : offsets[r] <= k}``: one scatter and one cumsum,
    no host synchronisation (``repeat_interleave`` would need the output size and
    is several times slower on CPU). Empty positions are handled: their start
    offsets coincide with the next position's.
    """
    marks = torch.zeros(num_candidates + 1, dtype=torch.long, device=cand_offsets.device)
    inner = cand_offsets[1:-1]  # [N-1] starts of positions 1..N-1
    marks.index_add_(0, inner, torch.ones_like(inner))
    return marks[:num_candidates].cumsum(0)


def segment_sum(values: Tensor, cand_offsets: Tensor) -> Tensor:
    """``out[t] = Σ_{k in offsets[t]:offsets[t+1]} values[k]``: [K] -> [N], differentiable.

    The candidates of a position are contiguous, so a segmented reduction
    (no atomics, no index tensor) does it; empty positions give 0. ``unsafe``
    skips a device-side check of the offsets, which ``LossInputs.validate`` has done.
    """
    return torch.segment_reduce(values, "sum", offsets=cand_offsets, unsafe=True)
