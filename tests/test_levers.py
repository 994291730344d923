"""The training levers, each off by default, each against a float64 reference, each in the metrics.

ref_kl (k1/k3) and the entropy bonus: the exact expectation over the
vocabulary of the surrogate's gradient equals the gradient of the divergence
or entropy it stands for. Schedules: hand formulas. Dynamic sampling and
overlong handling: the buffer and the advantage step on hand-made groups.
"""

from __future__ import annotations

import math

import pytest
import torch

from mixrl.config import OverlongFilter, OverlongPenalty, RunConfig, build_config
from mixrl.config.loss import LossConfig, RefKL
from mixrl.corrections import LossInputs, compute_loss
from mixrl.corrections.regularizers import entropy_surrogate, ref_kl_surrogate
from mixrl.records.trajectory import Trajectory
from mixrl.rollout.advantages import batch_advantages, overlong_penalty
from mixrl.rollout.buffer import RolloutBuffer
from mixrl.train.schedule import lr_factor

torch.set_num_threads(1)
F64 = torch.float64


def _expected_grad(z: torch.Tensor, per_token) -> torch.Tensor:
    """Σ_y p(y) ∇_z ℓ(y): the exact expectation of the surrogate's gradient under y ~ softmax(z)."""
    p = torch.softmax(z.detach(), -1)
    total = torch.zeros_like(z)
    for y in range(z.shape[0]):
        zz = z.detach().clone().requires_grad_()
        lp = torch.log_softmax(zz, -1)
        (g,) = torch.autograd.grad(per_token(lp, y), zz)
        total += p[y] * g
    return total


@pytest.mark.parametrize("seed", [0, 1])
def test_ref_kl_estimators_have_the_kl_gradient(seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(6, generator=g, dtype=F64)
    zr = z + 0.7 * torch.randn(6, generator=g, dtype=F64)
    lref = torch.log_softmax(zr, -1)
    # k3 (GRPO): E_p[∇ℓ] = ∇ KL(p_ref ‖ p_θ)
    got = _expected_grad(z, lambda lp, y: ref_kl_surrogate(lp[y:y + 1], lref[y:y + 1], "k3", 20.0)[0].sum())
    zz = z.clone().requires_grad_()
    pr = lref.exp()
    (want,) = torch.autograd.grad((pr * (lref - torch.log_softmax(zz, -1))).sum(), zz)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # k1 (score-function form): E_p[∇ℓ] = ∇ KL(p_θ ‖ p_ref)
    got = _expected_grad(z, lambda lp, y: ref_kl_surrogate(lp[y:y + 1], lref[y:y + 1], "k1", 20.0)[0].sum())
    zz = z.clone().requires_grad_()
    lp = torch.log_softmax(zz, -1)
    (want,) = torch.autograd.grad((lp.exp() * (lp - lref)).sum(), zz)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # values: k3 = e^d − d − 1 and k1 = log p − log p_ref, d = log p_ref − log p
    lp0 = torch.log_softmax(z, -1)
    _, v3 = ref_kl_surrogate(lp0, lref, "k3", 20.0)
    _, v1 = ref_kl_surrogate(lp0, lref, "k1", 20.0)
    for y in range(6):
        d = float(lref[y] - lp0[y])
        assert float(v3[y]) == pytest.approx(math.exp(d) - d - 1, rel=1e-12)
        assert float(v1[y]) == pytest.approx(-d, rel=1e-12)


def test_entropy_surrogate_has_minus_the_entropy_gradient():
    z = torch.tensor([0.3, -1.2, 2.0, 0.1, -0.4], dtype=F64)

    def ent(lp):
        return -(lp.exp() * lp).sum()

    got = _expected_grad(z, lambda lp, y: entropy_surrogate(lp[y:y + 1], ent(lp).detach().reshape(1)).sum())
    zz = z.clone().requires_grad_()
    (want,) = torch.autograd.grad(-ent(torch.log_softmax(zz, -1)), zz)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _inputs(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(n, generator=g, dtype=F64) * 2).requires_grad_()
    return LossInputs(trainer_logprobs=lp, old_logprobs=lp.detach().clone(),
                      sampler_logprobs=lp.detach() - 0.1, advantages=torch.randn(n, generator=g, dtype=F64),
                      loss_mask=torch.ones(n, dtype=torch.bool), seq_ids=torch.tensor([0, 0, 0, 1, 1, 1]),
                      num_seqs=2, entropy=torch.rand(n, generator=g, dtype=F64) + 0.5,
                      ref_logprobs=lp.detach() - 0.3 * torch.rand(n, generator=g, dtype=F64))


def test_regularizers_in_the_loss_off_by_default():
    assert LossConfig().ref_kl is None and LossConfig().entropy_coef == 0.0
    inp = _inputs()
    base, m0 = compute_loss(inp, LossConfig(), 6.0)
    assert not any(k.startswith("reg/") for k in m0)
    cfg = LossConfig(ref_kl=RefKL(coef=0.5, estimator="k3"), entropy_coef=0.1)
    loss, m = compute_loss(inp, cfg, 6.0)
    lp, ref, ent = inp.trainer_logprobs.detach(), inp.ref_logprobs, inp.entropy
    d = ref - lp
    k3 = torch.exp(d) - d - 1
    want = float(base.detach()) + 0.5 * float(k3.sum()) / 6 + 0.1 * float(((lp + ent) * lp).sum()) / 6
    assert float(loss) == pytest.approx(want, rel=1e-12)
    assert m["reg/ref_kl"] == pytest.approx(float(k3.mean()), rel=1e-12)
    assert m["reg/entropy"] == pytest.approx(float(ent.mean()), rel=1e-12)
    with pytest.raises(ValueError, match="ref_logprobs"):
        inp.ref_logprobs = None
        compute_loss(inp, cfg, 6.0)


def test_trainer_ref_kl_is_zero_at_the_initial_policy_then_grows():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mixrl.train.trainer import Trainer

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    trajs = [Trajectory(prompt_id="p", sample_idx=i, tokens=[1, 2 + i, 3, 4], loss_mask=[0, 1, 1, 1],
                        sampler_logprobs=[0.0, -2.0, -2.0, -2.0], versions=[-1, 0, 0, 0], groups=["", "g", "g", "g"])
             for i in range(4)]
    cfg = LossConfig(ref_kl=RefKL(coef=0.1, estimator="k1"))
    tr = Trainer(model, cfg, lr=5e-2)
    m = tr.step(trajs, [1.0, -1.0, 1.0, -1.0])
    assert m["reg/ref_kl"] == 0.0  # p_θ is the reference at the first update
    for _ in range(3):
        m = tr.step(trajs, [1.0, -1.0, 1.0, -1.0])
    assert abs(m["reg/ref_kl"]) > 1e-4


def test_schedules_against_hand_formulas():
    kw = dict(total=11, warmup=0, min_ratio=0.1)
    assert lr_factor(0, schedule="constant", **kw) == 1.0
    for u in range(11):
        x = u / 10
        assert lr_factor(u, schedule="linear", **kw) == pytest.approx(1 - 0.9 * x, rel=1e-12)
        assert lr_factor(u, schedule="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * x)))
    w = dict(total=10, warmup=4, min_ratio=0.0)
    assert [lr_factor(u, schedule="cosine", **w) for u in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, schedule="cosine", **w) == 1.0 and lr_factor(9, schedule="cosine", **w) == pytest.approx(0.0)
    assert lr_factor(50, schedule="linear", **w) == pytest.approx(0.0)  # past the end: the last value
    with pytest.raises(ValueError, match="optim.schedule"):
        lr_factor(0, schedule="step", total=3)
    # through the run config: off by default, then the trainer's optim/lr follows it
    from mixrl.runtime.trainer_state import lr_schedule

    assert RunConfig().optim.schedule == "constant" and lr_schedule(RunConfig()) is None
    f = lr_schedule(build_config({}, ["optim.schedule=\"linear\"", "optim.warmup_steps=2", "runtime.steps=6"]))
    assert [f(u) for u in range(6)] == pytest.approx([0.5, 1.0, 1.0, 2 / 3, 1 / 3, 0.0])


def test_trainer_lr_follows_the_schedule():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mixrl.train.trainer import Trainer

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    tr = Trainer(model, LossConfig(), lr=1e-3, lr_schedule=lambda u: (u + 1) / 4)
    t = Trajectory(prompt_id="p", sample_idx=0, tokens=[1, 2, 3], loss_mask=[0, 1, 1],
                   sampler_logprobs=[0.0, -1.0, -1.0], versions=[-1, 0, 0], groups=["", "g", "g"])
    lrs = [tr.step([t, t], [1.0, -1.0])["optim/lr"] for _ in range(3)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4])


def _traj(pid: str, i: int, reward: float | None, n: int = 3, status: str = "ok", lp: float = -1.0) -> Trajectory:
    return Trajectory(prompt_id=pid, sample_idx=i, tokens=[1] + [2] * n, loss_mask=[0] + [1] * n,
                      sampler_logprobs=[0.0] + [lp] * n, versions=[-1] + [0] * n, groups=[""] + ["g"] * n,
                      reward=reward, status=status)


def test_dynamic_sampling_skips_zero_signal_groups_and_waits_for_more():
    for dyn in (False, True):
        buf = RolloutBuffer(2, dynamic_sampling=dyn)
        for pid, rs in (("a", (1.0, 1.0)), ("b", (0.0, 1.0)), ("c", (0.0, 0.0))):
            buf.open(pid, {"id": pid})
            for i, r in enumerate(rs):
                buf.add(_traj(pid, i, r))
        got = buf.take(2, 0)
        if not dyn:
            assert got is not None and [g[0].prompt_id for g in got[0]] == ["a", "b"]
            assert "rollout/dynamic_skipped_groups" not in got[1]
            continue
        assert got is None  # a and c carry no signal: only b is left, the caller samples more
        buf.open("d", {"id": "d"})
        buf.add(_traj("d", 0, 0.5))
        buf.add(_traj("d", 1, 0.25))
        groups, m = buf.take(2, 0)
        assert [g[0].prompt_id for g in groups] == ["b", "d"] and m["rollout/dynamic_skipped_groups"] == 2.0


def test_overlong_penalty_and_filter():
    assert [overlong_penalty(n, 20, 4, 1.0) for n in (10, 16, 17, 18, 20, 21)] == [0, 0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(18, 20, 4, 2.0) == -1.0
    cfg = LossConfig()
    groups = [[_traj("a", 0, 1.0, n=2), _traj("a", 1, 1.0, n=18), _traj("a", 2, 0.0, n=20, status="truncated")]]
    kw = dict(vocab_size=8, cand_kind="none", budget=20)
    trajs, adv, m = batch_advantages(groups, cfg, **kw)
    assert len(trajs) == 3 and "rollout/overlong_penalty" not in m  # off by default
    trajs, adv, m = batch_advantages(groups, cfg, overlong=OverlongPenalty(buffer=4, factor=1.0), **kw)
    r = torch.tensor([1.0, 1.0 - 0.5, 0.0 - 1.0], dtype=F64)
    want = ((r - r.mean()) / (r.std() + 1e-6)).tolist()
    assert adv == pytest.approx(want, rel=1e-9) and m["rollout/overlong_penalty"] == pytest.approx(-0.5)
    trajs, adv, m = batch_advantages(groups, cfg, overlong=OverlongFilter(), **kw)
    assert [t.sample_idx for t in trajs] == [0, 1] and m["rollout/overlong_filtered"] == 1.0
    assert adv == [0.0, 0.0]  # the two kept rewards are equal: no signal once the truncated one is out
    with pytest.raises(Exception, match="overlong"):
        build_config({}, ['rollout.overlong={type="clip"}'])
