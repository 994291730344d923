"""Defects that used to pass silently, each pinned by a test (docs/corrections.md sections 4, 8, 9, 12).

- the Dr. GRPO denominator is S · generation budget, not the longest sequence of the minibatch;
- GRPO statistics leave out the trajectories the trainer will drop as malformed;
- a trajectory records its sampling parameters and the trainer uses them;
- log_ratio_clamp is bounded so that corr/ess stays finite in float32;
- a positive sampler log-probability is malformed.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import Qwen3Config, Qwen3ForCausalLM

from mixrl.config.loss import LossConfig
from mixrl.config.presets import get_preset
from mixrl.records.trajectory import Trajectory
from mixrl.train.trainer import Trainer

V = 16


def _model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8))


def _traj(i: int, n: int, reward: float = 1.0, lp: float = -1.0, info: dict | None = None) -> Trajectory:
    return Trajectory(prompt_id=f"p{i // 2}", sample_idx=i % 2, tokens=[1] + [2 + i % 5] * n, loss_mask=[0] + [1] * n,
                      sampler_logprobs=[0.0] + [lp] * n, versions=[-1] + [0] * n, groups=[""] + ["g"] * n,
                      reward=reward, info=dict(info or {}))


def test_dr_grpo_denominator_uses_the_generation_budget():
    from mixrl.config import build_config
    from mixrl.runtime.trainer_state import generation_budget

    cfg = LossConfig(aggregation="seq_mean_token_sum_norm", advantage={"use_std": False})
    tr = Trainer(_model(), cfg, lr=1e-3, gen_budget=40)
    records, _ = tr._prepare([_traj(0, 3), _traj(1, 5), _traj(2, 2), _traj(3, 4)], [1.0, -1.0, 0.5, -0.5], False)
    assert tr.denominator(records, "seq_mean_token_sum_norm", None, None) == 4 * 40  # not 4 * 5
    # the run's budget: max_total_tokens, or max_turns x max_new_tokens when smaller
    assert generation_budget(build_config({}, ["rollout.max_total_tokens=160", "rollout.max_new_tokens=40"])) == 160
    c = build_config({}, ["rollout.max_total_tokens=160", "rollout.max_new_tokens=40", "env.options={max_turns=3}"])
    assert generation_budget(c) == 120


def test_advantages_leave_out_malformed_trajectories():
    from mixrl.rollout.advantages import batch_advantages

    good = [_traj(0, 3, reward=1.0), _traj(1, 3, reward=0.0), _traj(2, 3, reward=0.5)]
    broken = _traj(3, 3, reward=1.0)
    broken.sampler_logprobs = broken.sampler_logprobs[:-1]  # one log-prob too few
    good[2].prompt_id = broken.prompt_id = "p0"
    group = [good[0], good[1], good[2], broken]
    for t, i in zip(group, range(4), strict=True):
        t.sample_idx = i
    trajs, adv, m = batch_advantages([group], LossConfig(), vocab_size=V, cand_kind="none")
    r = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    want = ((r - r.mean()) / (r.std() + 1e-6)).tolist()
    assert adv[:3] == pytest.approx(want, rel=1e-9) and adv[3] == 0.0
    assert m["rollout/malformed"] == 1.0 and len(trajs) == 4  # the trainer still drops and counts it


def test_trainer_uses_the_recorded_sampling_parameters():
    from mixrl.records.generation import SamplingParams

    t = _traj(0, 3)
    t.record_sampling(SamplingParams(temperature=0.7, top_p=1.0))
    assert t.info["sampling"] == [{"temperature": 0.7, "top_p": 1.0, "top_k": 0}] and t.info["temperature"] == 0.7
    tr = Trainer(_model(), get_preset("grpo").loss, lr=1e-3, temperature=1.0)
    (rec,), _ = tr._prepare([t], [1.0], False)
    assert rec.temperature == 0.7  # not the run-wide 1.0
    # top-p sampling without support replay, or two temperatures in one trajectory: malformed
    bad_p, bad_t = _traj(1, 3), _traj(2, 3)
    bad_p.record_sampling(SamplingParams(top_p=0.9))
    bad_t.record_sampling(SamplingParams(temperature=1.0))
    bad_t.record_sampling(SamplingParams(temperature=0.5))
    recs, stats = tr._prepare([t, bad_p, bad_t], [1.0, 1.0, 1.0], False)
    assert len(recs) == 1 and stats.dropped_malformed == 2
    assert "top_p=0.9" in stats.errors[0] and "mixes temperatures" in stats.errors[1]


def test_log_ratio_clamp_bounded_for_float32_ess():
    LossConfig(log_ratio_clamp=40.0)
    with pytest.raises(ValidationError, match="log_ratio_clamp"):
        LossConfig(log_ratio_clamp=45.0)  # e^90 > float32 max: corr/ess would be NaN


def test_positive_sampler_logprob_is_malformed():
    tr = Trainer(_model(), get_preset("grpo").loss, lr=1e-3)
    recs, stats = tr._prepare([_traj(0, 3), _traj(1, 3, lp=0.5), _traj(2, 3, lp=1e-7)], [1.0, 1.0, 1.0], False)
    assert stats.dropped_malformed == 1 and "positive log-probability" in stats.errors[0]
    assert len(recs) == 2  # 1e-7 is float rounding, accepted
