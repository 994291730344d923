"""Guard rails: every unsafe run setting exits 2 at ``mixrl train --dry-run`` with one line.

The line names both fields and the fix (docs/corrections.md section 12). Each
case goes through the real command line (``mixrl.commands.main.main``), which never
imports torch for a dry run. A step that drops more than half its batch as
malformed fails the run (the trainer raises, naming the reason).
"""

from __future__ import annotations

import pytest

from mixrl.commands.main import main
from mixrl.config.presets import PRESETS, REQUIREMENTS, Needs, check_run

# (overrides, fragments that must all appear in the one error line)
REJECTED = [
    # head candidates needed, sampler top-p < 1 (every trajectory dropped as malformed)
    (["loss.preset=sc", "rollout.top_p=0.9"], ["rollout.top_p=0.9", "loss.preset='sc'", "rollout.top_p=1.0"]),
    (["loss.preset=sc+mis", "rollout.top_p=0.9"], ["rollout.top_p=0.9", "loss.preset='sc+mis'"]),
    # head candidates needed, nothing recorded
    (["loss.preset=sc", "rollout.record=none"], ["rollout.record='none'", "loss.preset='sc'", "head:K"]),
    (["loss.preset=sc+mis", "rollout.record=none"], ["rollout.record='none'", "loss.preset='sc+mis'"]),
    # support needed, head or nothing recorded
    (["loss.preset=sc+mis+top-p", "rollout.record=head:8"], ["rollout.record='head:8'", "'support'"]),
    (["loss.preset=grpo+top-p", "rollout.record=none"], ["rollout.record='none'", "loss.preset='grpo+top-p'"]),
    # support replay without top-p sampling
    (["loss.preset=grpo+top-p", "rollout.top_p=1.0"], ["rollout.top_p=1.0", "support replay"]),
    # pg objective with several updates per batch
    (["loss.preset=grpo", "optim.minibatches=2"], ["optim.minibatches=2", "'pg'", "optim.minibatches=1"]),
    (["loss.preset=grpo+mis", "optim.epochs=2"], ["optim.epochs=2", "'pg'", "optim.epochs=1"]),
    # score centering with several updates per batch (even with a ratio objective)
    (["loss.preset=sc+mis+top-p", "optim.minibatches=4"], ["optim.minibatches=4", "score centering"]),
    (["loss.preset=sc", 'loss.overrides.objective={type="ppo_clip"}', "optim.epochs=2"],
     ["optim.epochs=2", "score centering", "optim.epochs=1"]),
    # top-p < 1 with a preset that does not replay the support (biased ratios)
    (["loss.preset=grpo", "rollout.top_p=0.9"], ["rollout.top_p=0.9", "loss.preset='grpo'", "kept top-p mass"]),
    (["loss.preset=grpo+mis", "rollout.top_p=0.95"], ["rollout.top_p=0.95", "'+top-p' preset"]),
    (["loss.preset=decoupled-ppo", "rollout.top_p=0.8"], ["rollout.top_p=0.8", "loss.preset='decoupled-ppo'"]),
    # score centering with a per-sequence factor
    (["loss.preset=seq-mis", "loss.overrides.score_centering=true"], ["score_centering=True", "'seq_mis'"]),
    (["loss.preset=geo-mask", "loss.overrides.score_centering=true"], ["score_centering=True", "'geo_mask'"]),
    (["loss.preset=veto", "loss.overrides.score_centering=true"], ["score_centering=True", "'veto'"]),
    (["loss.preset=opsm", "loss.overrides.score_centering=true"], ["score_centering=True", "'opsm'"]),
    (["loss.preset=sc+mis", 'loss.overrides.corrections=[{type="seq_tis"}]'], ["score_centering=True", "'seq_tis'"]),
    # a log-ratio clamp whose square overflows float32
    (["loss.overrides.log_ratio_clamp=45"], ["loss.overrides.log_ratio_clamp", "40"]),
]


@pytest.mark.parametrize(("sets", "fragments"), REJECTED, ids=[" ".join(s) for s, _ in REJECTED])
def test_rejected_at_dry_run(sets, fragments, capsys):
    argv = ["train", "--dry-run"] + [a for s in sets for a in ("--set", s)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln and ln != "invalid config:"]
    assert len(lines) == 1, err  # one line
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.mark.parametrize("sets", [
    [],  # the demo
    ["loss.preset=sc"],  # head:K recorded automatically
    ["loss.preset=grpo"],
    ["loss.preset=decoupled-ppo", "optim.epochs=2", "optim.minibatches=2"],
    ["loss.preset=sc+mis+top-p", "rollout.top_p=0.8"],
    ["loss.preset=veto", "rollout.record=none"],
])
def test_safe_settings_pass(sets, capsys):
    assert main(["train", "--dry-run"] + [a for s in sets for a in ("--set", s)]) == 0, capsys.readouterr().err


def test_one_table_covers_every_preset():
    assert set(REQUIREMENTS) == set(PRESETS)
    assert REQUIREMENTS["sc"] == Needs("head", "=1", ratio_objective=False, single_update=True)
    assert REQUIREMENTS["sc+mis+top-p"] == Needs("support", "<1", False, True)
    assert REQUIREMENTS["decoupled-ppo"] == Needs("none", "=1", True, False)
    for name, p in PRESETS.items():  # every preset is valid with its own sampling
        rec = "support" if p.sampler_top_p < 1 else f"head:{p.head_k}"
        check_run(p.loss, preset=name, top_p=p.sampler_top_p, record=rec)


def test_step_dropping_most_of_its_batch_fails_the_run():
    import torch

    from mixrl.config.presets import get_preset
    from mixrl.records.trajectory import Trajectory
    from mixrl.train.trainer import MalformedBatchError, Trainer

    torch.manual_seed(0)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))

    def traj(i: int, bad: bool) -> Trajectory:
        return Trajectory(prompt_id=f"p{i}", sample_idx=0, tokens=[1, 2, 3], loss_mask=[0, 1, 1],
                          sampler_logprobs=[0.0, -1.0] if bad else [0.0, -1.0, -1.0],
                          versions=[-1, 0, 0], groups=["", "g", "g"], reward=1.0)

    tr = Trainer(model, get_preset("grpo").loss, lr=1e-3, max_malformed_frac=0.5)  # as build_trainer
    m = tr.step([traj(0, True), traj(1, False), traj(2, False)], [1.0, -1.0, 1.0])  # 1 of 3: dropped, counted
    assert m["train/dropped_malformed"] == 1
    with pytest.raises(MalformedBatchError, match=r"3 of 4 trajectories .*malformed.*sampler_logprobs has length 2"):
        tr.step([traj(0, True), traj(1, True), traj(2, True), traj(3, False)], [1.0, 1.0, -1.0, 1.0])
