"""The trainer's side of MoE routing: replay the sampler's experts, measure the mismatch.

Per generated token the record carries ``routed_experts`` [layers][k]: the
experts the sampler's routers chose at the position whose logits drew the token
(its predicting position ``t - 1``, the hidden state the trainer reads). Around
each trainer forward, ``TrainerRouting.context`` places those sets at the
model-input cells ``(hidden_rows, pred_cols)`` and patches the policy's routers
(``mixrl.models.moe.RoutingReplay``): with ``loss.routing_replay = true`` they use
the recorded sets (gates still the trainer's own, differentiable), otherwise they
route freely. Either way the trainer's own top-k is compared with the record:

    mismatch/routing_diff_frac[/GROUP] = #{recorded tokens whose set differs in some layer} / #{recorded tokens}

counted once per token per step (the first forward that sees it). A dense model,
or a batch without routing records, passes through untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from mixrl.models.moe import RoutingReplay, dense, diff_mask, stack_routing


class TrainerRouting:
    def __init__(self, model: nn.Module, replay: bool) -> None:
        self.rr = RoutingReplay(model, replay)
        self.model = model
        self.k = int(self.rr.routers[0].top_k) if self.rr.active else 0
        self.diff: dict[int, float] = {}  # group id -> differing tokens this step
        self.total: dict[int, float] = {}
        self._seen: set[int] = set()

    def attach(self, records: Sequence[Any], trajectories: Sequence[Any]) -> None:
        """Give each record its trajectory's routing (a new step: counts restart)."""
        self.diff, self.total, self._seen = {}, {}, set()
        if not self.rr.active:
            return
        for r in records:
            r.routed_experts = getattr(trajectories[r.index], "routed_experts", None) or None

    @contextlib.contextmanager
    def context(self, model: nn.Module, records: Sequence[Any] | None, tb: Any, input_shape: Any) -> Iterator[None]:
        if model is not self.model or not self.rr.active or not records:
            yield
            return
        layers = len(self.rr.routers)
        forced = stack_routing([(getattr(r, "routed_experts", None), len(r.gen_pos)) for r in records], layers, self.k)
        if forced is None:
            yield
            return
        R, C = int(input_shape[0]), int(input_shape[1])
        rows, cols = tb.hidden_rows.cpu(), tb.pred_cols.cpu()
        with self.rr.forward(dense(forced, rows, cols, (R, C)).to(tb.pred_cols.device)):
            yield
        fresh = [i for i, r in enumerate(records) if id(r) not in self._seen]
        if not fresh or not self.rr.own:
            return
        differ = diff_mask(forced, [o.cpu() for o in self.rr.own], rows, cols, C)  # [N]
        owner = torch.repeat_interleave(torch.arange(len(records)), torch.tensor([len(r.gen_pos) for r in records]))
        take = torch.isin(owner, torch.tensor(fresh)) & (forced[:, 0, 0] >= 0)
        gids = tb.group_ids.cpu()
        for g in gids[take].unique().tolist():
            sel = take & (gids == g)
            self.diff[g] = self.diff.get(g, 0.0) + float(differ[sel].sum())
            self.total[g] = self.total.get(g, 0.0) + float(sel.sum())
        self._seen.update(id(records[i]) for i in fresh)

    def metrics(self, group_names: Sequence[str]) -> dict[str, float]:
        if not self.total:
            return {}
        out = {f"mismatch/routing_diff_frac/{group_names[g]}": self.diff[g] / n for g, n in self.total.items() if n}
        out["mismatch/routing_diff_frac"] = sum(self.diff.values()) / max(1.0, sum(self.total.values()))
        return out
