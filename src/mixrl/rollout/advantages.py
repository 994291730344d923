"""From complete groups to the trainer's batch: screening, overlong handling, GRPO advantages.

    trajs    = groups flattened (prompt order, then sample order)
    excluded = no reward (infra_failed, reward_failed, ...)         left out of group stats, advantage 0
             | malformed (Trajectory.screen: the trainer's verdict)  left out, advantage 0, the trainer drops it
             | overlong "filter": status truncated                    left out and removed from the batch
    rewards += overlong "penalty" (DAPO soft punishment)              before the group statistics
    A        = grpo_advantages(rewards, groups, excluded)             docs/corrections.md section 8

Overlong penalty (DAPO, arXiv 2503.14476 eq. 13), with ``L`` the generation
budget, ``c`` = ``buffer`` and ``n`` the episode's generated tokens::

    R_len = 0                          n <= L − c
          = factor · (L − c − n) / c   L − c < n <= L
          = −factor                    n > L

GRPO statistics are taken over the trajectories the trainer will actually train
on: the verdict of :meth:`Trajectory.screen` (computed once, where the episode
was completed) leaves the malformed ones out of their group's mean and std
(docs/corrections.md section 8). A filtered (truncated) episode leaves the batch
entirely, so it counts in neither the loss nor the denominator D. A malformed one
stays in the list: the trainer drops and counts it by the same verdict (and fails
the step when more than half are).

Metrics: ``rollout/malformed``, ``rollout/overlong_filtered``,
``rollout/overlong_penalty`` (mean over rewarded episodes), plus those of
``grpo_advantages`` (``rollout/groups``, ``rollout/zero_signal_groups``, ...).
"""

from __future__ import annotations

from typing import Any

from mixrl.corrections import grpo_advantages
from mixrl.records.trajectory import UNREWARDED, Trajectory


def overlong_penalty(n: int, budget: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment for ``n`` generated tokens (0 or negative)."""
    start = budget - buffer
    if n <= start:
        return 0.0
    if n <= budget:
        return factor * (start - n) / buffer
    return -factor


def batch_advantages(
    groups: list[list[Trajectory]], loss_cfg: Any, *, vocab_size: int, cand_kind: str,
    overlong: Any = None, budget: int | None = None,
) -> tuple[list[Trajectory], list[float], dict[str, float]]:
    """(trajectories for the trainer, their advantages, metrics); see the module doc."""
    import torch


    trajs = [t for g in groups for t in g]
    index = [i for i, g in enumerate(groups) for _ in g]
    # no reward: excluded as infra, not malformed
    bad = [None if t.status in UNREWARDED else t.screen(vocab_size, cand_kind) for t in trajs]
    kind = getattr(overlong, "type", None)
    if kind is not None and budget is None:
        raise ValueError("rollout.overlong needs the generation budget")
    filtered = [kind == "filter" and t.status == "truncated" for t in trajs]
    rewards, penalties = [], []
    for t in trajs:
        r = float("nan") if t.reward is None or t.status in UNREWARDED else float(t.reward)
        if kind == "penalty" and r == r:
            p = overlong_penalty(t.num_generated, budget, overlong.buffer, overlong.factor)  # type: ignore[arg-type]
            penalties.append(p)
            r += p
        rewards.append(r)
    excluded = torch.tensor([r != r or b is not None or f for r, b, f in zip(rewards, bad, filtered, strict=True)],
                            dtype=torch.bool)
    r64 = torch.tensor(rewards, dtype=torch.float64)
    adv_cfg = loss_cfg.advantage
    out = grpo_advantages(r64, torch.tensor(index, dtype=torch.long), excluded,
                          use_std=adv_cfg.use_std, eps=adv_cfg.eps)
    stats = dict(out.stats)
    stats.pop("rollout/infra_failed", None)  # counts every exclusion here; rollout_metrics counts infra
    stats["rollout/malformed"] = float(sum(b is not None for b in bad))
    if kind == "filter":
        stats["rollout/overlong_filtered"] = float(sum(filtered))
    if kind == "penalty":
        stats["rollout/overlong_penalty"] = sum(penalties) / len(penalties) if penalties else 0.0
    keep = [i for i, f in enumerate(filtered) if not f]
    adv = out.advantages.tolist()
    return [trajs[i] for i in keep], [float(adv[i]) for i in keep], stats
