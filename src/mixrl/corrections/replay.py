"""Support (top-p / top-k) mask replay (docs/corrections.md section 3).

    log p̃(v | s_t) = z_v/T − logsumexp_{u∈S_t} z_u/T   for v ∈ S_t,   −inf otherwise

In training the chunked log-prob code (``mixrl.models.chunked``) applies this
without materialising [N, V]; this full-logits version is the reference for
tests and small cases. Logits outside ``S_t`` receive exactly zero gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor


def replay_logprobs(logits: Tensor, support: Tensor, temperature: float = 1.0) -> Tensor:
    """``log p̃`` [N, V] from ``logits`` [N, V] and a bool ``support`` [N, V].

    Raises ``ValueError`` on a shape mismatch, a non-positive temperature or a
    row with an empty support (p̃ would be undefined there).
    """
    if logits.shape != support.shape:
        raise ValueError(
            f"logits has shape {tuple(logits.shape)}, support has {tuple(support.shape)}"
        )
    if support.dtype != torch.bool:
        raise ValueError(f"support has dtype {support.dtype}, expected torch.bool")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if support.numel() and not bool(support.any(dim=-1).all()):
        raise ValueError("support has a row with no token; p̃ is undefined there")
    # masked_fill before log_softmax: the -inf entries get zero gradient, and no
    # logit outside S_t enters the normaliser.
    z = (logits / temperature).masked_fill(~support, float("-inf"))
    return torch.log_softmax(z, dim=-1)


def gather_candidates(logprobs: Tensor, cand_offsets: Tensor, cand_ids: Tensor) -> Tensor:
    """``logprobs[t, cand_ids[k]]`` for the candidates k of position t: [N, V] -> [K]."""
    counts = cand_offsets[1:] - cand_offsets[:-1]
    rows = torch.repeat_interleave(torch.arange(logprobs.shape[0], device=logprobs.device), counts)
    return logprobs[rows, cand_ids]
