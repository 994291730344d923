"""compute_loss against the float64 brute-force reference, for every composition.

The reference (``reference.py``) works in probability space with explicit
loops and, for score centering, sums over the *whole* vocabulary (with the
tail model substituted for head+tail); the implementation works in log space
with segment reductions and the collapsed head form. Gradients are taken with
respect to the trainer's logits.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from tolerance import assert_close

from corrections.reference import make_batch, ref_loss, to_inputs
from corrections.strategies import SETTINGS, lengths, loss_configs, seeds
from mixrl.corrections import aggregation_denominator, compute_loss


def _denom(cfg, x, max_len=4):
    return aggregation_denominator(
        cfg.aggregation, x.loss_mask, x.seq_ids, x.num_seqs, max_len=max_len
    )


def _grad(loss, z):
    (g,) = torch.autograd.grad(loss, z, retain_graph=True)
    return g


@SETTINGS
@given(
    seed=seeds,
    lens=lengths,
    cfg=loss_configs(score_centering=False),
    drift=st.sampled_from([0.0, 0.3]),
)
def test_loss_and_gradient_match_reference_without_sc(seed, lens, cfg, drift):
    b = make_batch(seed, lens, vocab=7, mismatch=0.6, drift=drift)
    x = to_inputs(b)
    d = _denom(cfg, x)
    loss, _ = compute_loss(x, cfg, d)
    ref = ref_loss(b, cfg, d)
    assert_close(loss, ref)
    assert_close(_grad(loss, b.z), _grad(ref_loss(b, cfg, d), b.z))


@SETTINGS
@given(seed=seeds, lens=lengths, cfg=loss_configs(score_centering=True), vocab=st.integers(6, 10))
def test_exact_sc_matches_full_vocabulary_sum(seed, lens, cfg, vocab):
    """Support = whole vocabulary: loss value and gradient equal the enumerated sum."""
    b = make_batch(seed, lens, vocab=vocab, mismatch=0.6)
    x = to_inputs(b, "support")
    d = _denom(cfg, x)
    loss, _ = compute_loss(x, cfg, d)
    assert_close(loss, ref_loss(b, cfg, d, cand="support"))
    assert_close(_grad(loss, b.z), _grad(ref_loss(b, cfg, d, cand="support"), b.z))


@SETTINGS
@given(seed=seeds, lens=lengths, cfg=loss_configs(score_centering=True, support_replay=True))
def test_exact_sc_with_top_p_replay_matches_reference(seed, lens, cfg):
    b = make_batch(seed, lens, vocab=9, mismatch=0.6, top_p=0.8)
    x = to_inputs(b, "support")
    d = _denom(cfg, x)
    loss, _ = compute_loss(x, cfg, d)
    assert_close(loss, ref_loss(b, cfg, d, cand="support"))
    assert_close(_grad(loss, b.z), _grad(ref_loss(b, cfg, d, cand="support"), b.z))


@SETTINGS
@given(seed=seeds, lens=lengths, cfg=loss_configs(score_centering=True), k=st.integers(1, 5))
def test_head_tail_sc_gradient_matches_substituted_tail_model(seed, lens, cfg, k):
    """Property 4b: collapsed head form == brute-force sum with q's tail := κ p (gradients)."""
    b = make_batch(seed, lens, vocab=8, mismatch=0.6)
    x = to_inputs(b, "head", head_k=k)
    d = _denom(cfg, x)
    loss, _ = compute_loss(x, cfg, d)
    ref = ref_loss(b, cfg, d, cand="head", head_k=k)
    assert_close(_grad(loss, b.z), _grad(ref, b.z))
