"""The properties of docs/corrections.md §11 (all but 8, which lives with the chunked log-probs).

Float64 throughout, small vocabularies enumerated exactly, gradients taken with
respect to leaf logits.
"""

from __future__ import annotations

import math

import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from tolerance import assert_close

from corrections.reference import F64, make_batch, probs, to_inputs, token_w
from corrections.strategies import SETTINGS, lengths, loss_configs, seeds
from mixrl.config.loss import MIS, TIS, LossConfig
from mixrl.corrections import (
    LossInputs,
    aggregation_denominator,
    compute_loss,
    replay_logprobs,
    seq_log_ratio,
)


def _denom(cfg, x, max_len=4):
    return aggregation_denominator(
        cfg.aggregation, x.loss_mask, x.seq_ids, x.num_seqs, max_len=max_len
    )


def _grad(loss, z):
    (g,) = torch.autograd.grad(loss, z, retain_graph=True)
    return g


def _caps_at_least_one(cfg: LossConfig) -> bool:
    return all(getattr(c, "cap", 1.0) >= 1.0 for c in cfg.corrections)


# ------------------------------------------------------------------ property 1


@SETTINGS
@given(seed=seeds, lens=lengths, cfg=loss_configs(), cand=st.sampled_from(["support", "head"]))
def test_p1_on_policy_every_correction_is_identity(seed, lens, cfg, cand):
    """q = p_old = p_θ: weights 1, nothing masked, SC's centring has zero gradient, loss grad = PG grad."""
    assume(_caps_at_least_one(cfg))
    b = make_batch(seed, lens, vocab=7, mismatch=0.0, drift=0.0)
    x = to_inputs(b, cand if cfg.score_centering else "none", head_k=3)
    d = _denom(cfg, x)
    loss, m = compute_loss(x, cfg, d)
    plain = LossConfig(aggregation=cfg.aggregation)
    ref, _ = compute_loss(to_inputs(b), plain, d)
    assert_close(_grad(loss, b.z), _grad(ref, b.z))
    assert (
        m["corr/masked_frac"] == 0
        and m["corr/truncated_frac"] == 0
        and m["corr/seq_dropped_frac"] == 0
    )
    assert_close(m["corr/ess"], 1.0)
    for k in ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/tv", "mismatch/ratio_oob", "policy/tv"):
        assert m[k] == 0.0, k


# ------------------------------------------------------------------ property 2


def _enumerated_batch(seed: int, vocab: int, n_ctx: int, adv: float, top_p: float | None):
    """Every token y of every context once, with advantage A·q(y): Σ_t = E_{y~q} exactly."""
    b = make_batch(seed, [1] * n_ctx, vocab=vocab, mismatch=0.8, top_p=top_p)
    rows = torch.arange(n_ctx).repeat_interleave(vocab)
    y = torch.arange(vocab).repeat(n_ctx)
    q = b.q()[rows, y]
    keep = q > 0  # only tokens q can emit
    rows, y, q = rows[keep], y[keep], q[keep]
    b.z = b.z.detach()[rows].requires_grad_()
    b.z_old, b.zq, b.y = b.z_old[rows], b.zq[rows], y
    b.support = None if b.support is None else b.support[rows]
    b.adv = adv * q
    b.seq_ids, b.num_seqs = torch.arange(len(y)), len(y)
    b.groups = torch.zeros(len(y), dtype=torch.long)
    return b, rows


def _expected_logit_grad(cfg, b, rows, n_ctx, cand="support", head_k=3):
    needs = cfg.score_centering or cfg.support_replay
    x = to_inputs(b, cand if needs else "none", head_k=head_k)
    loss, _ = compute_loss(x, cfg, 1.0)
    g = _grad(loss, b.z)  # [rows, V]: one copy of each context's logits per enumerated y
    return torch.zeros(n_ctx, g.shape[1], dtype=F64).index_add(0, rows, g)


@SETTINGS
@given(
    seed=seeds,
    rule=st.sampled_from([None, TIS(cap=1.5), MIS(lo=0.2, hi=5.0), MIS(lo=0.7, hi=1.3)]),
    adv=st.sampled_from([-1.0, 2.5]),
    top_p=st.sampled_from([None, 0.8]),
)
def test_p2_sc_removes_drift_for_every_weight_rule(seed, rule, adv, top_p):
    corr = [rule] if rule is not None else []
    b, rows = _enumerated_batch(seed, vocab=8, n_ctx=2, adv=adv, top_p=top_p)
    sc = LossConfig(corrections=corr, score_centering=True, support_replay=top_p is not None)
    assert_close(_expected_logit_grad(sc, b, rows, 2), torch.zeros(2, 8, dtype=F64), msg="SC drift")
    # without centring the expected gradient is the drift, in closed form per context:
    # −A Σ_y q(y) w(y) ∇_z log p(y) = −A (c − (Σ_v c_v) p),  c_v = q(v) w(ρ(v))
    drift = _expected_logit_grad(
        LossConfig(corrections=corr, support_replay=top_p is not None), b, rows, 2
    )
    first = torch.tensor([int((rows == r).nonzero()[0]) for r in range(2)])
    q, p_old = probs(b.zq[first], b.support[first] if b.support is not None else None), None
    p_old = probs(b.z_old[first], b.support[first] if b.support is not None else None)
    w = torch.tensor(
        [
            [token_w(rule, float(p_old[n, v] / q[n, v])) if q[n, v] > 0 else 0.0 for v in range(8)]
            for n in range(2)
        ],
        dtype=F64,
    )
    c = q * w
    assert_close(drift, -adv * (c - c.sum(-1, keepdim=True) * p_old))


def test_p2_plain_pg_and_pg_mis_drift_under_constant_advantage():
    b, rows = _enumerated_batch(3, vocab=8, n_ctx=2, adv=1.0, top_p=None)
    for cfg in (LossConfig(), LossConfig(corrections=[MIS(lo=0.2, hi=5.0)])):
        g = _expected_logit_grad(cfg, b, rows, 2)
        assert g.abs().max() > 1e-3
        # PG's drift in closed form: −A Σ_y q(y) ∇_z log p(y) = −A (q − p) per context
        if not cfg.corrections:
            p, q = probs(b.z_old[:1]), probs(b.zq[:1])
            assert_close(g[0], -(q - p)[0])


@SETTINGS
@given(
    seed=seeds, rule=st.sampled_from([None, TIS(cap=1.5), MIS(lo=0.2, hi=5.0)]), k=st.integers(1, 4)
)
def test_p2_head_tail_sc_has_no_drift_when_tail_model_holds(seed, rule, k):
    """If q really is κ·p off its head, the collapsed head form is exact: zero drift."""
    vocab, n_ctx = 8, 2
    b, rows = _enumerated_batch(seed, vocab=vocab, n_ctx=n_ctx, adv=1.0, top_p=None)
    zq = b.z_old.clone()
    zq[:, :k] += torch.linspace(8.0, 9.0, k, dtype=F64)  # head = the first k tokens; tail ∝ p_old
    b.zq = zq
    b.adv = probs(zq)[torch.arange(len(b.y)), b.y]
    cfg = LossConfig(corrections=[rule] if rule else [], score_centering=True)
    assert_close(
        _expected_logit_grad(cfg, b, rows, n_ctx, cand="head", head_k=k),
        torch.zeros(n_ctx, vocab, dtype=F64),
    )


# ------------------------------------------------------------------ property 3


@SETTINGS
@given(seed=seeds, lens=lengths)
def test_p3_mis_with_infinite_bounds_is_full_is_and_centres_to_zero(seed, lens):
    b = make_batch(seed, lens, vocab=7, mismatch=0.7)
    x = to_inputs(b, "support")
    full = LossConfig(corrections=[MIS(lo=0.0, hi=math.inf)])
    loss, m = compute_loss(x, full, 5.0)
    rho = torch.exp(x.old_logprobs - x.sampler_logprobs)
    assert_close(loss, -(rho * x.advantages * x.trainer_logprobs).sum() / 5.0)
    assert m["corr/masked_frac"] == 0.0
    # Σ_v q w ∇log p = Σ_v p_old ∇log p = 0 at p = p_old: centring changes no gradient
    sc, _ = compute_loss(x, full.model_copy(update={"score_centering": True}), 5.0)
    assert_close(_grad(sc, b.z), _grad(compute_loss(x, full, 5.0)[0], b.z))


# ------------------------------------------------------------------ property 4a


@SETTINGS
@given(seed=seeds, lens=lengths, cfg=loss_configs(score_centering=True))
def test_p4_head_covering_vocabulary_equals_exact_sc(seed, lens, cfg):
    vocab = 6
    b = make_batch(seed, lens, vocab=vocab, mismatch=0.6)
    d = _denom(cfg, to_inputs(b))
    head, _ = compute_loss(to_inputs(b, "head", head_k=vocab), cfg, d)
    exact, _ = compute_loss(to_inputs(b, "support"), cfg, d)
    assert_close(_grad(head, b.z), _grad(exact, b.z))


# ------------------------------------------------------------------ property 5


@SETTINGS
@given(
    seed=seeds,
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    top_p=st.sampled_from([0.5, 0.8, 0.95]),
)
def test_p5_support_replay_renormalises_and_blocks_gradient_outside(seed, temperature, top_p):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(5, 9, generator=g, dtype=F64, requires_grad=True)
    from corrections.reference import top_p_support

    support = top_p_support(probs(z.detach(), None, temperature), top_p)
    lp = replay_logprobs(z, support, temperature)
    assert_close(torch.exp(lp).sum(-1), torch.ones(5, dtype=F64))
    assert_close(torch.exp(lp), probs(z, support, temperature).detach())
    assert bool(torch.isinf(lp[~support]).all())
    w = torch.randn(5, 9, generator=g, dtype=F64)
    (grad,) = torch.autograd.grad((torch.where(support, lp, 0.0) * w).sum(), z)
    assert bool((grad[~support] == 0).all())
    multi = support.sum(-1) > 1  # a one-token support has log p̃ ≡ 0: no gradient anywhere
    assert bool((grad[multi].abs().sum(-1) > 0).all())


def test_p5_replayed_sc_loss_has_no_gradient_outside_support():
    b = make_batch(11, [3, 2], vocab=9, mismatch=0.6, top_p=0.7)
    cfg = LossConfig(corrections=[MIS(lo=0.2, hi=5.0)], score_centering=True, support_replay=True)
    loss, _ = compute_loss(to_inputs(b, "support"), cfg, 5.0)
    grad = _grad(loss, b.z)
    assert b.support is not None and bool((grad[~b.support] == 0).all())
    assert grad[b.support].abs().max() > 0


# ------------------------------------------------------------------ property 6


@SETTINGS
@given(
    seed=seeds,
    lens=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    scale=st.sampled_from([0.1, 1.0]),
)
def test_p6_sequence_ratio_in_log_space_matches_product(seed, lens, scale):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    rho = torch.exp(scale * torch.randn(n, generator=g, dtype=F64))  # token ratios
    ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    log_seq, log_geo = seq_log_ratio(
        torch.log(rho), ids, len(lens), torch.ones(n, dtype=torch.bool)
    )
    prods = [math.prod(rho[ids == i].tolist()) for i in range(len(lens))]
    assert_close(torch.exp(log_seq), torch.tensor(prods, dtype=F64))
    assert_close(
        torch.exp(log_geo),
        torch.tensor([p ** (1 / k) for p, k in zip(prods, lens, strict=True)], dtype=F64),
    )


def test_p6_sequence_log_ratio_clamped_at_20():
    ids = torch.tensor([0] * 30 + [1] * 30)
    log_rho = torch.cat([torch.full((30,), 1.0), torch.full((30,), -1.0)]).to(F64)  # Σ = ±30
    log_seq, log_geo = seq_log_ratio(log_rho, ids, 2, torch.ones(60, dtype=torch.bool))
    assert log_seq.tolist() == [20.0, -20.0]
    assert_close(log_geo, torch.tensor([1.0, -1.0], dtype=F64))
    # a masked-out huge token does not leak into the sum
    mask = torch.ones(60, dtype=torch.bool)
    mask[0] = False
    log_rho2 = log_rho.clone()
    log_rho2[0] = 1e6
    assert seq_log_ratio(log_rho2, ids, 2, mask)[1][0].item() == 1.0


# ------------------------------------------------------------------ property 7


def _slice(x: LossInputs, seqs: list[int]) -> LossInputs:
    """Sub-batch with the trajectories ``seqs`` (renumbered 0..), candidates included."""
    sel = torch.isin(x.seq_ids, torch.tensor(seqs))
    idx = sel.nonzero().flatten()
    remap = torch.full((x.num_seqs,), -1, dtype=torch.long)
    remap[torch.tensor(seqs)] = torch.arange(len(seqs))
    kw = {}
    if x.cand_kind != "none":
        assert x.cand_offsets is not None
        spans = [
            torch.arange(int(x.cand_offsets[i]), int(x.cand_offsets[i + 1])) for i in idx.tolist()
        ]
        cidx = torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)
        counts = torch.tensor([len(s) for s in spans], dtype=torch.long)
        kw = dict(
            cand_kind=x.cand_kind,
            cand_offsets=torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]),
            cand_trainer_logprobs=x.cand_trainer_logprobs[cidx],
            cand_old_logprobs=x.cand_old_logprobs[cidx],
            cand_sampler_logprobs=x.cand_sampler_logprobs[cidx],
        )
    return LossInputs(
        x.trainer_logprobs[idx], x.old_logprobs[idx], x.sampler_logprobs[idx], x.advantages[idx],
        x.loss_mask[idx], remap[x.seq_ids[idx]], len(seqs), entropy=x.entropy[idx],
        group_ids=x.group_ids[idx], group_names=x.group_names, **kw,
    )  # fmt: skip


@SETTINGS
@given(
    seed=seeds,
    lens=st.lists(st.integers(1, 4), min_size=2, max_size=5),
    cfg=loss_configs(),
    k=st.integers(2, 3),
)
def test_p7_micro_batches_with_shared_denominator_equal_one_batch(seed, lens, cfg, k):
    b = make_batch(seed, lens, vocab=7, mismatch=0.6, drift=0.2)
    x = to_inputs(b, "head" if cfg.score_centering else "none", head_k=3)
    d = _denom(cfg, x)
    full, _ = compute_loss(x, cfg, d)
    parts = [list(range(len(lens)))[i::k] for i in range(k)]
    # each micro-batch's D contribution sums to the batch's D
    assert (
        sum(_denom(cfg, _slice(x, p)) for p in parts if p) == d
        or cfg.aggregation == "seq_mean_token_sum_norm"
    )
    total = sum(compute_loss(_slice(x, p), cfg, d)[0] for p in parts if p)
    assert_close(total, full)
    assert_close(_grad(total, b.z), _grad(compute_loss(x, cfg, d)[0], b.z))
