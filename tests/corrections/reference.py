"""Float64 brute-force references for the correction library (docs/corrections.md §11).

Everything here works in *probability* space over an enumerated small
vocabulary with explicit loops, products and divisions, the opposite of the
implementation (log space, segment reductions, collapsed tail): agreement
between the two is evidence, not a tautology. Logits are leaf tensors so the
gradient of a reference loss with respect to them is the exact policy gradient.

Importable by other tests: ``from corrections.reference import ...`` (with
``tests/`` on ``sys.path``, which pytest's rootdir-relative import gives).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mixrl.corrections import LossInputs

F64 = torch.float64
E20 = math.exp(20.0)


def probs(z: Tensor, support: Tensor | None = None, temperature: float = 1.0) -> Tensor:
    """Explicit ``exp(z/T) / Σ exp(z/T)`` over ``support`` (0 outside), row-wise, [N, V]."""
    e = torch.exp(z / temperature)
    if support is not None:
        e = e * support.to(e.dtype)
    return e / e.sum(dim=-1, keepdim=True)


def entropy(p: Tensor) -> Tensor:
    """Full-vocabulary entropy per row, [N]."""
    return -(torch.where(p > 0, p * torch.log(p), torch.zeros_like(p))).sum(-1)


def top_p_support(p: Tensor, top_p: float) -> Tensor:
    """Nucleus of each row of ``p`` [N, V]: the smallest top set with mass >= top_p, bool [N, V]."""
    out = torch.zeros_like(p, dtype=torch.bool)
    for n in range(p.shape[0]):
        order = torch.argsort(p[n], descending=True).tolist()
        mass = 0.0
        for v in order:
            out[n, v] = True
            mass += float(p[n, v])
            if mass >= top_p:
                break
    return out


@dataclass
class Batch:
    """A small batch enumerated exactly: N positions over a V-token vocabulary."""

    z: Tensor  # [N, V] trainer logits (leaf, requires grad)
    z_old: Tensor  # [N, V] logits of p_old (detached)
    zq: Tensor  # [N, V] sampler logits (q = softmax, renormalised on ``support``)
    y: Tensor  # [N] sampled tokens
    adv: Tensor  # [N] advantages
    seq_ids: Tensor  # [N] long
    num_seqs: int
    support: Tensor | None = None  # [N, V] bool: q's top-p set; p̃ replayed on it
    groups: Tensor | None = None  # [N] long
    group_names: list[str] = field(default_factory=list)

    def p(self) -> Tensor:
        return probs(self.z, self.support)  # [N, V] p_θ (p̃ with a support)

    def p_old(self) -> Tensor:
        return probs(self.z_old, self.support)  # [N, V]

    def q(self) -> Tensor:
        return probs(self.zq, self.support)  # [N, V]

    def at_y(self, m: Tensor) -> Tensor:
        return m[torch.arange(m.shape[0]), self.y]  # [N]


def make_batch(
    seed: int,
    lengths: list[int],
    vocab: int,
    *,
    mismatch: float = 0.5,
    drift: float = 0.0,
    top_p: float | None = None,
    adv_const: float | None = None,
) -> Batch:
    """Random batch: trajectories of ``lengths``; q = p_old perturbed by ``mismatch``,
    p_θ = p_old perturbed by ``drift``; y sampled from q (within its top-p set)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    z_old = torch.randn(n, vocab, generator=g, dtype=F64) * 1.5
    zq = z_old + mismatch * torch.randn(n, vocab, generator=g, dtype=F64)
    z = (z_old + drift * torch.randn(n, vocab, generator=g, dtype=F64)).requires_grad_()
    support = top_p_support(probs(zq), top_p) if top_p is not None else None
    y = torch.multinomial(probs(zq, support), 1, generator=g).squeeze(1)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    adv_seq = torch.randn(len(lengths), generator=g, dtype=F64)
    adv = torch.full((n,), adv_const, dtype=F64) if adv_const is not None else adv_seq[seq_ids]
    groups = torch.randint(0, 2, (len(lengths),), generator=g)[seq_ids]
    return Batch(z, z_old, zq, y, adv, seq_ids, len(lengths), support, groups, ["ga", "gb"])


def to_inputs(
    b: Batch, cand: str = "none", head_k: int = 3, loss_mask: Tensor | None = None
) -> LossInputs:
    """LossInputs of ``b``; ``cand`` is none | support (b.support or the whole vocabulary) | head (top-k of q)."""
    p, p_old, q = b.p(), b.p_old(), b.q()
    n, v = p.shape
    kw: dict = {}
    if cand != "none":
        if cand == "support":
            sel = b.support if b.support is not None else torch.ones(n, v, dtype=torch.bool)
        else:
            top = torch.topk(q.detach(), head_k, dim=-1).indices
            sel = torch.zeros(n, v, dtype=torch.bool).scatter(1, top, True)
        rows, cols = sel.nonzero(as_tuple=True)
        counts = sel.sum(-1)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        kw = dict(
            cand_kind="support" if cand == "support" else "head",
            cand_offsets=offsets,
            cand_trainer_logprobs=torch.log(p[rows, cols]),
            cand_old_logprobs=torch.log(p_old[rows, cols]).detach(),
            cand_sampler_logprobs=torch.log(q[rows, cols]).detach(),
        )
    return LossInputs(
        trainer_logprobs=torch.log(b.at_y(p)),
        old_logprobs=torch.log(b.at_y(p_old)).detach(),
        sampler_logprobs=torch.log(b.at_y(q)).detach(),
        advantages=b.adv.clone(),
        loss_mask=torch.ones(n, dtype=torch.bool) if loss_mask is None else loss_mask,
        seq_ids=b.seq_ids.clone(),
        num_seqs=b.num_seqs,
        entropy=entropy(p.detach()),
        group_ids=b.groups,
        group_names=b.group_names,
        **kw,
    )


# ----------------------------------------------------------------- weights (section 6)


def token_w(rule, rho: float) -> float:
    """w(ρ) of a token rule, on a python float."""
    if rule is None:
        return 1.0
    if rule.type == "tis":
        return min(rho, rule.cap)
    return rho if rule.lo <= rho <= rule.hi else 0.0


def _clamped(x: float) -> float:
    return min(max(x, 1.0 / E20), E20)


def ref_weights(
    b: Batch, corrections, mask: Tensor | None = None
) -> tuple[list[float], list[float]]:
    """Token weights w_t and sequence factors f_i by explicit products over each trajectory."""
    rho = (b.at_y(b.p_old()) / b.at_y(b.q())).tolist()  # ρ_t as a probability quotient
    n = len(rho)
    mask = [True] * n if mask is None else mask.tolist()
    w, f = [1.0] * n, [1.0] * b.num_seqs
    seqs = [[t for t in range(n) if int(b.seq_ids[t]) == i and mask[t]] for i in range(b.num_seqs)]
    for c in corrections:
        for t in range(n):
            if c.type in ("tis", "mis"):
                w[t] = token_w(c, _clamped(rho[t]))
        for i, ts in enumerate(seqs):
            prod = math.prod(rho[t] for t in ts) if ts else 1.0
            geo = prod ** (1.0 / len(ts)) if ts else 1.0
            if c.type == "seq_tis":
                f[i] *= min(_clamped(prod), c.cap)
            elif c.type == "seq_mis":
                f[i] *= _clamped(prod) if c.lo <= _clamped(prod) <= c.hi else 0.0
            elif c.type == "geo_mask":
                keep = c.lo <= _clamped(geo) <= c.hi
                f[i] *= (_clamped(geo) if c.weight == "ratio" else 1.0) if keep else 0.0
            elif c.type == "veto":
                drop = any(rho[t] < c.tau for t in ts)
                drop |= c.tau_hi is not None and any(rho[t] > c.tau_hi for t in ts)
                f[i] *= 0.0 if drop else 1.0
            elif c.type == "opsm":
                a_i = sum(float(b.adv[t]) for t in ts) / max(len(ts), 1)
                kl = sum(-math.log(rho[t]) for t in ts) / max(len(ts), 1)
                f[i] *= 0.0 if (a_i < 0 and kl > c.delta) else 1.0
    return w, f


# ----------------------------------------------------------------- objectives (section 5)


def ref_surrogate(b: Batch, obj) -> list[Tensor]:
    """g_t per token (0-d tensors carrying grad to b.z), from probability ratios."""
    p_y, old_y = b.at_y(b.p()), b.at_y(b.p_old()).detach()
    out = []
    for t in range(p_y.shape[0]):
        a, r = float(b.adv[t]), p_y[t] / old_y[t]
        if obj.type == "pg":
            out.append(a * torch.log(p_y[t]))
        elif obj.type == "ppo_clip":
            g = torch.minimum(r * a, torch.clamp(r, 1 - obj.eps_low, 1 + obj.eps_high) * a)
            if obj.dual_clip is not None and a < 0:
                g = torch.maximum(g, torch.tensor(obj.dual_clip * a, dtype=F64))
            out.append(g)
        elif obj.type == "gspo":
            ts = [u for u in range(p_y.shape[0]) if int(b.seq_ids[u]) == int(b.seq_ids[t])]
            s_i = math.prod(float(p_y[u].detach() / old_y[u]) for u in ts) ** (1.0 / len(ts))
            s_tok = s_i * p_y[t] / p_y[t].detach()
            out.append(
                torch.minimum(s_tok * a, torch.clamp(s_tok, 1 - obj.eps_low, 1 + obj.eps_high) * a)
            )
        elif obj.type == "cispo":
            lo = -math.inf if obj.eps_low is None else 1 - obj.eps_low
            out.append(min(max(float(r.detach()), lo), 1 + obj.eps_high) * a * torch.log(p_y[t]))
    return out


# ----------------------------------------------------------------- score centering (section 7)


def ref_centering(
    b: Batch, rule, kind: str, head_k: int = 3, tail_eps: float = 1e-6
) -> list[Tensor]:
    """Σ_v sg(c_t(v)) log p_θ(v) per position, enumerating the *whole* vocabulary.

    ``support``: c = q w on q's support (q = 0 elsewhere). ``head``: q is
    replaced by its model — q on the top-k head, κ_t p_old elsewhere — and the
    sum still runs over every token (no collapse onto the head).
    """
    p, p_old, q = b.p(), b.p_old().detach(), b.q().detach()
    out = []
    for t in range(p.shape[0]):
        q_model = q[t].clone()
        if kind == "head":
            head = set(torch.topk(q[t], head_k).indices.tolist())
            tail_q = max(1.0 - sum(float(q[t, v]) for v in head), tail_eps)
            tail_p = max(1.0 - sum(float(p_old[t, v]) for v in head), tail_eps)
            for v in range(p.shape[1]):
                if v not in head:
                    q_model[v] = tail_q / tail_p * p_old[t, v]
        total = torch.zeros((), dtype=F64)
        for v in range(p.shape[1]):
            if q_model[v] > 0:
                c = float(q_model[v]) * token_w(rule, _clamped(float(p_old[t, v] / q_model[v])))
                total = total + c * torch.log(p[t, v])
        out.append(total)
    return out


def ref_loss(b: Batch, cfg, denom: float, *, cand: str = "none", head_k: int = 3) -> Tensor:
    """The whole loss −Σ f_i [w_t g_t − A_t centring_t] s_t / D by loops (gradient to b.z)."""
    w, f = ref_weights(b, cfg.corrections)
    g = ref_surrogate(b, cfg.objective)
    rule = cfg.token_weight()
    cent = ref_centering(b, rule, cand, head_k, cfg.tail_eps) if cfg.score_centering else None
    n = len(g)
    lengths = [sum(1 for u in range(n) if int(b.seq_ids[u]) == int(b.seq_ids[t])) for t in range(n)]
    total = torch.zeros((), dtype=F64)
    for t in range(n):
        term = w[t] * g[t]
        if cent is not None:
            term = term - float(b.adv[t]) * cent[t]
        scale = 1.0 / lengths[t] if cfg.aggregation == "seq_mean_token_mean" else 1.0
        total = total + f[int(b.seq_ids[t])] * scale * term
    return -total / denom
