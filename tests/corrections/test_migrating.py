"""The TRL and verl presets against float64 re-implementations of those frameworks' formulas.

The references below are written from the documented math of TRL 1.9
(``GRPOConfig`` / ``GRPOTrainer``) and verl 0.7 (``ppo_trainer.yaml``,
``core_algos.compute_policy_loss_vanilla``, ``agg_loss``, the rollout correction)
in their own layout: padded ``[S, T]`` tensors with a completion mask, group
statistics over a ``[P, G]`` reward table, one formula per loss variant. mixrl
works on flattened generated positions with segment reductions and a caller's
denominator. Both are differentiated with respect to the same leaf
``log p_θ [S, T]``, so the loss and the whole policy gradient are compared.

Each comparison also checks a neighbouring variant (another aggregation, no dual
clip, another std epsilon) that must give a different number, so the test can fail.
docs/migrating.md is the page; its TOML blocks are validated at the end.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import torch
from tolerance import assert_close

from mixrl.config import build_config
from mixrl.config.loss import LossConfig
from mixrl.config.presets import PRESETS, get_preset
from mixrl.corrections import LossInputs, aggregation_denominator, compute_loss, grpo_advantages

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "migrating.md"
P, G, T = 3, 4, 7  # prompts, samples per prompt, padded completion length
BUDGET = 9  # max_completion_length (Dr. GRPO's constant)


class Case:
    """One random batch in the frameworks' padded layout."""

    def __init__(self, seed: int, spread: float = 1.0, mismatch: float = 0.5):
        g = torch.Generator().manual_seed(seed)
        s = P * G
        lens = torch.randint(2, T + 1, (s,), generator=g)
        self.mask = (torch.arange(T)[None, :] < lens[:, None]).to(F64)  # [S, T] completion mask
        self.rewards = torch.randint(0, 3, (P, G), generator=g).to(F64)  # [P, G]
        self.rewards[1] = 1.0  # one group without signal
        self.lp = (-torch.rand(s, T, generator=g, dtype=F64) * 3 - 0.05).requires_grad_(True)
        # p_old differs from p_θ as after an earlier optimizer step, so the clip bites
        self.old = self.lp.detach() - spread * torch.randn(s, T, generator=g, dtype=F64)
        self.q = self.old - mismatch * torch.randn(s, T, generator=g, dtype=F64)  # sampler log q
        self.ref = self.lp.detach() - 0.3 * torch.randn(s, T, generator=g, dtype=F64)  # initial policy

    @property
    def ratio(self) -> torch.Tensor:
        return torch.exp(self.lp.detach() - self.old)  # [S, T]


# --------------------------------------------------------------------- references (frameworks' math)


def trl_advantages(rewards: torch.Tensor, scale: bool = True) -> torch.Tensor:
    """TRL scale_rewards="group": (r - mean_g) / (std_g + 1e-4), Bessel-corrected std; [S]."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)  # unbiased
    adv = rewards - mean
    return (adv / (std + 1e-4) if scale else adv).reshape(-1)


def verl_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """verl adv_estimator=grpo, norm_adv_by_std_in_grpo=True: a loop over groups, std + 1e-6; [S]."""
    out = []
    for row in rewards:
        mean, std = row.mean(), row.std()
        out += [(r - mean) / (std + 1e-6) for r in row]
    return torch.stack(out)


def trl_loss(c: Case, adv: torch.Tensor, loss_type: str = "dapo", is_mode: str | None = None,
             cap: float = 3.0, beta: float = 0.0, eps: float = 0.2) -> torch.Tensor:
    """TRL's per-token clipped surrogate, IS factor, k3 KL and its loss_type aggregation."""
    a = adv[:, None]
    coef_1 = torch.exp(c.lp - c.old)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    diff = (c.old - c.q) * c.mask
    if is_mode == "sequence_mask":
        w = torch.exp(diff.sum(dim=-1, keepdim=True))
        per_token = per_token * torch.where(w > cap, 0.0, w)
    elif is_mode == "token_truncate":
        per_token = per_token * torch.clamp(torch.exp(diff), max=cap)
    if beta:
        d = c.ref - c.lp
        per_token = per_token + beta * (torch.exp(d) - d - 1)
    if loss_type == "dapo":  # every active token of the batch
        return (per_token * c.mask).sum() / c.mask.sum()
    if loss_type == "grpo":  # mean over sequences of the per-sequence token mean
        return ((per_token * c.mask).sum(-1) / c.mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":  # sequences x max_completion_length
        return (per_token * c.mask).sum() / (per_token.shape[0] * BUDGET)
    raise ValueError(loss_type)


def verl_loss(c: Case, adv: torch.Tensor, agg: str = "token-mean", clip_c: float | None = 3.0,
              rollout_is: str | None = None, threshold: float = 2.0, kl_coef: float = 0.0,
              micro_batches: list[list[int]] | None = None) -> torch.Tensor:
    """verl's vanilla policy loss (dual clip), rollout IS weight, low_var_kl and agg_loss.

    ``micro_batches``: the legacy worker's form, each micro-batch aggregated on its own
    and the results averaged (``loss * 1/gradient_accumulation``)."""
    a = adv[:, None] * c.mask
    ratio = torch.exp(torch.clamp(c.lp - c.old, -20.0, 20.0))
    l1 = -a * ratio
    l2 = -a * torch.clamp(ratio, 0.8, 1.2)
    pg = torch.maximum(l1, l2)
    if clip_c is not None:
        pg = torch.where(a < 0, torch.minimum(-a * clip_c, pg), pg)
    if rollout_is == "token":
        w = torch.exp(torch.clamp(c.old - c.q, -20.0, 20.0)) * c.mask
        pg = pg * w.clamp(max=threshold)
    kl = c.ref - c.lp
    kld = torch.clamp(torch.exp(torch.clamp(kl, -20.0, 20.0)) - kl - 1, -10.0, 10.0)

    def aggregate(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        if agg == "token-mean":
            return (x * m).sum() / m.sum()
        if agg == "seq-mean-token-mean":
            n = m.sum(-1)
            per_seq = (x * m).sum(-1) / (n + 1e-8)
            keep = (n > 0).to(F64)
            return (per_seq * keep).sum() / keep.sum()
        raise ValueError(agg)

    rows = micro_batches or [list(range(c.mask.shape[0]))]
    total = torch.zeros((), dtype=F64)
    for r in rows:
        part = aggregate(pg[r], c.mask[r])
        if kl_coef:
            part = part + kl_coef * aggregate(kld[r], c.mask[r])
        total = total + part / len(rows)
    return total


# --------------------------------------------------------------------- mixrl on the same batch


def mixrl_loss(c: Case, cfg: LossConfig, adv: torch.Tensor, budget: int = BUDGET) -> torch.Tensor:
    """mixrl's compute_loss on the flattened generated positions of ``c``; D over the batch."""
    m = c.mask.bool()
    seq_ids = m.nonzero()[:, 0]
    x = LossInputs(
        trainer_logprobs=c.lp[m], old_logprobs=c.old[m], sampler_logprobs=c.q[m],
        advantages=adv[seq_ids], loss_mask=torch.ones_like(seq_ids, dtype=torch.bool),
        seq_ids=seq_ids, num_seqs=c.mask.shape[0],
        ref_logprobs=c.ref[m] if cfg.ref_kl is not None else None,
    )
    d = aggregation_denominator(cfg.aggregation, x.loss_mask, seq_ids, x.num_seqs, max_len=budget)
    return compute_loss(x, cfg, d)[0]


def mixrl_advantages(c: Case, cfg: LossConfig) -> torch.Tensor:
    r = c.rewards.reshape(-1)
    idx = torch.arange(P).repeat_interleave(G)
    return grpo_advantages(r, idx, ["ok"] * r.numel(), use_std=cfg.advantage.use_std,
                           eps=cfg.advantage.eps).advantages


def grad(loss: torch.Tensor, c: Case) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, c.lp, retain_graph=True)
    return g


def with_overrides(name: str, **fields: object) -> LossConfig:
    return LossConfig.model_validate({**get_preset(name).loss.model_dump(), **fields})


def assert_differs(a: torch.Tensor, b: torch.Tensor) -> None:
    a, b = float(a.detach()), float(b.detach())
    assert abs(a - b) > 1e-6 * max(1.0, abs(b)), (a, b)


SEEDS = [0, 1, 3]


# --------------------------------------------------------------------- TRL


@pytest.mark.parametrize("seed", SEEDS)
def test_trl_grpo_advantages_are_trls(seed):
    c = Case(seed)
    cfg = get_preset("trl-grpo").loss
    assert_close(mixrl_advantages(c, cfg), trl_advantages(c.rewards))
    # mixrl's default epsilon (1e-6) is not TRL's 1e-4: the difference is visible
    default = mixrl_advantages(c, LossConfig())
    assert not torch.allclose(default, trl_advantages(c.rewards), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("seed", SEEDS)
def test_trl_grpo_is_trls_default_dapo_loss(seed):
    c = Case(seed)
    cfg = get_preset("trl-grpo").loss
    adv_m, adv_t = mixrl_advantages(c, cfg), trl_advantages(c.rewards)
    mine, ref = mixrl_loss(c, cfg, adv_m), trl_loss(c, adv_t)
    assert_close(mine, ref)
    assert_close(grad(mine, c), grad(ref, c))
    # the clip is active and the aggregation matters: loss_type="grpo" is another number
    r, a = c.ratio, adv_t[:, None]
    assert bool((((r > 1.2) & (a > 0)) | ((r < 0.8) & (a < 0)))[c.mask.bool()].any())
    assert_differs(mine, trl_loss(c, adv_t, loss_type="grpo"))
    assert_differs(mine, trl_loss(c, adv_t, eps=0.3))


@pytest.mark.parametrize("seed", SEEDS)
def test_trl_grpo_vllm_is_trls_sequence_mask_correction(seed):
    c = Case(seed)
    cfg = get_preset("trl-grpo+vllm").loss
    adv_m, adv_t = mixrl_advantages(c, cfg), trl_advantages(c.rewards)
    mine, ref = mixrl_loss(c, cfg, adv_m), trl_loss(c, adv_t, is_mode="sequence_mask")
    assert_close(mine, ref)
    assert_close(grad(mine, c), grad(ref, c))
    seq_ratio = torch.exp(((c.old - c.q) * c.mask).sum(-1))
    assert bool((seq_ratio > 3.0).any()) and bool((seq_ratio <= 3.0).any())  # the mask bites
    assert_differs(mine, trl_loss(c, adv_t))  # without the correction
    assert_differs(mine, trl_loss(c, adv_t, is_mode="token_truncate"))


@pytest.mark.parametrize(
    ("loss_type", "fields", "scale"),
    [
        ("grpo", {"aggregation": "seq_mean_token_mean"}, True),
        ("dr_grpo", {"aggregation": "seq_mean_token_sum_norm", "advantage": {"use_std": False, "eps": 1e-4}}, False),
    ],
)
def test_trl_loss_types_map_to_aggregations(loss_type, fields, scale):
    c = Case(3)
    cfg = with_overrides("trl-grpo", **fields)
    adv_m, adv_t = mixrl_advantages(c, cfg), trl_advantages(c.rewards, scale=scale)
    mine, ref = mixrl_loss(c, cfg, adv_m), trl_loss(c, adv_t, loss_type=loss_type)
    assert_close(mine, ref)
    assert_close(grad(mine, c), grad(ref, c))
    assert_differs(mine, trl_loss(c, adv_t, loss_type="dapo"))


@pytest.mark.parametrize("seed", SEEDS)
def test_trl_beta_maps_to_ref_kl_k3(seed):
    c = Case(seed)
    cfg = with_overrides("trl-grpo+vllm", ref_kl={"coef": 0.04, "estimator": "k3"})
    adv_m, adv_t = mixrl_advantages(c, cfg), trl_advantages(c.rewards)
    mine = mixrl_loss(c, cfg, adv_m)
    ref = trl_loss(c, adv_t, is_mode="sequence_mask", beta=0.04)
    assert_close(mine, ref)
    assert_close(grad(mine, c), grad(ref, c))
    assert_differs(mine, trl_loss(c, adv_t, is_mode="sequence_mask"))


# --------------------------------------------------------------------- verl


@pytest.mark.parametrize("seed", SEEDS)
def test_verl_grpo_advantages_are_verls(seed):
    c = Case(seed)
    assert_close(mixrl_advantages(c, get_preset("verl-grpo").loss), verl_advantages(c.rewards))
    assert not torch.allclose(mixrl_advantages(c, get_preset("trl-grpo").loss), verl_advantages(c.rewards),
                              rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("seed", SEEDS)
def test_verl_grpo_is_verls_default_loss(seed):
    c = Case(seed)
    cfg = get_preset("verl-grpo").loss
    adv_m, adv_v = mixrl_advantages(c, cfg), verl_advantages(c.rewards)
    mine, ref = mixrl_loss(c, cfg, adv_m), verl_loss(c, adv_v)
    assert_close(mine, ref)
    assert_close(grad(mine, c), grad(ref, c))
    # the dual clip is active (A < 0, ratio > 3) and changes the loss; so does the aggregation
    assert bool(((c.ratio > 3.0) & (adv_v[:, None] < 0))[c.mask.bool()].any())
    assert_differs(mine, verl_loss(c, adv_v, clip_c=None))
    assert_differs(mine, verl_loss(c, adv_v, agg="seq-mean-token-mean"))


@pytest.mark.parametrize("seed", SEEDS)
def test_verl_grpo_tis_is_verls_token_rollout_is(seed):
    c = Case(seed)
    cfg = get_preset("verl-grpo+tis").loss
    adv_m, adv_v = mixrl_advantages(c, cfg), verl_advantages(c.rewards)
    mine, ref = mixrl_loss(c, cfg, adv_m), verl_loss(c, adv_v, rollout_is="token")
    assert_close(mine, ref)
    assert_close(grad(mine, c), grad(ref, c))
    truncated = (torch.exp(c.old - c.q) > 2.0) & (adv_v[:, None] != 0)
    assert bool(truncated[c.mask.bool()].any())  # the truncation bites
    assert_differs(mine, verl_loss(c, adv_v))
    assert_differs(mine, verl_loss(c, adv_v, rollout_is="token", threshold=5.0))


@pytest.mark.parametrize("seed", SEEDS)
def test_verl_kl_loss_maps_to_ref_kl_k3(seed):
    c = Case(seed)
    cfg = with_overrides("verl-grpo+tis", ref_kl={"coef": 0.001, "estimator": "k3"})
    adv_m, adv_v = mixrl_advantages(c, cfg), verl_advantages(c.rewards)
    mine, ref = mixrl_loss(c, cfg, adv_m), verl_loss(c, adv_v, rollout_is="token", kl_coef=0.001)
    assert_close(mine, ref)
    assert_close(grad(mine, c), grad(ref, c))
    assert_differs(mine, verl_loss(c, adv_v, rollout_is="token"))


def test_verl_seq_mean_token_mean_maps():
    c = Case(4)
    cfg = with_overrides("verl-grpo", aggregation="seq_mean_token_mean")
    adv_m, adv_v = mixrl_advantages(c, cfg), verl_advantages(c.rewards)
    mine, ref = mixrl_loss(c, cfg, adv_m), verl_loss(c, adv_v, agg="seq-mean-token-mean")
    # verl divides each sequence's sum by (L_i + 1e-8): agreement to ~1e-8 relative, not ulps
    close = {"rtol": 1e-7, "atol": 1e-10}
    torch.testing.assert_close(mine, ref, **close)
    torch.testing.assert_close(grad(mine, c), grad(ref, c), **close)
    assert_differs(mine, verl_loss(c, adv_v))


def test_verl_legacy_micro_batch_token_mean_is_not_the_batch_token_mean():
    """What the page says: verl's default worker averages per-micro-batch token means; mixrl's
    token_mean is the mean over every token of the optimizer batch. Equal for one micro-batch,
    or micro-batches of equal token counts; here the counts differ."""
    c = Case(5)
    cfg = get_preset("verl-grpo").loss
    adv_m, adv_v = mixrl_advantages(c, cfg), verl_advantages(c.rewards)
    mine = mixrl_loss(c, cfg, adv_m)
    s = P * G
    halves = [list(range(s // 2)), list(range(s // 2, s))]
    assert float(c.mask[halves[0]].sum()) != float(c.mask[halves[1]].sum())
    assert_close(mine, verl_loss(c, adv_v, micro_batches=[list(range(s))]))
    assert_differs(mine, verl_loss(c, adv_v, micro_batches=halves))


# --------------------------------------------------------------------- the page


def _toml_blocks() -> list[str]:
    return re.findall(r"```toml\n(.*?)```", DOC.read_text(), re.S)


def test_every_preset_the_page_names_exists_and_new_ones_are_described():
    text = DOC.read_text()
    named = set(re.findall(r"`((?:trl|verl)-grpo[^`]*)`", text))
    assert {"trl-grpo", "trl-grpo+vllm", "verl-grpo", "verl-grpo+tis"} <= named
    assert named <= set(PRESETS), named - set(PRESETS)


@pytest.mark.parametrize("index", range(2))
def test_the_pages_toml_blocks_are_valid_configs(index):
    """Each worked example's TOML loads, and its loss resolves and passes the guard rails."""
    from mixrl.runtime.run import resolve_loss

    blocks = _toml_blocks()
    assert len(blocks) >= 2
    cfg = build_config(tomllib.loads(blocks[index]))
    loss, derived = resolve_loss(cfg)
    want = {0: "trl-grpo", 1: "verl-grpo"}[index]
    assert cfg.loss.preset.startswith(want)
    assert derived.top_p == 1.0 and loss.objective.type == "ppo_clip"


def test_all_toml_blocks_of_the_page_are_valid():
    from mixrl.runtime.run import resolve_loss

    for block in _toml_blocks():
        resolve_loss(build_config(tomllib.loads(block)))
