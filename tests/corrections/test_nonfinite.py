"""Property 9: NaN/±inf inputs are masked and counted, never propagated; shape errors name the field."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tolerance import assert_close

from corrections.reference import F64, make_batch, to_inputs
from corrections.strategies import SETTINGS, loss_configs, seeds
from mixrl.config.loss import MIS, LossConfig
from mixrl.corrections import LossInputs, compute_loss, mismatch_metrics

BAD = [math.nan, math.inf, -math.inf]
FIELDS = ["trainer_logprobs", "old_logprobs", "sampler_logprobs", "advantages"]


def _poison(x: LossInputs, field: str, t: int, value: float) -> LossInputs:
    """Copy of ``x`` whose ``field`` holds ``value`` at token t (gradient still reaches the rest)."""
    src = getattr(x, field)
    new = torch.where(torch.arange(src.shape[0]) == t, torch.tensor(value, dtype=src.dtype), src)
    kw = dict(x.__dict__)
    kw[field] = new
    return LossInputs(**kw)


@SETTINGS
@given(
    seed=seeds,
    cfg=loss_configs(),
    field=st.sampled_from(FIELDS + ["cand"]),
    value=st.sampled_from(BAD),
    t=st.integers(0, 5),
)
def test_p9_nonfinite_token_is_masked_counted_and_not_propagated(seed, cfg, field, value, t):
    if cfg.aggregation == "seq_mean_token_mean":
        # the bad token keeps its place in L_i (like any masked token), so removing it from
        # loss_mask would change L_i: compare under the other conventions
        cfg = cfg.model_copy(update={"aggregation": "token_mean"})
    b = make_batch(seed, [3, 2, 1], vocab=6, mismatch=0.5, drift=0.1)
    cand = "support" if cfg.score_centering else "none"
    x = to_inputs(b, cand)
    if field == "cand":
        if cand == "none":
            x = to_inputs(b, "support")
        assert x.cand_sampler_logprobs is not None and x.cand_offsets is not None
        k = int(x.cand_offsets[t])  # first candidate of position t
        x.cand_sampler_logprobs = x.cand_sampler_logprobs.clone()
        x.cand_sampler_logprobs[k] = value
    else:
        x = _poison(x, field, t, value)
    loss, m = compute_loss(x, cfg, 6.0)
    assert torch.isfinite(loss)
    (g,) = torch.autograd.grad(loss, b.z, retain_graph=True)
    assert bool(torch.isfinite(g).all())
    assert m["corr/nonfinite_tokens"] == 1.0
    assert all(math.isfinite(v) for v in m.values())
    # identical to the clean batch with that token removed from the loss (D unchanged)
    clean = to_inputs(b, "support" if field == "cand" else cand)
    clean.loss_mask = clean.loss_mask.clone()
    clean.loss_mask[t] = False
    ref, m_ref = compute_loss(clean, cfg, 6.0)
    assert_close(loss, ref)
    assert_close(g, torch.autograd.grad(ref, b.z, retain_graph=True)[0])
    assert m_ref["corr/nonfinite_tokens"] == 0.0


@pytest.mark.parametrize(
    "cfg", [LossConfig(), LossConfig(corrections=[MIS()], score_centering=True)]
)
def test_all_masked_batch_returns_attached_zero(cfg):
    b = make_batch(0, [2, 2], vocab=6)
    x = to_inputs(b, "support", loss_mask=torch.zeros(4, dtype=torch.bool))
    x.sampler_logprobs = torch.full((4,), math.nan, dtype=F64)
    for denom in (0.0, 4.0):
        loss, m = compute_loss(x, cfg, denom)
        assert loss.item() == 0.0 and loss.requires_grad
        (g,) = torch.autograd.grad(loss, b.z, retain_graph=True)
        assert bool((g == 0).all())
    assert m["corr/nonfinite_tokens"] == 0.0  # off-mask garbage is not a data error


def test_empty_batch_returns_attached_zero():
    lp = torch.zeros(0, dtype=F64, requires_grad=True)
    e = torch.zeros(0, dtype=F64)
    x = LossInputs(
        lp, e, e, e, torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.long), 0
    )
    loss, m = compute_loss(x, LossConfig(), 0.0)
    loss.backward()
    assert loss.item() == 0.0 and lp.grad is not None
    assert m["corr/ess"] == 0.0 and m["mismatch/kl_k3"] == 0.0


def test_every_nonfinite_kind_counted_at_once():
    b = make_batch(4, [4, 4], vocab=6)
    x = to_inputs(b)
    for t, (field, value) in enumerate(zip(FIELDS, BAD + [math.nan], strict=True)):
        x = _poison(x, field, t, value)
    loss, m = compute_loss(x, LossConfig(corrections=[MIS()]), 8.0)
    assert torch.isfinite(loss) and m["corr/nonfinite_tokens"] == 4.0
    assert math.isfinite(mismatch_metrics(x)["mismatch/kl_k3"])


@pytest.mark.parametrize("field", FIELDS + ["loss_mask", "seq_ids", "entropy", "group_ids"])
def test_shape_mismatch_names_field_and_shapes(field):
    x = to_inputs(make_batch(0, [2, 3], vocab=6))
    setattr(x, field, getattr(x, field)[:-1])
    if field == "trainer_logprobs":  # N comes from it, so the next field is the one named
        pattern = r"LossInputs\.old_logprobs has shape \(5,\), expected \(4,\) \(N from trainer_logprobs\)"
    else:
        pattern = (
            rf"LossInputs\.{field} has shape \(4,\), expected \(5,\) \(N from trainer_logprobs\)"
        )
    with pytest.raises(ValueError, match=pattern):
        compute_loss(x, LossConfig(), 5.0)


def test_dtype_and_range_errors():
    x = to_inputs(make_batch(0, [2, 3], vocab=6))
    x.loss_mask = x.loss_mask.long()
    with pytest.raises(ValueError, match="loss_mask has dtype torch.int64, expected torch.bool"):
        x.validate()
    x = to_inputs(make_batch(0, [2, 3], vocab=6))
    x.num_seqs = 1
    with pytest.raises(ValueError, match=r"seq_ids range \[0, 1\] is outside"):
        x.validate()
    x = to_inputs(make_batch(0, [2, 3], vocab=6), "support")
    x.cand_offsets = x.cand_offsets.clone()
    x.cand_offsets[-1] -= 1
    with pytest.raises(ValueError, match="cand_offsets must rise from 0 to K=30"):
        x.validate()
    x = to_inputs(make_batch(0, [2, 3], vocab=6), "support")
    x.cand_old_logprobs = x.cand_old_logprobs[:-2]
    with pytest.raises(
        ValueError,
        match=r"cand_old_logprobs has shape \(28,\), expected \(30,\) \(K from cand_trainer_logprobs\)",
    ):
        x.validate()


def test_config_needs_matching_candidates():
    x = to_inputs(make_batch(0, [2], vocab=6))
    with pytest.raises(ValueError, match="score_centering=True needs candidates"):
        compute_loss(x, LossConfig(score_centering=True), 2.0)
    with pytest.raises(ValueError, match="support_replay=True needs cand_kind 'support'"):
        compute_loss(
            to_inputs(make_batch(0, [2], vocab=6), "head"), LossConfig(support_replay=True), 2.0
        )
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="denom must be a finite number >= 0"):
            compute_loss(x, LossConfig(), bad)
