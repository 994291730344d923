"""Aggregation: the denominator D of ``loss = −Σ m_t w_t g_t / D`` (docs/corrections.md section 9).

D is computed by the caller over the *whole* optimizer batch (in a distributed
trainer: one all-reduce of the local value) and passed to ``compute_loss``,
which never forms it; then k micro-batches with a shared D sum to one batch.

    token_mean               D = Σ_t loss_mask_t                 (every generated token)
    seq_mean_token_mean      D = number of sequences with a generated token;
                             ``compute_loss`` scales token t by 1/L_i, L_i = Σ_{t∈i} loss_mask_t
    seq_mean_token_sum_norm  D = S · max_len = (#prompts) · G · max_len   (Dr. GRPO, arXiv 2503.20783)

For ``seq_mean_token_mean`` L_i is counted inside ``compute_loss`` from the
micro-batch, so a trajectory must not be split across micro-batches.

Tokens removed by a behaviour correction (mask, veto, dropped sequence) and
non-finite tokens still count in D and in L_i: a correction removes a token's
gradient, it does not re-weight the tokens it keeps.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def aggregation_denominator(
    mode: str,
    loss_mask: Tensor,
    seq_ids: Tensor,
    num_seqs: int,
    *,
    G: int | None = None,
    max_len: int | None = None,
) -> float:
    """Local contribution to D for ``mode`` (sum it over ranks / micro-batches).

    ``loss_mask`` [N] bool and ``seq_ids`` [N] long describe the local batch;
    ``num_seqs`` S its trajectories. ``seq_mean_token_sum_norm`` needs
    ``max_len`` (the generation budget per trajectory); ``G``, if given, must divide S.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation mode {mode!r} is not one of {AGGREGATIONS}")
    if loss_mask.shape != seq_ids.shape:
        raise ValueError(
            f"loss_mask has shape {tuple(loss_mask.shape)}, seq_ids has {tuple(seq_ids.shape)}"
        )
    if mode == "token_mean":
        return float(loss_mask.sum().item())
    if mode == "seq_mean_token_mean":
        counts = torch.zeros(num_seqs, dtype=torch.long, device=seq_ids.device)
        counts = counts.index_add(0, seq_ids, loss_mask.long())
        return float((counts > 0).sum().item())
    if max_len is None or max_len < 1:
        raise ValueError(f"seq_mean_token_sum_norm needs max_len >= 1, got {max_len}")
    if G is not None and (G < 1 or num_seqs % G):
        raise ValueError(f"G={G} must be >= 1 and divide num_seqs={num_seqs}")
    return float(num_seqs * max_len)


def token_scale(
    mode: str, loss_mask: Tensor, seq_ids: Tensor, num_seqs: int, dtype: torch.dtype
) -> Tensor | None:
    """Per-token factor [N] applied inside the loss (1/L_i for seq_mean_token_mean), else None."""
    if mode != "seq_mean_token_mean":
        return None
    counts = torch.zeros(num_seqs, dtype=dtype, device=seq_ids.device)
    counts = counts.index_add(0, seq_ids, loss_mask.to(dtype))  # [S] L_i
    return 1.0 / counts.clamp_min(1.0)[seq_ids]
