"""How one trainer step is split over processes: the trainer's only view of its ranks.

The trainer calls these operations at fixed points of its step; on one process
(:class:`Single`) each is the identity, so the single-process trainer is the
plain computation. On FSDP2 ranks (:class:`Ranks`)::

    shard(records)          this rank's contiguous slice of the batch's records
    all_sum(x), all_max(x)  a float over the ranks (the global denominator D, its fallback length)
    forward(fn, tb, recs)   fn(tb, recs) inside the FSDP2 root module (its hooks gather the shards)
    pad(n)                  after this rank's n passes: empty passes up to the busiest rank's count
                            (FSDP2 runs collectives in every forward and backward)
    reduce(metrics)         the step's metrics: loss summed over ranks, the rest averaged

Every tensor a collective touches lives on the rank's device (NCCL rejects CPU
tensors, gloo CUDA ones), the metrics' bytes included.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

R = TypeVar("R")
SUMMED = ("loss",)  # local loss = local sum / global D: the batch loss is their sum


class Single:
    """One process: every operation is the identity."""

    world = 1

    def shard(self, records: list[R]) -> list[R]:
        return records

    def all_sum(self, x: float) -> float:
        return x

    def all_max(self, x: float) -> float:
        return x

    def forward(self, fn: Callable[[Any, Any], Any], tb: Any, records: Any) -> Any:
        return fn(tb, records)

    def pad(self, n: int) -> None:
        return None

    def reduce(self, metrics: dict[str, float]) -> dict[str, float]:
        return metrics


class Ranks(Single):
    """One of ``torch.distributed``'s ranks; every operation is collective (all ranks call it).

    ``root`` is the FSDP2 root module (``train.distributed.shard``): ``root(tb, records, fn)``
    runs ``fn`` inside it, ``root(None, None, None)`` is an empty pass."""

    def __init__(self, root: Any, device: torch.device) -> None:
        import torch.distributed as dist

        self.dist, self.root, self.device = dist, root, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def shard(self, records: list[R]) -> list[R]:
        n = len(records)
        if 0 < n < self.world:
            raise ValueError(f"{n} trainable trajectories cannot be split over trainer.world_size={self.world}")
        return records[self.rank * n // self.world:(self.rank + 1) * n // self.world]

    def _reduce(self, x: float, op: Any) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=op)
        return float(t.item())

    def all_sum(self, x: float) -> float:
        return self._reduce(x, self.dist.ReduceOp.SUM)

    def all_max(self, x: float) -> float:
        return self._reduce(x, self.dist.ReduceOp.MAX)

    def forward(self, fn: Callable[[Any, Any], Any], tb: Any, records: Any) -> Any:
        return self.root(tb, records, fn)

    def pad(self, n: int) -> None:
        for _ in range(int(self.all_max(n)) - n):
            out = self.root(None, None, None)
            if torch.is_grad_enabled():
                out.backward()

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order: each rank writes its pickle into its own row of
        one byte tensor on the rank's device, summed over the ranks (``all_gather_object``
        would pick its device from the backend, not the rank)."""
        payload = pickle.dumps(obj)
        rows = torch.zeros(self.world, int(self.all_max(len(payload))), dtype=torch.uint8)
        rows[self.rank, :len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows = rows.to(self.device)
        self.dist.all_reduce(rows, op=self.dist.ReduceOp.SUM)
        return [pickle.loads(r.numpy().tobytes()) for r in rows.cpu()]  # trailing zeros are ignored

    def reduce(self, metrics: dict[str, float]) -> dict[str, float]:
        gathered = self.gather(metrics)
        return {**{k: _combine(k, [float(m[k]) for m in gathered if k in m]) for k in metrics},
                "train/world_size": float(self.world)}


def _combine(key: str, values: Sequence[float]) -> float:
    return sum(values) if key in SUMMED else sum(values) / len(values)
