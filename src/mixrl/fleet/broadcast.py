"""Weights by collective broadcast: the path for GPU replicas (NCCL), one flat buffer per version.

    trainer (rank src) ──broadcast(flat buffer)──► replica ranks (own GPU memory, no host copy)

``WeightBroadcast`` is the same idea as ``shared_weights`` across devices and
machines: the layout (names, dtypes, shapes, offsets) is agreed once with
``broadcast_object_list``; every later version is one ``broadcast`` of a flat
byte buffer on ``device`` (``cuda`` with NCCL; ``cpu`` with gloo), from which
receivers take views, exactly as replicas map a shared-memory file. A sender
calls ``send(state_dict)``; every receiver calls ``recv()`` in the same order.

The process group is the caller's (``torch.distributed.init_process_group``
or a sub-group of trainer rank 0 and the sampler ranks). Tested on CPU with
gloo; the NCCL path differs only in the device and backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

ALIGN = 64


class WeightBroadcast:
    def __init__(self, src: int = 0, group: Any = None, device: str | torch.device = "cpu"):
        self.src, self.group, self.device = src, group, torch.device(device)
        self.layout: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] | None = None  # name, dtype, shape, off, nbytes
        self.size = 0

    def _agree(self, sd: Mapping[str, torch.Tensor] | None) -> None:
        obj: list[Any] = [None]
        if sd is not None:
            layout, off = [], 0
            for k, t in sd.items():
                nb = t.numel() * t.element_size()
                layout.append((k, t.dtype, tuple(t.shape), off, nb))
                off += (nb + ALIGN - 1) // ALIGN * ALIGN
            obj = [(layout, off)]
        dist.broadcast_object_list(obj, src=self.src, group=self.group)
        self.layout, self.size = obj[0]

    def send(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Rank ``src``: broadcast one version (the first call also agrees the layout)."""
        if self.layout is None:
            self._agree(sd)
        assert self.layout is not None
        buf = torch.empty(self.size, dtype=torch.uint8, device=self.device)
        for k, dt, shape, off, nb in self.layout:
            t = sd[k]
            if tuple(t.shape) != shape or t.dtype != dt:
                raise ValueError(f"WeightBroadcast.send: {k} is {tuple(t.shape)} {t.dtype}, the agreed layout says {shape} {dt}")
            if nb:
                buf[off : off + nb].view(dt).view(shape).copy_(t.detach())
        dist.broadcast(buf, src=self.src, group=self.group)

    def recv(self) -> dict[str, torch.Tensor]:
        """Every other rank: the next version, as views of one received buffer."""
        if self.layout is None:
            self._agree(None)
        assert self.layout is not None
        buf = torch.empty(self.size, dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, src=self.src, group=self.group)
        return {k: buf[off : off + nb].view(dt).view(shape) for k, dt, shape, off, nb in self.layout}
