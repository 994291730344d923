"""LossConfig validation, check_updates, and the named presets."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from corrections.reference import make_batch, to_inputs
from mixrl.config.loss import MIS, LossConfig
from mixrl.config.presets import PRESETS, SEED_ARMS, Preset, check_updates, get_preset
from mixrl.corrections import aggregation_denominator, compute_loss

EXPECTED = {
    "grpo", "grpo+mis", "sc", "grpo+top-p", "sc+mis", "sc+mis+top-p", "tis", "icepop",
    "seq-mis", "geo-mask", "veto", "opsm", "gspo", "decoupled-ppo", "on-policy", "fp16",
    "trl-grpo", "trl-grpo+vllm", "verl-grpo", "verl-grpo+tis",
}  # fmt: skip


@pytest.mark.parametrize(
    ("corr", "pattern"),
    [
        ({"type": "mis", "lo": 5.0, "hi": 0.2}, r"mis\.lo=5\.0 must not exceed mis\.hi=0\.2"),
        ({"type": "seq_mis", "lo": 3.0, "hi": 2.0}, r"seq_mis\.lo=3\.0 must not exceed"),
        ({"type": "geo_mask", "lo": 1.1, "hi": 1.0}, r"geo_mask\.lo=1\.1"),
        (
            {"type": "tis", "cap": -1.0},
            r"corrections\.0\.tis\.cap\n  Input should be greater than 0",
        ),
        ({"type": "seq_tis", "cap": 0.0}, r"seq_tis\.cap"),
        ({"type": "mis", "lo": -0.1}, r"mis\.lo\n  Input should be greater than or equal to 0"),
        ({"type": "veto", "tau": 0.0}, r"veto\.tau"),
        ({"type": "opsm", "delta": -1.0}, r"opsm\.delta"),
        ({"type": "tis", "cap": math.nan}, r"tis\.cap"),
        ({"type": "bogus"}, r"does not match any of the expected tags"),
        ({"type": "tis", "cap": 2.0, "extra": 1}, r"tis\.extra\n  Extra inputs are not permitted"),
    ],
)
def test_bad_correction_names_the_field(corr, pattern):
    with pytest.raises(ValidationError, match=pattern):
        LossConfig(corrections=[corr])


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"objective": {"type": "ppo_clip", "eps_low": 1.5}}, r"ppo_clip\.eps_low"),
        ({"objective": {"type": "ppo_clip", "dual_clip": 0.5}}, r"ppo_clip\.dual_clip"),
        ({"objective": {"type": "gspo", "eps_high": -1}}, r"gspo\.eps_high"),
        ({"objective": {"type": "sgd"}}, r"objective"),
        ({"aggregation": "mean"}, r"aggregation"),
        ({"log_ratio_clamp": 0.0}, r"log_ratio_clamp"),
        ({"tail_eps": 0.0}, r"tail_eps"),
        ({"advantage": {"eps": -1.0}}, r"advantage\.eps"),
        ({"corrections": [{"type": "tis"}, {"type": "tis"}]}, r"lists 'tis' 2 times"),
        ({"corrections": [{"type": "tis"}, {"type": "mis"}]}, r"two token weights"),
        ({"corrections": [{"type": "seq_tis"}, {"type": "seq_mis"}]}, r"two sequence weights"),
        (
            {"corrections": [{"type": "mis"}, {"type": "seq_mis"}]},
            r"counts every token ratio twice",
        ),
        (
            {"corrections": [{"type": "tis"}, {"type": "geo_mask", "weight": "ratio"}]},
            r"counts every token",
        ),
        (
            {"score_centering": True, "objective": {"type": "gspo"}},
            r"score_centering is defined for token",
        ),
    ],
)
def test_bad_loss_config_is_rejected(kw, pattern):
    with pytest.raises(ValidationError, match=pattern):
        LossConfig(**kw)


def test_masks_compose_with_weights_and_infinite_bounds_are_allowed():
    cfg = LossConfig(
        corrections=[
            {"type": "mis", "lo": 0.0, "hi": math.inf},
            {"type": "veto"},
            {"type": "opsm"},
            {"type": "geo_mask"},
        ]
    )
    assert [c.type for c in cfg.corrections] == ["mis", "veto", "opsm", "geo_mask"]
    assert cfg.token_weight() == MIS(lo=0.0, hi=math.inf)
    assert LossConfig.model_validate_json(
        LossConfig(corrections=[MIS()]).model_dump_json()
    ) == LossConfig(corrections=[MIS()])


def test_check_updates():
    check_updates(get_preset("sc+mis").loss, 1)
    check_updates(get_preset("decoupled-ppo").loss, 4)
    with pytest.raises(ValueError, match=r"optim\.epochs=2 \(loss\.objective\.type='ppo_clip'\): score centering"):
        check_updates(LossConfig(score_centering=True, objective={"type": "ppo_clip"}), 2)
    with pytest.raises(ValueError, match=r"optim\.minibatches=3 \(loss\.objective\.type='pg'\): the pg objective"):
        check_updates(LossConfig(), 1, 3)
    with pytest.raises(ValueError, match="optim.epochs must be >= 1"):
        check_updates(LossConfig(), 0)


def test_presets_all_construct_and_run():
    assert set(PRESETS) == EXPECTED and set(SEED_ARMS) <= EXPECTED
    b = make_batch(1, [3, 2], vocab=8, mismatch=0.5, top_p=0.9)
    for name in PRESETS:
        p = get_preset(name)
        assert isinstance(p, Preset) and p.name == name and p.description
        if p.cand_kind == "head":
            b_full = make_batch(1, [3, 2], vocab=8, mismatch=0.5)
            x = to_inputs(b_full, "head", head_k=3)
        else:
            x = to_inputs(b, p.cand_kind)
        loss, m = compute_loss(
            x, p.loss, aggregation_denominator(p.loss.aggregation, x.loss_mask, x.seq_ids, 2)
        )
        assert torch.isfinite(loss) and "mismatch/kl_k3" in m


def test_seed_arms_settings():
    assert get_preset("grpo").loss == LossConfig()
    assert get_preset("grpo+mis").loss.corrections == [MIS(lo=0.2, hi=5.0)]
    for name in ("grpo+top-p", "sc+mis+top-p"):
        p = get_preset(name)
        assert p.sampler_top_p < 1.0 and p.loss.support_replay and p.cand_kind == "support"
    for name in ("sc", "sc+mis"):
        p = get_preset(name)
        assert p.sampler_top_p == 1.0 and p.loss.score_centering and p.cand_kind == "head"
    assert get_preset("sc+mis+top-p").loss.corrections == [MIS(lo=0.2, hi=5.0)]
    assert get_preset("icepop").loss.corrections == [MIS(lo=0.5, hi=5.0)]


def test_get_preset_returns_a_copy_and_unknown_lists_names():
    p = get_preset("sc+mis")
    p.loss.corrections.clear()
    assert get_preset("sc+mis").loss.corrections
    with pytest.raises(
        ValueError, match=r"unknown preset 'nope'; valid presets: grpo, grpo\+mis, sc,"
    ):
        get_preset("nope")


def test_preset_sampling_consistency():
    with pytest.raises(ValidationError, match="support_replay needs sampler_top_p < 1"):
        Preset(name="x", loss=LossConfig(support_replay=True), sampler_top_p=1.0)
    with pytest.raises(
        ValidationError, match="head\\+tail score centering needs full-vocabulary sampling"
    ):
        Preset(name="x", loss=LossConfig(score_centering=True), sampler_top_p=0.9)


def test_config_modules_do_not_import_torch():
    code = "import sys, mixrl.config.loss, mixrl.config.presets; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
