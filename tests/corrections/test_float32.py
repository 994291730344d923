"""The float32 path (what a CPU/bf16 trainer runs) agrees with float64 for every preset."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close

from corrections.reference import make_batch, to_inputs
from mixrl.config.presets import PRESETS, get_preset
from mixrl.corrections import LossInputs, aggregation_denominator, compute_loss


def _cast(x: LossInputs, dtype: torch.dtype) -> tuple[LossInputs, list[torch.Tensor]]:
    """Copy of ``x`` in ``dtype`` with fresh leaves for the two differentiable fields."""
    kw = dict(x.__dict__)
    leaves = []
    for name, value in x.__dict__.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            kw[name] = value.detach().to(dtype)
            if name in ("trainer_logprobs", "cand_trainer_logprobs"):
                kw[name].requires_grad_()
                leaves.append(kw[name])
    return LossInputs(**kw), leaves


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_float32_matches_float64(name):
    p = get_preset(name)
    b = make_batch(
        5,
        [4, 3, 4],
        vocab=12,
        mismatch=0.3,
        drift=0.05,
        top_p=0.9 if p.loss.support_replay else None,
    )
    x = to_inputs(b, p.cand_kind, head_k=4)
    d = aggregation_denominator(p.loss.aggregation, x.loss_mask, x.seq_ids, x.num_seqs, max_len=4)
    out = {}
    for dt in (torch.float64, torch.float32):
        xi, leaves = _cast(x, dt)
        loss, metrics = compute_loss(xi, p.loss, d)
        out[dt] = (loss, torch.autograd.grad(loss, leaves, allow_unused=True), metrics)
    (l64, g64, m64), (l32, g32, m32) = out[torch.float64], out[torch.float32]
    assert l32.dtype == torch.float32
    assert_close(l32, l64, kind="f32")
    for a, e in zip(g32, g64, strict=True):
        assert (a is None) == (e is None)  # candidates are unused without score centering
        if a is not None:
            assert_close(a, e, kind="f32")
    for k in ("mismatch/kl_k3", "mismatch/tv", "corr/ess", "policy/entropy"):
        assert_close(m32[k], m64[k], kind="f32")


def test_bfloat16_trainer_logprobs_are_promoted():
    b = make_batch(2, [3, 3], vocab=8, mismatch=0.3)
    x, leaves = _cast(to_inputs(b), torch.bfloat16)
    loss, _ = compute_loss(x, get_preset("grpo+mis").loss, 6.0)
    assert loss.dtype == torch.float32
    (g,) = torch.autograd.grad(loss, leaves[0])
    assert g.dtype == torch.bfloat16 and bool(torch.isfinite(g).all())
