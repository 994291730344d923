"""Numbers derived by hand for every correction, objective, SC form, advantage and metric.

Each case states its inputs as probabilities, so the expected values below can
be checked with a pocket calculator; ``l(x)`` is ``math.log``.
"""

from __future__ import annotations

import math

import pytest
import torch
from tolerance import assert_close

from mixrl.config.loss import (
    MIS,
    OPSM,
    TIS,
    CISPOObjective,
    GeoMask,
    GSPOObjective,
    LossConfig,
    PPOClipObjective,
    SeqMIS,
    SeqTIS,
    Veto,
)
from mixrl.corrections import (
    LossInputs,
    aggregation_denominator,
    compute_loss,
    grpo_advantages,
    mismatch_metrics,
)

l = math.log  # noqa: E741
F64 = torch.float64


def mk(p_old, q, adv, seq_ids, *, p=None, **kw) -> LossInputs:
    """Inputs from probabilities; the trainer's log-prob is a leaf (p defaults to p_old)."""
    t = lambda v: torch.tensor([l(x) for x in v], dtype=F64)  # noqa: E731
    lp = t(p if p is not None else p_old).requires_grad_()
    n = len(p_old)
    return LossInputs(
        lp, t(p_old), t(q), torch.tensor(adv, dtype=F64), torch.ones(n, dtype=torch.bool),
        torch.tensor(seq_ids), max(seq_ids) + 1, **kw,
    )  # fmt: skip


def run(x, cfg, d):
    loss, m = compute_loss(x, cfg, d)
    loss.backward()
    return loss.item(), x.trainer_logprobs.grad.tolist(), m


def test_tis_truncates_at_cap():
    # ρ = [0.25/0.5, 0.6/0.2] = [0.5, 3]  ->  w = [0.5, 2]
    loss, grad, m = run(
        mk([0.25, 0.6], [0.5, 0.2], [1.0, -2.0], [0, 1]),
        LossConfig(corrections=[TIS(cap=2.0)]),
        2.0,
    )
    assert_close(loss, -(0.5 * 1 * l(0.25) + 2 * -2 * l(0.6)) / 2)
    assert_close(grad, [-0.25, 2.0])  # −w A / D
    assert m["corr/truncated_frac"] == 0.5
    assert_close(m["corr/ess"], 2.5**2 / (2 * (0.25 + 4.0)))


def test_mis_masks_out_of_range_and_masked_tokens_stay_in_denominator():
    # ρ = [0.05/0.5, 0.3/0.2, 0.6/0.1] = [0.1, 1.5, 6]  ->  w = [0, 1.5, 0]
    x = mk([0.05, 0.3, 0.6], [0.5, 0.2, 0.1], [1.0, 1.0, 1.0], [0, 1, 2])
    loss, grad, m = run(x, LossConfig(corrections=[MIS(lo=0.2, hi=5.0)]), 3.0)
    assert_close(loss, -1.5 * l(0.3) / 3)  # divided by all 3 generated tokens, not the 1 kept
    assert_close(grad, [0.0, -0.5, 0.0])
    assert_close(m["corr/masked_frac"], 2 / 3)
    assert_close(m["mismatch/ratio_oob"], 2 / 3)


def test_seq_tis_truncates_sequence_ratio():
    # ρ_t = [0.4/0.2, 0.8/0.2] = [2, 4], ρ_i = 8 -> 5
    loss, grad, m = run(
        mk([0.4, 0.8], [0.2, 0.2], [1.0, 1.0], [0, 0]),
        LossConfig(corrections=[SeqTIS(cap=5.0)]),
        2.0,
    )
    assert_close(loss, -5 * (l(0.4) + l(0.8)) / 2)
    assert_close(grad, [-2.5, -2.5])
    assert m["corr/truncated_frac"] == 1.0


def test_seq_mis_keeps_weighted_and_drops_out_of_range():
    # seq 0: ρ_t = [2, 0.75] -> ρ_0 = 1.5 kept with weight 1.5; seq 1: ρ = 3 dropped
    x = mk([0.4, 0.3, 0.6], [0.2, 0.4, 0.2], [1.0, 1.0, -1.0], [0, 0, 1])
    loss, grad, m = run(x, LossConfig(corrections=[SeqMIS(lo=0.5, hi=2.0)]), 3.0)
    assert_close(loss, -1.5 * (l(0.4) + l(0.3)) / 3)
    assert_close(grad, [-0.5, -0.5, 0.0])
    assert m["corr/seq_dropped_frac"] == 0.5


@pytest.mark.parametrize("weight", ["one", "ratio"])
def test_geo_mask(weight):
    # seq 0: ρ_t = [1.02, 0.99], ρ̄ = sqrt(1.0098) ∈ [0.99, 1.01] kept; seq 1: ρ̄ = 1.05 dropped
    x = mk([0.51, 0.495, 0.525], [0.5, 0.5, 0.5], [1.0, 1.0, 1.0], [0, 0, 1])
    loss, grad, m = run(x, LossConfig(corrections=[GeoMask(lo=0.99, hi=1.01, weight=weight)]), 3.0)
    f = math.sqrt(1.02 * 0.99) if weight == "ratio" else 1.0
    assert_close(loss, -f * (l(0.51) + l(0.495)) / 3)
    assert_close(grad, [-f / 3, -f / 3, 0.0])
    assert m["corr/seq_dropped_frac"] == 0.5


def test_veto_drops_sequences_with_extreme_token():
    # seq 0 has ρ = 1e-5 < τ; seq 1 has ρ = 0.2/0.01 = 20 > τ_hi; seq 2 is clean
    x = mk([1e-5, 0.5, 0.2, 0.5], [1.0, 0.5, 0.01, 0.5], [1.0] * 4, [0, 0, 1, 2])
    loss, grad, m = run(x, LossConfig(corrections=[Veto(tau=1e-4)]), 4.0)
    assert_close(grad, [0.0, 0.0, -0.25, -0.25])
    assert_close(m["corr/seq_dropped_frac"], 1 / 3)
    x.trainer_logprobs.grad = None
    loss, grad, m = run(x, LossConfig(corrections=[Veto(tau=1e-4, tau_hi=10.0)]), 4.0)
    assert_close(loss, -l(0.5) / 4)
    assert_close(grad, [0.0, 0.0, 0.0, -0.25])


def test_opsm_drops_negative_advantage_off_policy_sequences():
    # mean(log q − log p_old) = −l(0.9) = 0.105 > δ for seqs 0, 1; 0 for seq 2
    x = mk([0.45, 0.45, 0.5], [0.5, 0.5, 0.5], [-1.0, 1.0, -1.0], [0, 1, 2])
    loss, grad, m = run(x, LossConfig(corrections=[OPSM(delta=1e-4)]), 3.0)
    assert_close(grad, [0.0, -1 / 3, 1 / 3])  # only seq 0 (A < 0, off-policy) is dropped
    assert_close(m["corr/seq_dropped_frac"], 1 / 3)


def test_ppo_clip_with_dual_clip():
    # r = p/p_old = [1.5, 0.5, 0.9, 1.1, 5]; A = [1, −1, 1, −1, −1]; ε = 0.2, c = 3
    p_old = [0.2, 0.4, 0.5, 0.5, 0.1]
    r = [1.5, 0.5, 0.9, 1.1, 5.0]
    x = mk(
        p_old,
        p_old,
        [1.0, -1.0, 1.0, -1.0, -1.0],
        [0, 1, 2, 3, 4],
        p=[a * b for a, b in zip(p_old, r, strict=True)],
    )
    cfg = LossConfig(objective=PPOClipObjective(eps_low=0.2, eps_high=0.2, dual_clip=3.0))
    loss, grad, m = run(x, cfg, 5.0)
    g = [1.2, -0.8, 0.9, -1.1, -3.0]  # clipped, clipped, r A, r A, dual-clipped to c A
    assert_close(loss, -sum(g) / 5)
    assert_close(
        grad, [0.0, 0.0, -0.9 / 5, 1.1 / 5, 0.0]
    )  # d(−g/D)/dlog p = −r A / D where unclipped
    assert_close(m["policy/clip_frac"], 3 / 5)
    assert_close(m["policy/tv"], 0.5 * (0.5 + 0.5 + 0.1 + 0.1 + 4.0) / 5)


def test_gspo_sequence_ratio():
    # seq 0: log r = [0.1, −0.3] -> s = e^{−0.1} inside [0.8, 1.2]; seq 1: s = e^{0.5} > 1.2, A > 0: clipped
    p_old = [0.3, 0.3, 0.3]
    x = mk(
        p_old,
        p_old,
        [2.0, 2.0, 1.0],
        [0, 0, 1],
        p=[0.3 * math.exp(0.1), 0.3 * math.exp(-0.3), 0.3 * math.exp(0.5)],
    )
    loss, grad, _ = run(x, LossConfig(objective=GSPOObjective(eps_low=0.2, eps_high=0.2)), 3.0)
    s = math.exp(-0.1)
    assert_close(loss, -(2 * s * 2 + 1.2) / 3)
    assert_close(grad, [-2 * s / 3, -2 * s / 3, 0.0])


def test_cispo_clips_only_the_weight():
    # r = [1.5, 0.5]: weights [1.2, 0.5] (no lower clip); gradient flows through both tokens
    x = mk([0.3, 0.4], [0.3, 0.4], [1.0, -1.0], [0, 1], p=[0.45, 0.2])
    loss, grad, m = run(x, LossConfig(objective=CISPOObjective(eps_high=0.2)), 2.0)
    assert_close(loss, -(1.2 * l(0.45) - 0.5 * l(0.2)) / 2)
    assert_close(grad, [-0.6, 0.25])
    assert m["policy/clip_frac"] == 0.5


def _sc_inputs(kind, q_c, p_c, q_y, p_y):
    """One position, y = first candidate, A = 1, candidate log-probs as a separate leaf."""
    x = mk([p_y], [q_y], [1.0], [0])
    x.cand_kind = kind
    x.cand_offsets = torch.tensor([0, len(q_c)])
    x.cand_trainer_logprobs = torch.tensor([l(v) for v in p_c], dtype=F64, requires_grad=True)
    x.cand_old_logprobs = torch.tensor([l(v) for v in p_c], dtype=F64)
    x.cand_sampler_logprobs = torch.tensor([l(v) for v in q_c], dtype=F64)
    return x


@pytest.mark.parametrize(
    ("rule", "w_y", "coeffs"),
    [
        (None, 1.0, [0.6, 0.4]),
        (MIS(lo=0.2, hi=5.0), 0.5 / 0.6, [0.5, 0.5]),  # q w = p_old in range
        (TIS(cap=1.1), 0.5 / 0.6, [0.5, 0.44]),  # ρ_b = 1.25 -> 1.1
    ],
)
def test_exact_sc_coefficients(rule, w_y, coeffs):
    # support {a, b}: q = [0.6, 0.4], p = p_old = [0.5, 0.5], y = a
    x = _sc_inputs("support", [0.6, 0.4], [0.5, 0.5], 0.6, 0.5)
    cfg = LossConfig(corrections=[rule] if rule else [], score_centering=True)
    loss, grad, _ = run(x, cfg, 1.0)
    assert_close(grad, [-w_y])  # −A w(y) / D on log p(y)
    assert_close(x.cand_trainer_logprobs.grad, coeffs)  # +A c(v) / D on each log p(v)
    assert_close(loss, -(w_y * l(0.5) - sum(coeffs) * l(0.5)))


@pytest.mark.parametrize(
    ("rule", "coeff"),
    [
        (None, 0.5 - 2 / 3 * 0.25),  # κ = 0.5/0.75, α = κ
        (TIS(cap=1.2), 0.25 - 0.8 * 0.25),  # w(ρ_a=0.5) = 0.5; tail ratio 1/κ = 1.5 -> 1.2, α = 0.8
        (MIS(lo=0.2, hi=1.4), 0.25),  # tail ratio 1.5 masked: α = 0
    ],
)
def test_head_tail_sc_coefficient(rule, coeff):
    # head {a}: q(a) = 0.5, p_old(a) = 0.25
    x = _sc_inputs("head", [0.5], [0.25], 0.5, 0.25)
    run(x, LossConfig(corrections=[rule] if rule else [], score_centering=True), 1.0)
    assert_close(x.cand_trainer_logprobs.grad, [coeff])


def test_head_tail_clamps_vanishing_tail():
    # the head holds all of q: 1 − q(H) = 0 clamped to tail_eps = 1e-6; 1 − p(H) = 1e-3
    x = _sc_inputs("head", [1.0], [0.999], 1.0, 0.999)
    run(x, LossConfig(score_centering=True), 1.0)
    kappa = 1e-6 / (1 - 0.999)
    assert_close(x.cand_trainer_logprobs.grad, [1.0 - kappa * 0.999])


def test_grpo_advantages():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, math.nan, 2.0, math.nan], dtype=F64)
    prompts = torch.tensor([7, 7, 7, 7, 9, 9, 9, 3, 3])
    status = ["ok"] * 6 + ["infra_failed", "ok", "infra_failed"]
    adv, keep, stats = grpo_advantages(rewards, prompts, status, eps=1e-6)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # sample std of [1, 0, 1, 0] is sqrt(1/3)
    assert_close(adv, [a, -a, a, -a, 0, 0, 0, 0, 0])
    assert keep.tolist() == [True] * 6 + [False, True, False]
    assert stats == {
        "rollout/infra_failed": 2.0,
        "rollout/groups": 3.0,
        "rollout/zero_signal_groups": 2.0,
        "rollout/empty_groups": 0.0,
    }
    adv2, _, _ = grpo_advantages(
        rewards, prompts, torch.tensor([s == "infra_failed" for s in status]), use_std=False
    )
    assert_close(adv2, [0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match=r"non-finite values at episodes \[6, 8\]"):
        grpo_advantages(rewards, prompts, ["ok"] * 9)


def test_aggregation_denominators_and_seq_mean_token_mean_scaling():
    mask = torch.tensor([True, True, False, True, True, True])
    ids = torch.tensor([0, 0, 0, 1, 2, 2])
    assert aggregation_denominator("token_mean", mask, ids, 4) == 5.0
    assert aggregation_denominator("seq_mean_token_mean", mask, ids, 4) == 3.0  # seq 3 is empty
    assert aggregation_denominator("seq_mean_token_sum_norm", mask, ids, 4, G=2, max_len=10) == 40.0
    with pytest.raises(ValueError, match="G=3 must be >= 1 and divide num_seqs=4"):
        aggregation_denominator("seq_mean_token_sum_norm", mask, ids, 4, G=3, max_len=10)
    with pytest.raises(ValueError, match="needs max_len"):
        aggregation_denominator("seq_mean_token_sum_norm", mask, ids, 4)
    with pytest.raises(ValueError, match="aggregation mode 'bogus'"):
        aggregation_denominator("bogus", mask, ids, 4)
    # seq_mean_token_mean: token t scaled by 1/L_i (L = [2, 1]), D = 2 sequences
    x = mk([0.5, 0.25, 0.8], [0.5, 0.25, 0.8], [1.0, 1.0, 1.0], [0, 0, 1])
    loss, grad, _ = run(x, LossConfig(aggregation="seq_mean_token_mean"), 2.0)
    assert_close(loss, -((l(0.5) + l(0.25)) / 2 + l(0.8)) / 2)
    assert_close(grad, [-0.25, -0.25, -0.5])


def test_mismatch_metrics_global_and_per_group():
    # ρ = [0.1, 2]: group "h100-fp8" holds token 0, "b200-nvfp4" token 1
    x = mk([0.05, 0.4], [0.5, 0.2], [1.0, 1.0], [0, 1], group_ids=torch.tensor([0, 1]))
    x.group_names = ["h100-fp8", "b200-nvfp4"]
    x.entropy = torch.tensor([1.0, 2.0], dtype=F64)
    m = mismatch_metrics(x)
    assert_close(m["mismatch/kl_k1"], (l(10) - l(2)) / 2)
    assert_close(m["mismatch/kl_k3"], ((0.1 - 1 - l(0.1)) + (2 - 1 - l(2))) / 2)
    assert_close(m["mismatch/tv"], 0.5 * (0.9 + 1.0) / 2)
    assert m["mismatch/ratio_oob"] == 0.5
    assert_close(m["mismatch/kl_k1/h100-fp8"], l(10))
    assert_close(m["mismatch/kl_k3/b200-nvfp4"], 2 - 1 - l(2))
    assert m["share/oob_tokens/h100-fp8"] == 1.0 and m["share/oob_tokens/b200-nvfp4"] == 0.0
    assert m["share/samples/h100-fp8"] == 0.5 and m["share/samples/b200-nvfp4"] == 0.5
    assert "mismatch/kl_exact" not in m
    _, full = compute_loss(x, LossConfig(), 2.0)
    assert_close(full["policy/entropy"], 1.5)
    assert full["corr/nonfinite_tokens"] == 0.0


def test_kl_exact_over_recorded_support():
    # support {a, b}: q = [0.5, 0.5], p̃_old = [0.25, 0.75]
    x = _sc_inputs("support", [0.5, 0.5], [0.25, 0.75], 0.5, 0.25)
    m = mismatch_metrics(x)
    assert_close(m["mismatch/kl_exact"], 0.5 * l(0.5 / 0.25) + 0.5 * l(0.5 / 0.75))
