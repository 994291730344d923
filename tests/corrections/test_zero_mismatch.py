"""Where there is no mismatch, what does each seed preset train? (float64, enumerated exactly)

The ablation's candidates, checked by test: at p = q (i) every weight rule and score
centering leave the policy gradient unchanged, at the same scale, with the same
advantage, aggregation and denominator as ``grpo``; (ii) a ``+top-p`` preset's
expected gradient is that of the *truncated* objective E_{p̃}[r] (p̃ = p renormalised
on the nucleus), not of E_p[r]: the logits outside the nucleus get exactly zero, so
the tail that a full-distribution evaluation samples is never trained down.
"""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close

from corrections.reference import F64, Batch, probs, to_inputs, top_p_support
from mixrl.config.presets import PRESETS
from mixrl.corrections import compute_loss

SEED_ARMS = ("grpo", "grpo+mis", "sc", "grpo+top-p", "sc+mis", "sc+mis+top-p")


def _bandit(seed: int, vocab: int, top_p: float | None) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """One context, every token of q's support enumerated once with advantage q(y)(r(y) − E_q r):
    Σ_y of the per-token loss is the expectation over y ~ q, exactly. p_θ = p_old = q."""
    g = torch.Generator().manual_seed(seed)
    z0 = torch.randn(1, vocab, generator=g, dtype=F64) * 1.5
    r = torch.rand(vocab, generator=g, dtype=F64)
    support = top_p_support(probs(z0), top_p) if top_p is not None else None
    q = probs(z0, support)[0]
    ys = torch.nonzero(q > 0).squeeze(1)
    n = len(ys)
    z = z0.repeat(n, 1).requires_grad_()
    base = float((q * r).sum())
    adv = q[ys] * (r[ys] - base)
    sup = None if support is None else support.repeat(n, 1)
    b = Batch(z, z0.repeat(n, 1), z0.repeat(n, 1), ys, adv, torch.arange(n), n, sup,
              torch.zeros(n, dtype=torch.long), ["g"])
    return b, z0, r


def _logit_grad(preset: str, b: Batch) -> torch.Tensor:
    cfg = PRESETS[preset].loss
    kind = PRESETS[preset].cand_kind
    x = to_inputs(b, {"none": "none", "head": "head", "support": "support"}[kind], head_k=3)
    loss, _ = compute_loss(x, cfg, 1.0)
    (grad,) = torch.autograd.grad(loss, b.z)
    return grad.sum(0)  # [V]: the copies of the one context summed


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_vocabulary_presets_equal_grpo_at_p_equals_q(seed):
    """sc, grpo+mis, sc+mis: the same expected gradient as grpo, to float64 rounding (scale 1)."""
    b, _, _ = _bandit(seed, vocab=9, top_p=None)
    ref = _logit_grad("grpo", b)
    assert ref.abs().max() > 1e-3
    for arm in ("grpo+mis", "sc", "sc+mis"):
        assert_close(_logit_grad(arm, b), ref, msg=arm)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_p_presets_train_the_truncated_objective_not_the_policy(seed):
    b, z0, r = _bandit(seed, vocab=9, top_p=0.8)
    assert b.support is not None
    sup = b.support[0]
    assert 1 < int(sup.sum()) < 9, "the nucleus must leave a tail for the test to mean anything"
    z = z0[0].clone().requires_grad_()
    (trunc,) = torch.autograd.grad((probs(z[None], sup[None])[0] * r).sum(), z)  # ∇ E_{p̃}[r]
    (full,) = torch.autograd.grad((probs(z[None])[0] * r).sum(), z)  # ∇ E_p[r]
    for arm in ("grpo+top-p", "sc+mis+top-p"):
        g = _logit_grad(arm, b)
        assert_close(-g, trunc, msg=arm)  # the loss is minimised: its gradient is −∇J
        assert bool((g[~sup] == 0).all()), f"{arm}: a tail logit received gradient"
    # the full distribution's gradient does move the tail: this is what the top-p arms forgo
    assert float(full[~sup].abs().max()) > 1e-4


def test_every_seed_preset_shares_grpo_advantage_aggregation_objective_and_lr():
    """The presets differ only by their correction ingredients: same advantage estimator,
    aggregation (denominator), objective and regularizers as grpo."""
    base = PRESETS["grpo"].loss.model_dump()
    ingredients = {"corrections", "score_centering", "support_replay"}
    for arm in SEED_ARMS:
        d = PRESETS[arm].loss.model_dump()
        diff = {k for k in base if d[k] != base[k]}
        assert diff <= ingredients, f"{arm} also changes {sorted(diff - ingredients)}"
