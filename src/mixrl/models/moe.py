"""MoE routing replay: the trainer's routers use the experts the sampler routed to.

A top-k MoE layer computes, per token ``x`` (Qwen3-MoE, arXiv 2505.09388)::

    p = softmax(W_r x)                          # [E] router probabilities (float32)
    I = top-k(p)                                # the selected experts
    g_i = p_i / sum_{j in I} p_j   (i in I)     # gates (``norm_topk_prob``; else g_i = p_i)
    y = sum_{i in I} g_i * expert_i(x)

A sampler in another precision can select a different ``I`` than the trainer
for the same token (routing mismatch, a first-order source of training-
inference mismatch). Replay (R3, "rollout routing replay") fixes ``I`` to the
sampler's recorded set and keeps ``g`` a function of the trainer's own ``p``,
so the gates, and through them the router weights, still get gradients.

Here a router is any module with ``top_k``, ``num_experts``, ``weight`` whose
forward maps hidden states ``[N, H]`` to ``(logits, gates, indices)`` (HF's
``Qwen3MoeTopKRouter``). ``RoutingReplay`` patches every router of a model for
the duration of one forward: positions with a forced set (``forced`` [N, layers, k],
-1 = free) use it, the others route as usual. The trainer's own top-k set is
recorded either way, so ``routing_diff_frac`` (share of forced positions whose
set differs, as sets, in any layer) is measured whether or not replay is on.
Edge cases: a forced id outside ``[0, num_experts)`` raises ValueError naming it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def is_router(mod: nn.Module) -> bool:
    return all(hasattr(mod, a) for a in ("top_k", "num_experts", "weight")) and "Router" in type(mod).__name__


def routers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_router(m)]


def route(router: nn.Module, h: Tensor, forced: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One router on ``h`` [N, H]: (logits [N, E], gates [N, k], indices [N, k], own top-k [N, k]).

    ``forced`` [N, k] long (-1 rows = free). Same math as HF's router when nothing is forced.
    """
    h = h.reshape(-1, router.weight.shape[1])
    logits = F.linear(h, router.weight)  # [N, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32 if logits.dtype != torch.float64 else torch.float64)
    top, own = torch.topk(probs, router.top_k, dim=-1)  # [N, k]
    idx = own
    if forced is not None:
        if bool(((forced < -1) | (forced >= router.num_experts)).any()):
            bad = forced[(forced < -1) | (forced >= router.num_experts)][0].item()
            raise ValueError(f"routed expert id {bad} outside [0, {router.num_experts})")
        use = forced[:, :1] >= 0  # [N, 1]
        idx = torch.where(use, forced.clamp(min=0), own)
        top = probs.gather(1, idx)  # the trainer's own probabilities at the forced experts
    if getattr(router, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), idx, own


class RoutingReplay:
    """Patches a model's routers for one forward at a time (see module doc).

    Use: ``with rr.forward(forced_dense)`` around ``model.model(...)``, with
    ``forced_dense`` [rows * cols, layers, k] in the model input's flattened order
    (``dense``). ``replay=False`` only measures (routes freely, records).
    """

    def __init__(self, model: nn.Module, replay: bool) -> None:
        self.routers = routers(model)
        self.replay = replay
        self.own: list[Tensor] = []  # per layer [N, k] of the last forward

    @property
    def active(self) -> bool:
        return bool(self.routers)

    @contextlib.contextmanager
    def forward(self, forced: Tensor | None) -> Iterator[None]:
        self.own = []
        saved = []
        for li, r in enumerate(self.routers):
            f = forced[:, li] if (forced is not None and self.replay) else None

            def fwd(h: Tensor, _r: nn.Module = r, _f: Tensor | None = f) -> tuple[Tensor, Tensor, Tensor]:
                logits, gates, idx, own = route(_r, h, _f)
                self.own.append(own.detach())
                return logits, gates, idx

            saved.append((r, r.__dict__.get("forward")))
            r.forward = fwd  # instance attribute: shadows the class forward for this call only
        try:
            yield
        finally:
            for r, old in saved:
                if old is None:
                    del r.forward
                else:
                    r.forward = old


def dense(forced: Tensor, rows: Tensor, cols: Tensor, shape: tuple[int, int]) -> Tensor:
    """Per-position routing ``forced`` [N, layers, k] at model-input cells (rows, cols) ->
    [R * C, layers, k] with -1 everywhere else (positions routed freely)."""
    R, C = shape
    out = torch.full((R * C, *forced.shape[1:]), -1, dtype=torch.long, device=forced.device)
    out[rows * C + cols] = forced
    return out


def diff_mask(forced: Tensor, own: list[Tensor], rows: Tensor, cols: Tensor, cols_total: int) -> Tensor:
    """[N] bool: the trainer's own top-k set differs from the recorded one in some layer
    (positions without a record, -1, never count)."""
    at = rows * cols_total + cols
    mine = torch.stack([o[at] for o in own], dim=1)  # [N, layers, k]
    rec = forced.to(mine.device)
    differ = (mine.sort(-1).values != rec.sort(-1).values).any(-1).any(-1)
    return differ & (rec[:, 0, 0] >= 0)


def stack_routing(per_traj: list[Any], n_layers: int, k: int) -> Tensor | None:
    """Concatenate per-trajectory routing ``[n_i][layers][k]`` (or None/[] = unrecorded,
    filled with -1) into [sum n_i, layers, k]; None when nothing was recorded."""
    if not any(rec for rec, _ in per_traj):
        return None
    parts = []
    for rec, n in per_traj:
        if rec:
            t = torch.tensor(rec, dtype=torch.long)
            if t.shape != (n, n_layers, k):
                raise ValueError(f"Trajectory.routed_experts has shape {tuple(t.shape)}, expected {(n, n_layers, k)}")
            parts.append(t)
        else:
            parts.append(torch.full((n, n_layers, k), -1, dtype=torch.long))
    return torch.cat(parts)
