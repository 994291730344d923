"""Memory-efficient token log-probabilities and entropy from final hidden states.

The trainer needs, at every generated position t (docs/corrections.md §3, §7, §10):
``log p_θ(y_t)`` (or the support-replayed ``log p̃(y_t)``), the full-vocabulary
entropy of ``p_θ`` and log-probabilities at recorded candidates of ``q``.
Computing ``logits = h @ W.T`` for a whole batch materialises ``[N, V]`` floats
(several times over, with ``log_softmax`` and its backward). Here positions are
processed in chunks of ``chunk_size`` and each chunk's logits are *recomputed*
in backward (a custom ``torch.autograd.Function``), so only ``h``, ``W`` and
per-position statistics (logsumexp over the vocabulary and over the support)
are kept alive. This is the Liger/Cut-Cross-Entropy idea applied to RL outputs.

With temperature ``T_t`` the scaled logits are ``s = (h W^T + b) / T_t`` and

    full:     log p(v)  = s_v − logsumexp_{u ∈ V} s_u
    support:  log p̃(v) = s_v − logsumexp_{u ∈ S_t} s_u     (v ∈ S_t, −inf otherwise)

The gradient of any output with respect to ``s`` at a row is ``Σ g (e_v − P)``,
with ``P`` the full softmax or the renormalised support softmax. Backward
therefore splits into a dense part ``−A_full · softmax(s)`` (recomputed per
chunk, skipped for chunks where it is zero, e.g. pure support replay) and a
sparse part on the ``y_t`` and candidate entries (``embedding_bag`` gathers,
no ``[N, V]`` tensor). Gradients outside ``S_t`` are exactly 0 under replay.

Edge cases: ``y_t ∉ S_t`` under replay (or an empty support) gives
``log p̃(y_t) = −inf`` and no gradient there: it is a data error the loss masks
and counts (§4), never silently 0. Candidate ids must be unique within a
position. Entropy is a metric (§10, ``policy/entropy``) and carries no gradient.
Precision: each chunk's matmul runs in the parameter dtype (bf16 in a bf16
trainer); reductions, softmax and gradient accumulation run in float32 (float64
for float64 inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

CAND_KINDS = ("none", "support", "head")


@dataclass
class TokenLogprobs:
    # all three in float32 for bf16/fp32 inputs (float64 for float64): a bf16 log-prob
    # would carry ~1e-2 of rounding into every ratio, more than the mismatch measured
    logprobs: Tensor  # [N] log p_θ(y_t) (log p̃ under support replay); differentiable
    entropy: Tensor  # [N] full-vocabulary entropy of p_θ at temperature T_t; no gradient
    cand_logprobs: Tensor  # [K] log p̃(v) (support) or log p(v) (head); differentiable


def _logits(h: Tensor, w: Tensor, b: Tensor | None, inv_t: Tensor, acc: torch.dtype) -> Tensor:
    """Scaled logits of one chunk, ``[C, V]`` in ``acc`` dtype (matmul in param dtype)."""
    if b is None and h.dtype == acc:
        return (h * inv_t[:, None]) @ w.T  # fold 1/T into h: one [C, d] op, not [C, V]
    z = torch.addmm(b, h, w.T) if b is not None else h @ w.T  # [C, V] param dtype
    return z.to(acc).mul_(inv_t[:, None])


def _probs(h: Tensor, w: Tensor, b: Tensor | None, inv_t: Tensor, lse: Tensor, acc: torch.dtype) -> Tensor:
    """Softmax of one chunk from its saved logsumexp, ``[C, V]`` in ``acc`` dtype."""
    if b is None and h.dtype == acc:  # shift fused into the GEMM, then one in-place exp
        return torch.addmm(-lse[:, None], h * inv_t[:, None], w.T).exp_()
    return _logits(h, w, b, inv_t, acc).sub_(lse[:, None]).exp_()


def _seg_sum(vals: Tensor, rows: Tensor, n: int) -> Tensor:
    return torch.zeros(n, dtype=vals.dtype, device=vals.device).index_add_(0, rows, vals)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, inv_t, y, offsets, rows, ids, kind, replay, chunk):
        n, acc = h.shape[0], torch.promote_types(h.dtype, torch.float32)
        kw = {"dtype": acc, "device": h.device}
        lse, lse_s = torch.empty(n, **kw), torch.full((n,), -torch.inf, **kw)
        ent, zy = torch.empty(n, **kw), torch.empty(n, **kw)
        zc = torch.empty(ids.shape[0], **kw)  # [K] scaled candidate logits
        offs = offsets.tolist()
        for s0 in range(0, n, chunk):
            s1 = min(n, s0 + chunk)
            z = _logits(h[s0:s1], w, b, inv_t[s0:s1], acc)  # [C, V]
            m = z.amax(1)  # [C]
            e = (z - m[:, None]).exp_()  # [C, V] shifted softmax numerators
            zsum = e.sum(1)
            lse[s0:s1] = m + zsum.log()
            ent[s0:s1] = lse[s0:s1] - torch.linalg.vecdot(e, z) / zsum  # H = lse − E_p[s]
            del e
            zy[s0:s1] = z.gather(1, y[s0:s1, None]).squeeze(1)
            k0, k1 = offs[s0], offs[s1]
            zc[k0:k1] = z[rows[k0:k1] - s0, ids[k0:k1]]
        in_s = torch.ones(n, dtype=torch.bool, device=h.device)
        eq = ids == y[rows]  # [K] candidate is the sampled token
        if kind == "support":
            # segment logsumexp over each position's support; empty support -> -inf
            ms = torch.full((n,), -torch.inf, **kw).scatter_reduce_(0, rows, zc, "amax")
            ssum = _seg_sum((zc - ms[rows]).exp(), rows, n)
            lse_s = ms + ssum.log()
            if replay:
                in_s = _seg_sum(eq.to(acc), rows, n) > 0
        sup_y = kind == "support" and replay
        lp = torch.where(in_s, zy - (lse_s if sup_y else lse), -torch.inf)
        clp = zc - (lse_s[rows] if kind == "support" else lse[rows])
        ctx.save_for_backward(h, w, b, inv_t, y, offsets, rows, ids, lse, clp, in_s, eq)
        ctx.cfg = (kind, sup_y, chunk)
        ctx.mark_non_differentiable(ent)
        return lp, ent, clp  # float32 (float64) even for bf16 inputs: ratios need the bits

    @staticmethod
    def backward(ctx, g_lp, g_ent, g_c):
        h, w, b, inv_t, y, offsets, rows, ids, lse, clp, in_s, eq = ctx.saved_tensors
        kind, sup_y, chunk = ctx.cfg
        n, acc = h.shape[0], lse.dtype
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(acc)
        g_c = torch.zeros_like(clp) if g_c is None else g_c.to(acc)
        gy = torch.where(in_s, g_lp, 0.0)  # no gradient through a -inf log-prob
        gc_sum = _seg_sum(g_c, rows, n)  # [N]
        zero = torch.zeros_like(gy)
        a_full = (zero if sup_y else gy) + (gc_sum if kind == "head" else zero)  # [N]
        a_sup = (gy if sup_y else zero) + (gc_sum if kind == "support" else zero)  # [N]
        # sparse entries (d loss / d s): candidates, and y_t unless folded into its candidate
        c = g_c.clone()
        if kind == "support":
            c = c - a_sup[rows] * clp.exp() + (gy[rows] * eq if sup_y else 0.0)
        gy_sparse = zero if sup_y else gy
        wc, wy = c * inv_t.to(acc)[rows], gy_sparse * inv_t.to(acc)  # d/dz = d/ds / T
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        kw = {"dtype": acc, "device": h.device}
        grad_h = torch.zeros(h.shape, **kw)
        grad_w = torch.zeros(w.shape, **kw) if need_w else None
        grad_b = torch.zeros(w.shape[0], **kw) if need_b else None
        # dense part: −A_full · softmax(s) per chunk, recomputed; zero rows skip the matmuls
        coef = -a_full * inv_t.to(acc)  # [N]
        for s0 in range(0, n, chunk):
            s1 = min(n, s0 + chunk)
            if not bool((coef[s0:s1] != 0).any()):
                continue
            p, cf = _probs(h[s0:s1], w, b, inv_t[s0:s1], lse[s0:s1], acc), coef[s0:s1, None]
            pw = p.to(w.dtype)  # [C, V]; the row scale coef goes on the [C, d] side (cheaper)
            grad_h[s0:s1] += (pw @ w).to(acc) * cf
            if grad_w is not None and acc == w.dtype:
                grad_w.addmm_(pw.T, h[s0:s1] * cf)  # in place: no [V, d] temporary
            elif grad_w is not None:
                grad_w += pw.T @ (h[s0:s1] * cf.to(h.dtype))
            if grad_b is not None:
                grad_b += cf.squeeze(1) @ p
            del p, pw
        # sparse part: Σ_k wc_k W[ids_k] per row, and its transpose into rows of W
        hw = wc.to(w.dtype)
        if ids.numel():
            grad_h += F.embedding_bag(ids, w, offsets, per_sample_weights=hw, mode="sum",
                                      include_last_offset=True)
        grad_h += w[y] * wy.to(w.dtype)[:, None]
        if grad_w is not None:
            if ids.numel():
                perm = torch.argsort(ids, stable=True)
                offs_v = torch.zeros(w.shape[0] + 1, dtype=torch.long, device=ids.device)
                offs_v[1:] = torch.bincount(ids, minlength=w.shape[0]).cumsum(0)
                grad_w += F.embedding_bag(rows[perm], h, offs_v, per_sample_weights=hw[perm],
                                          mode="sum", include_last_offset=True)
            grad_w.index_add_(0, y, (h * wy.to(h.dtype)[:, None]).to(acc))
        if grad_b is not None:
            grad_b.index_add_(0, ids, wc).index_add_(0, y, wy)
        return (grad_h.to(h.dtype) if need_h else None, None if grad_w is None else grad_w.to(w.dtype),
                None if grad_b is None else grad_b.to(w.dtype)) + (None,) * 8


def chunked_logprobs(
    hidden: Tensor,  # [N, d] final hidden states at positions that predict y
    weight: Tensor,  # [V, d] LM-head weight
    targets: Tensor,  # [N] sampled token ids y_t
    *,
    bias: Tensor | None = None,  # [V]
    temperature: float | Tensor = 1.0,  # scalar or [N], > 0
    cand_kind: str = "none",  # "none" | "support" | "head"
    cand_offsets: Tensor | None = None,  # [N + 1] ragged offsets into cand_ids
    cand_ids: Tensor | None = None,  # [K] candidate token ids, unique within a position
    replay: bool = True,  # support: renormalise log p(y_t) over S_t (§3)
    chunk_size: int = 1024,
) -> TokenLogprobs:
    """Log-probs, entropy and candidate log-probs without ``[N, V]`` logits; see module doc."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be [N, d], [V, d]")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden dtype {hidden.dtype} differs from weight dtype {weight.dtype}")
    n, v = hidden.shape[0], weight.shape[0]
    if targets.shape != (n,):
        raise ValueError(f"targets has shape {tuple(targets.shape)}, expected ({n},)")
    if n and (int(targets.min()) < 0 or int(targets.max()) >= v):
        raise ValueError(f"targets must lie in [0, {v}); got range [{int(targets.min())}, {int(targets.max())}]")
    if cand_kind not in CAND_KINDS:
        raise ValueError(f"cand_kind {cand_kind!r} is not one of {CAND_KINDS}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    acc = torch.promote_types(hidden.dtype, torch.float32)
    dev = hidden.device
    inv_t = 1.0 / torch.as_tensor(temperature, dtype=acc, device=dev).expand(n).contiguous()  # [N]
    if n and not bool(torch.isfinite(inv_t).all() & (inv_t > 0).all()):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if cand_kind == "none":
        offsets = torch.zeros(n + 1, dtype=torch.long, device=dev)
        ids = torch.zeros(0, dtype=torch.long, device=dev)
    else:
        if cand_offsets is None or cand_ids is None:
            raise ValueError(f"cand_kind={cand_kind!r} needs cand_offsets and cand_ids")
        offsets, ids = cand_offsets.long().to(dev), cand_ids.long().to(dev)
        if offsets.shape != (n + 1,) or int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel():
            raise ValueError(f"cand_offsets must be [{n + 1}] from 0 to len(cand_ids)={ids.numel()}")
        if bool((offsets.diff() < 0).any()):
            raise ValueError("cand_offsets must be non-decreasing")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= v):
            raise ValueError(f"cand_ids must lie in [0, {v})")
    rows = torch.repeat_interleave(torch.arange(n, device=dev), offsets.diff())  # [K] row of each cand
    lp, ent, clp = _ChunkedLogprobs.apply(hidden, weight, bias, inv_t, targets.long(), offsets,
                                          rows, ids, cand_kind, replay, int(chunk_size))
    return TokenLogprobs(lp, ent, clp)


def naive_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                   temperature: float | Tensor = 1.0) -> TokenLogprobs:
    """Reference: full ``[N, V]`` logits and ``log_softmax`` (tests and benchmarks only)."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    logits = F.linear(hidden, weight, bias).to(acc)  # [N, V]
    if not (isinstance(temperature, float | int) and temperature == 1):  # no extra [N, V] at T = 1
        t = torch.as_tensor(temperature, dtype=acc, device=hidden.device).expand(hidden.shape[0])
        logits = logits / t[:, None]
    logp = F.log_softmax(logits, dim=-1)  # [N, V]
    del logits  # log_softmax's backward needs only its output
    with torch.no_grad():
        ent = -torch.linalg.vecdot(logp.exp(), logp)  # one [N, V] temporary
    lp = logp.gather(1, targets.long()[:, None]).squeeze(1)
    return TokenLogprobs(lp, ent, lp.new_zeros(0))
