"""The sampling distribution q and a seeded draw from it.

q is what the sampler actually samples from (the object the off-policy
corrections need, docs/corrections.md): temperature, then top-k, then top-p on the
top-k-renormalized distribution (the order of HF's warpers and of vLLM):

    z = logits / T
    K = {k most likely tokens of z}                      (all tokens when top_k = 0)
    S = smallest prefix of K, by descending prob, whose mass >= top_p under softmax(z|K)
    log q(y) = z_y - logsumexp(z_S)   for y in S,   -inf otherwise

so sum_{y in S} q(y) = 1. Ties at a boundary are broken by sort order.

The draw is inverse-CDF sampling with one uniform per (request, step), taken
from the request's own generator; a row's token therefore depends only on its
own logits and seed, never on its batch neighbours.
"""

from __future__ import annotations

import torch


def sampling_logprobs(
    logits: torch.Tensor,  # [B, V] float32, finite
    temperature: torch.Tensor,  # [B] float32, > 0
    top_k: torch.Tensor,  # [B] long, 0 = off
    top_p: torch.Tensor,  # [B] float32 in (0, 1]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``log q`` [B, V] (-inf outside the support) and the support mask [B, V]
    (``None`` when every row keeps the whole vocabulary)."""
    z = logits / temperature[:, None]  # [B, V]
    V = z.shape[-1]
    filt = (top_k > 0) | (top_p < 1)  # [B] rows that truncate
    if not bool(filt.any()):
        return torch.log_softmax(z, dim=-1), None
    rows = filt.nonzero().squeeze(1)  # [R]
    zs, order = z[rows].sort(dim=-1, descending=True)  # [R, V]
    k = torch.where(top_k[rows] > 0, top_k[rows], V).clamp(max=V)  # [R]
    keep_sorted = torch.arange(V)[None, :] < k[:, None]  # [R, V] top-k by rank
    p = torch.softmax(zs.masked_fill(~keep_sorted, float("-inf")), dim=-1)  # top-k renormalized
    mass_before = torch.cumsum(p, dim=-1) - p  # [R, V] mass of strictly more likely tokens
    tp = top_p[rows][:, None]
    # keep while the mass before a token is < top_p; top_p == 1 must keep all (no rounding cut)
    keep_sorted &= (mass_before < tp) | (tp >= 1)
    keep_sorted[:, 0] = True  # the most likely token always survives
    keep = torch.ones_like(z, dtype=torch.bool)  # [B, V]
    keep[rows] = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    logq = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    return logq, keep


def draw(logq: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: ``logq`` [B, V], ``u`` [B] float64 uniforms in [0, 1) -> ids [B].

    The CDF is accumulated in float64 over vocabulary order; a token of zero
    probability has a zero-width CDF step, so it can never be drawn.
    """
    cdf = torch.cumsum(logq.exp().double(), dim=-1)  # [B, V]
    target = (u * cdf[:, -1]).unsqueeze(1)  # [B, 1] strictly below the total since u < 1
    ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return ids.clamp_(max=logq.shape[-1] - 1)
