"""Weights by collective broadcast: trainer to replica device to device (NCCL on GPU, gloo on CPU).

    trainer actor ──channel "b200/0" (2-rank group)──► replica b200/0 (its own device memory)
                  ──channel "h100/0" (2-rank group)──► replica h100/0

The Ray backend's ``runtime.ray.weight_transport = "broadcast"`` path (the default,
``"object_store"``, puts each version into Ray's object store). Every replica has its own
*channel* to the trainer: a two-rank process group (``open_channel``) on a private
``TCPStore``, NCCL when both ends are on CUDA devices, gloo otherwise. One group per
replica, not one over the whole fleet, because replicas come and go (failures, restarts,
scaling): a dead replica breaks only its own channel, never a collective the others wait in.

``WeightBroadcast`` moves a version over a channel as one flat byte buffer on ``device``
from which the receiver takes views (as replicas map a shared-memory file). Before each
buffer a small header says its size and, when the layout (names, dtypes, shapes, offsets)
changed, the new layout follows, pickled: the first version pays for the layout, later
versions only for the bytes. A sender calls ``send(state_dict)``, the receiver ``recv()``,
in the same order.

The groups are raw ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` objects, not the
``torch.distributed`` default group: an actor can hold several (the trainer one per
replica) and a trainer rank keeps its own FSDP group untouched.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

ALIGN = 64
TIMEOUT_S = 300.0  # a receiver waits for the trainer's send (it may be mid-step)
Layout = list[tuple[str, torch.dtype, tuple[int, ...], int, int]]  # name, dtype, shape, offset, nbytes


def listen(host: str, world: int = 2, timeout_s: float = TIMEOUT_S) -> Any:
    """The channel's rendezvous store, on a free port of ``host`` (``.port`` says which)."""
    return dist.TCPStore(host, 0, world, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def open_channel(rank: int, *, store: Any = None, host: str = "", port: int = 0, device: str = "cpu",
                 timeout_s: float = TIMEOUT_S) -> Any:
    """A two-rank process group: rank 0 passes the ``listen`` store, rank 1 its host and port.
    Blocks until both ranks have joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, 2, False, timeout=timeout)
    if torch.device(device).type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, 2)  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def layout_of(sd: Mapping[str, torch.Tensor]) -> tuple[Layout, int]:
    layout, off = [], 0
    for k, t in sd.items():
        nb = t.numel() * t.element_size()
        layout.append((k, t.dtype, tuple(t.shape), off, nb))
        off += (nb + ALIGN - 1) // ALIGN * ALIGN
    return layout, off


class WeightBroadcast:
    """One end of a channel: ``send`` on rank ``src``, ``recv`` on the other rank."""

    def __init__(self, group: Any, src: int = 0, device: str | torch.device = "cpu"):
        self.group, self.src, self.device = group, src, torch.device(device)
        self.layout: Layout | None = None
        self.size = 0

    def _bcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = self.src
        self.group.broadcast([t], opts).wait()

    def send(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Send one version (with its layout, if it differs from the last one sent)."""
        layout, size = layout_of(sd)
        blob = b"" if layout == self.layout else pickle.dumps(layout)
        self._bcast(torch.tensor([len(blob), size], dtype=torch.int64, device=self.device))
        if blob:
            self._bcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device))
        self.layout, self.size = layout, size
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        for k, dt, shape, off, nb in layout:
            if nb:
                buf[off : off + nb].view(dt).view(shape).copy_(sd[k].detach())
        self._bcast(buf)

    def recv(self) -> dict[str, torch.Tensor]:
        """The next version, as views of one received buffer."""
        head = torch.empty(2, dtype=torch.int64, device=self.device)
        self._bcast(head)
        n, size = (int(x) for x in head.tolist())
        if n:
            blob = torch.empty(n, dtype=torch.uint8, device=self.device)
            self._bcast(blob)
            self.layout = pickle.loads(blob.cpu().numpy().tobytes())  # from the trainer of this run
        if self.layout is None:
            raise RuntimeError("WeightBroadcast.recv: the sender sent no layout")
        self.size = size
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._bcast(buf)
        return {k: buf[off : off + nb].view(dt).view(shape) for k, dt, shape, off, nb in self.layout}


class Broadcast:
    """What the weight store holds for a version sent by broadcast: its number only (the
    tensors stay with the trainer until each replica's channel receives them)."""

    def __init__(self, version: int):
        self.version = version


def join(host: str, port: int, device: str = "cpu") -> WeightBroadcast:
    """A replica's end of its channel (rank 1); blocks until the trainer's end is up."""
    return WeightBroadcast(open_channel(1, host=host, port=port, device=device), src=0, device=device)


class Sender:
    """The trainer's side: its newest ``keep`` versions and one channel per replica.

    ``hold`` keeps a version (a detached copy) and returns its number, which is all the
    weight store holds; ``open(name, host, device)`` starts replica ``name``'s channel
    (rank 0, completed in a thread once the replica joins) and returns (host, port);
    ``send(name, version)`` sends a held version over it. A channel whose replica died
    fails only its own sends; ``close`` forgets it."""

    def __init__(self, keep: int = 2):
        import concurrent.futures

        self.keep = keep
        self.held: dict[int, dict[str, torch.Tensor]] = {}
        self.channels: dict[str, Any] = {}  # name -> future of its WeightBroadcast
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="mixrl-channel")

    def hold(self, version: int, sd: dict[str, torch.Tensor]) -> int:
        self.held[version] = sd
        for old in sorted(self.held)[: -self.keep]:
            del self.held[old]
        return version

    def open(self, name: str, host: str, device: str = "cpu") -> tuple[str, int]:
        store = listen(host)
        self.channels[name] = self._pool.submit(
            lambda: WeightBroadcast(open_channel(0, store=store, device=device), src=0, device=device))
        return host, int(store.port)

    def send(self, name: str, version: int) -> None:
        if version not in self.held:
            raise KeyError(f"weights version {version} is no longer held (held: {sorted(self.held)})")
        if name not in self.channels:
            raise KeyError(f"no weights channel to replica {name!r}")
        self.channels[name].result(timeout=TIMEOUT_S).send(self.held[version])

    def close(self, name: str) -> None:
        self.channels.pop(name, None)
