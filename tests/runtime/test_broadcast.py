"""``WeightBroadcast`` over gloo on CPU (the NCCL path differs only in device and backend)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _versions() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = {"a.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
            "empty": torch.zeros(0), "step": torch.tensor(3, dtype=torch.int64)}
    return [base, {k: (v + 1 if v.is_floating_point() else v + 1) for k, v in base.items()}]


def _rank(rank: int, world: int, port: int, out: dict[int, bool]) -> None:
    from mixrl.fleet.broadcast import WeightBroadcast

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        wb = WeightBroadcast(src=0)
        ok = True
        for sd in _versions():
            if rank == 0:
                wb.send(sd)
            else:
                got = wb.recv()
                ok &= set(got) == set(sd) and all(got[k].dtype == sd[k].dtype and torch.equal(got[k], sd[k]) for k in sd)
        out[rank] = ok
    finally:
        dist.destroy_process_group()


def test_two_versions_reach_every_rank_bit_exact() -> None:
    world = 3
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(_rank, args=(world, _free_port(), out), nprocs=world, join=True)
        assert dict(out) == dict.fromkeys(range(world), True)
