"""GRPO group advantages (docs/corrections.md section 8; DeepSeekMath arXiv 2402.03300 §4.1.2).

    A_i = (R_i − mean_g R) / (std_g R + ε)        use_std=True  (GRPO)
    A_i =  R_i − mean_g R                          use_std=False (Dr. GRPO, arXiv 2503.20783)

``std_g`` is the sample standard deviation (Bessel-corrected), as in common
GRPO implementations. Edge cases:

- an episode that failed for infrastructure reasons is *not* reward 0: it is
  left out of its group's mean and std, gets advantage 0 and ``keep=False``
  (the caller drops it from the loss and from D), and is counted;
- a group whose remaining rewards are all equal (including a group left with a
  single episode) carries no signal: advantages 0, counted;
- a group with every episode failed contributes nothing and is counted as such.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor


class GroupAdvantages(NamedTuple):
    """GRPO advantages per trajectory, which trajectories enter the loss, and the group statistics."""

    advantages: Tensor  # [S] float64-or-input dtype, 0 where not kept or no signal
    keep: Tensor  # [S] bool, False for infra-failed episodes
    stats: dict[str, float]


def grpo_advantages(
    rewards: Tensor,
    prompt_index: Tensor,
    statuses: Sequence[str] | Tensor,
    *,
    use_std: bool = True,
    eps: float = 1e-6,
) -> GroupAdvantages:
    """Advantages [S] from ``rewards`` [S] grouped by ``prompt_index`` [S] (any ints).

    ``statuses`` is the per-episode status list (``"infra_failed"`` excluded) or
    a bool [S] tensor that is True for infra-failed episodes. Rewards of failed
    episodes may be NaN; any other non-finite reward is a ``ValueError``.
    """
    s = rewards.shape[0]
    if rewards.dim() != 1 or prompt_index.shape != rewards.shape:
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)}, prompt_index has {tuple(prompt_index.shape)}"
        )
    if isinstance(statuses, Tensor):
        if statuses.shape != rewards.shape or statuses.dtype != torch.bool:
            raise ValueError(
                f"infra mask must be bool of shape {(s,)}, got {statuses.dtype} {tuple(statuses.shape)}"
            )
        infra = statuses.to(rewards.device)
    else:
        if len(statuses) != s:
            raise ValueError(f"statuses has length {len(statuses)}, rewards has {s}")
        infra = torch.tensor(
            [st == "infra_failed" for st in statuses], dtype=torch.bool, device=rewards.device
        )
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    keep = ~infra
    bad = keep & ~torch.isfinite(rewards)
    if bool(bad.any()):
        raise ValueError(
            f"rewards has non-finite values at episodes {bad.nonzero().flatten().tolist()}"
        )
    _, group = torch.unique(prompt_index, return_inverse=True)  # [S] in 0..P-1
    p = int(group.max().item()) + 1 if s else 0
    r = torch.where(keep, rewards, 0.0).to(torch.float64)
    k = keep.to(torch.float64)
    n = torch.zeros(p, dtype=torch.float64, device=r.device).index_add(
        0, group, k
    )  # [P] kept per group
    mean = torch.zeros_like(n).index_add(0, group, r) / n.clamp_min(1.0)  # [P]
    dev = torch.where(keep, r - mean[group], 0.0)  # [S]
    var = torch.zeros_like(n).index_add(0, group, dev * dev) / (n - 1.0).clamp_min(1.0)  # [P]
    rmax = torch.full_like(n, -torch.inf).scatter_reduce(
        0, group, torch.where(keep, r, -torch.inf), "amax"
    )
    rmin = torch.full_like(n, torch.inf).scatter_reduce(
        0, group, torch.where(keep, r, torch.inf), "amin"
    )
    signal = (n >= 2) & (rmax > rmin)  # [P]
    adv = dev / (var.sqrt() + eps)[group] if use_std else dev
    adv = torch.where(keep & signal[group], adv, 0.0).to(rewards.dtype)
    stats = {
        "rollout/infra_failed": float(infra.sum().item()),
        "rollout/groups": float(p),
        "rollout/zero_signal_groups": float(((n > 0) & ~signal).sum().item()),
        "rollout/empty_groups": float((n == 0).sum().item()),
    }
    return GroupAdvantages(adv, keep, stats)
