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

import contextlib
import datetime
import pickle
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from mixrl.weights.versions import KEEP_VERSIONS

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

    def _head(self, blob: bytes, size: int) -> None:
        self._bcast(torch.tensor([len(blob), size], dtype=torch.int64, device=self.device))
        if blob:
            self._bcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device))

    def send(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Send one version (with its layout, if it differs from the last one sent)."""
        self.send_packed(*pack(sd))

    def send_packed(self, layout: Layout, buf: torch.Tensor) -> None:
        """Send a version already packed (``pack``) into one buffer on this channel's device."""
        self._head(b"" if layout == self.layout else pickle.dumps(layout), buf.numel())
        self.layout, self.size = layout, buf.numel()
        self._bcast(buf)

    def send_none(self) -> None:
        """Tell the receiver that the version it waits for is no longer held (its ``recv`` returns None)."""
        self._head(b"", -1)

    def recv(self) -> dict[str, torch.Tensor] | None:
        """The next version, as views of one received buffer; None if the sender no longer held it."""
        head = torch.empty(2, dtype=torch.int64, device=self.device)
        self._bcast(head)
        n, size = (int(x) for x in head.tolist())
        if size < 0:
            return None
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


def pack(sd: Mapping[str, torch.Tensor]) -> tuple[Layout, torch.Tensor]:
    """A version as its layout and one flat byte buffer (on the tensors' device)."""
    layout, size = layout_of(sd)
    first = next(iter(sd.values()), None)
    buf = torch.empty(size, dtype=torch.uint8, device=first.device if first is not None else "cpu")
    for k, dt, shape, off, nb in layout:
        if nb:
            buf[off : off + nb].view(dt).view(shape).copy_(sd[k].detach())
    return layout, buf


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

    ``hold`` packs a version once (a detached copy in one buffer, whatever the number of
    replicas) and returns its number, which is all the weight store holds; ``open(name,
    host, device)`` starts replica ``name``'s channel (rank 0, completed in a thread once
    the replica joins) and returns (host, port); ``send(name, version)`` sends a held
    version over it, or, if it was evicted meanwhile, says so in-band (the replica's
    ``recv`` returns None and it loads the newest instead) and returns False. Sends to
    different replicas run side by side (the trainer actor serves them in their own
    threads), one at a time per channel. A channel whose replica died fails only its own
    sends; ``close`` forgets it, wakes a send waiting for it and shuts its process group
    down."""

    def __init__(self, keep: int = KEEP_VERSIONS):
        self.keep = keep
        self.held: dict[int, tuple[Layout, torch.Tensor]] = {}  # version -> packed on the trainer's device
        self._moved: dict[tuple[int, str], torch.Tensor] = {}  # (version, device) -> the buffer there
        self.channels: dict[str, Any] = {}  # name -> future of its WeightBroadcast
        self._locks: dict[str, threading.Lock] = {}  # name -> one send at a time on its channel
        self._lock = threading.Lock()

    def hold(self, version: int, sd: Mapping[str, torch.Tensor]) -> int:
        packed = pack(sd)
        with self._lock:
            self.held[version] = packed
            for old in sorted(self.held)[: -self.keep]:
                del self.held[old]
            for key in [k for k in self._moved if k[0] not in self.held]:
                del self._moved[key]
        return version

    def open(self, name: str, host: str, device: str = "cpu") -> tuple[str, int]:
        import concurrent.futures

        store = listen(host)
        fut: concurrent.futures.Future[WeightBroadcast] = concurrent.futures.Future()

        def connect() -> None:  # a daemon thread: a replica that never joins must not hold exit
            try:
                fut.set_result(WeightBroadcast(open_channel(0, store=store, device=device), src=0, device=device))
            except BaseException as e:  # noqa: BLE001 - the send that waits for it raises it
                fut.set_exception(e)

        with self._lock:
            self._locks[name] = threading.Lock()
            self.channels[name] = fut
        threading.Thread(target=connect, name=f"mixrl-channel-{name}", daemon=True).start()
        return host, int(store.port)

    def _buffer(self, version: int, device: torch.device) -> tuple[Layout, torch.Tensor] | None:
        with self._lock:
            if version not in self.held:
                return None
            layout, buf = self.held[version]
            if buf.device != device:  # once per (version, device), not once per replica
                key = (version, str(device))
                if key not in self._moved:
                    self._moved[key] = buf.to(device)
                buf = self._moved[key]
            return layout, buf

    def _channel(self, name: str) -> WeightBroadcast:
        import concurrent.futures

        deadline = time.monotonic() + TIMEOUT_S
        while True:
            fut = self.channels.get(name)
            if fut is None:
                raise KeyError(f"no weights channel to replica {name!r}")
            try:
                return fut.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica {name!r} did not join its weights channel in {TIMEOUT_S:.0f} s") from None

    def send(self, name: str, version: int) -> bool:
        ch = self._channel(name)
        with self._locks[name]:
            packed = self._buffer(version, ch.device)
            if packed is None:
                ch.send_none()
                return False
            ch.send_packed(*packed)
            return True

    def close(self, name: str) -> None:
        with self._lock:
            fut = self.channels.pop(name, None)
            self._locks.pop(name, None)
        if fut is not None and fut.done() and fut.exception() is None:
            # in a thread: shutting down a group whose peer is gone must not hold the trainer
            threading.Thread(target=_shutdown, args=(fut.result().group,), daemon=True).start()


def _shutdown(group: Any) -> None:
    with contextlib.suppress(Exception):
        group.shutdown()
