"""One weights version in shared memory, mapped by every replica on the machine.

    trainer ──one copy──► /dev/shm/mixrl-w-*/v3.bin  ◄──mmap── replica a, b, c (no copy)
                                │
         for_format("nvfp4") ──one quantization──► v3.nvfp4.bin ◄──mmap── replicas of that format

``SharedVersion.from_state_dict(sd)`` writes a state dict once into a file in
``/dev/shm`` (RAM-backed): each tensor at a 64-byte aligned offset of one flat
file. What crosses a process boundary is the small ``manifest()``:
``{name: (file, dtype, shape, offset)}``; ``map_manifest`` turns it back into
tensors that are views of the mapped file (``torch.from_file(shared=True)``),
so N replicas cost one copy, not N.

Quantization into a sampler format happens once per (version, format):
``for_format(key, quantize)`` runs ``quantize(name, tensor)`` over the
quantizable weights the first time a replica of that format asks (under a lock,
so concurrent replicas of one format wait for the same result) and writes only
the tensors it changed into a second file; the format's manifest points at that
file for those names and at the base file for the rest. ``build_format`` is
the same with the quantization done elsewhere: the embedded backend lets the
first sampler worker of a format quantize in its own process, so the formats
of one version are built in parallel and off the trainer's interpreter.

Lifetime: the weight store calls ``retire()`` when it evicts a version; the
files are deleted once retired and no load holds them (``acquire``/``release``
around each replica load): renamed away at once, their memory freed by a
background thread off the publication's path. An existing mapping survives the deletion (POSIX),
so a replica that already mapped a version keeps reading it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import torch

ALIGN = 64
Manifest = dict[str, tuple[str, str, tuple[int, ...], int]]  # name -> (file, dtype, shape, byte offset)
_DIR: Path | None = None
_DIR_LOCK = threading.Lock()
_COUNTER = iter(range(1 << 62))


def checkpoint_bytes(model_path: str | Path, itemsize: int = 4) -> int:
    """Bytes of the model's weights held as ``itemsize``-byte elements (FP32 by default), read
    from its safetensors headers without loading a tensor."""
    from safetensors import safe_open

    n = 0
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open has no __iter__
                shape = h.get_slice(k).get_shape()
                n += int(torch.Size(shape).numel())
    return n * itemsize


def shm_shortfall(need: int, root: str = "/dev/shm") -> str | None:
    """One line when ``root`` (RAM-backed shared memory) has less than ``need`` bytes free;
    None when it has room or does not exist (the versions then go to a temporary directory).
    Containers often give /dev/shm 64 MiB (Docker's default): a model's weights do not fit."""
    if not (os.path.isdir(root) and os.access(root, os.W_OK)):
        return None
    free = shutil.disk_usage(root).free
    if free >= need:
        return None
    gib = max(1, -(-int(need * 1.25) // 2**30))
    return (f"{root} has {free / 2**20:.0f} MiB free but the shared weight versions need about "
            f"{need / 2**20:.0f} MiB; give it more (docker run --shm-size={gib}g, or a larger tmpfs)")


def shm_dir() -> Path:
    """This process's private directory under /dev/shm (a temporary directory elsewhere),
    removed when the interpreter exits (``/dev/shm`` is RAM: a process that never called
    ``cleanup_dir`` would otherwise leave its last versions there until reboot)."""
    global _DIR
    with _DIR_LOCK:
        if _DIR is None or not _DIR.exists():
            root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
            _DIR = Path(tempfile.mkdtemp(prefix=f"mixrl-w-{os.getpid()}-", dir=root))
            atexit.register(_remove_at_exit, _DIR, os.getpid())
        return _DIR


def _remove_at_exit(path: Path, owner: int) -> None:
    if os.getpid() == owner:  # not a forked child that inherited the handler
        shutil.rmtree(path, ignore_errors=True)


def shm_bytes() -> int:
    """Bytes of memory the files in this process's shared-memory directory hold (the versions
    not yet deleted, mapped or not); 0 when it has none."""
    d = _DIR
    if d is None:
        return 0
    n = 0
    with contextlib.suppress(OSError):
        for f in d.iterdir():
            with contextlib.suppress(OSError):
                n += f.stat().st_blocks * 512
    return n


def cleanup_dir() -> None:
    """Remove this process's shared-memory directory (end of a run)."""
    global _DIR
    with _DIR_LOCK:
        if _DIR is not None:
            shutil.rmtree(_DIR, ignore_errors=True)
            _DIR = None


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _same_key(t: torch.Tensor) -> tuple[object, ...] | None:
    """What makes two entries one tensor (a tied embedding and head): same memory, same view."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)


def write_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> Manifest:
    """Copy ``tensors`` (any device) into one flat file; the only copy a version costs.
    Entries that are one tensor (tied weights: the same memory, viewed the same way) are
    written once and share their offset.

    Written with ``pwrite`` rather than through a mapping: the kernel fills the new
    file's pages in bulk, where copying into a fresh mapping takes one page fault per
    4 KiB page (4.4 ms instead of 0.4 ms for the bundled policy's 1.6 MB on this VM)."""
    layout, off, first = {}, 0, {}
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        key = _same_key(t) if nbytes else None
        if key is not None and key in first:
            layout[k] = (layout[first[key]][0], 0)  # written with its twin
            continue
        if key is not None:
            first[key] = k
        layout[k] = (off, nbytes)
        off += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    out: Manifest = {}
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, max(off, 1))
        for k, t in tensors.items():
            o, nb = layout[k]
            t = t.detach()
            if nb:
                raw = memoryview(t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
                done = 0
                while done < nb:  # a regular file takes it all at once; loop for safety
                    done += os.pwrite(fd, raw[done:], o + done)
            out[k] = (str(path), _dtype_name(t.dtype), tuple(t.shape), o)
    finally:
        os.close(fd)
    return out


def map_manifest(manifest: Manifest) -> dict[str, torch.Tensor]:
    """Tensors viewing the mapped files (no copy). Read-only by convention: replicas
    quantize or cast into their own buffers; writing would change every replica's weights.

    One view op per tensor (``as_strided`` on the file viewed in its dtype): offsets are
    ``ALIGN``-aligned, so a multiple of every element size."""
    files: dict[str, torch.Tensor] = {}
    typed: dict[tuple[str, str], torch.Tensor] = {}
    out = {}
    for k, (f, dt, shape, off) in manifest.items():
        flat = typed.get((f, dt))
        if flat is None:
            raw = files.get(f)
            if raw is None:
                raw = files[f] = torch.from_file(f, shared=True, size=os.path.getsize(f), dtype=torch.uint8)
            dtype = getattr(torch, dt)
            es = _ELEMENT_SIZE.get(dtype) or _ELEMENT_SIZE.setdefault(dtype, torch.empty((), dtype=dtype).element_size())
            flat = typed[(f, dt)] = raw[: raw.numel() // es * es].view(dtype)
        es = flat.element_size()
        stride, n = [], 1
        for s in reversed(shape):
            stride.append(n)
            n *= s
        out[k] = flat.as_strided(shape, stride[::-1], off // es)
    return out


_ELEMENT_SIZE: dict[torch.dtype, int] = {}


Quantize = Callable[[str, torch.Tensor], torch.Tensor | None]  # (name, fp32 tensor) -> quantized, or None = keep
Produce = Callable[[Manifest, Path], tuple[Manifest, float | None]]  # see SharedVersion.build_format
AsyncProduce = Callable[[Manifest, Path], Awaitable[tuple[Manifest, float | None]]]


class SharedVersion:
    """One published version: a base file plus one file per sampler format (see module doc)."""

    def __init__(self, manifest: Manifest, files: list[Path], stem: Path):
        self._base = manifest
        self._files = list(files)
        self._stem = stem
        self._formats: dict[str, Manifest] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._building: dict[str, Any] = {}  # format -> future its async producer resolves
        self._lock = threading.Lock()
        self._holds = 0
        self._retired = False
        self.quantize_s: dict[str, float] = {}  # format -> seconds its one quantization took
        self.copy_s = 0.0

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, torch.Tensor]) -> SharedVersion:
        import time

        t0 = time.perf_counter()
        stem = shm_dir() / f"w{next(_COUNTER)}"
        path = stem.with_suffix(".bin")
        v = cls(write_tensors(sd, path), [path], stem)
        v.copy_s = time.perf_counter() - t0
        return v

    def manifest(self, fmt: str | None = None) -> Manifest:
        """The base manifest, or that of ``fmt`` (which ``for_format`` must have built)."""
        return self._base if fmt is None else self._formats[fmt]

    def tensors(self) -> dict[str, torch.Tensor]:
        return map_manifest(self._base)

    def for_format(self, fmt: str, quantize: Quantize) -> Manifest:
        """The manifest of this version in ``fmt``, quantizing once here (thread-safe)."""

        def produce(base: Manifest, path: Path) -> tuple[Manifest, float | None]:
            changed = {}
            for k, t in map_manifest(base).items():
                q = quantize(k, t)
                if q is not None:
                    changed[k] = q
            return (write_tensors(changed, path) if changed else {}), None

        return self.build_format(fmt, produce)[0]

    def build_format(self, fmt: str, produce: Produce) -> tuple[Manifest, bool]:
        """(manifest of ``fmt``, whether this call built it), building it once (thread-safe).

        ``produce(base_manifest, path)`` quantizes the base version, writes the tensors it
        changed into ``path`` and returns (their manifest, seconds the quantization took or
        None = the whole call). It runs under the format's lock: concurrent callers of one
        format wait for it; if it raises, nothing is recorded and the next caller builds.
        A sampler worker process can be the producer (it quantizes in its own interpreter,
        so formats are built in parallel, and loads what it built without mapping it again).
        """
        import time

        with self._lock:
            lock = self._locks.setdefault(fmt, threading.Lock())
        with lock:
            if fmt in self._formats:
                return self._formats[fmt], False
            t0 = time.perf_counter()
            path = self._stem.with_suffix(f".{_safe(fmt)}.bin")
            with self._lock:
                self._files.append(path)  # deleted with the version even if produce fails midway
            changed, secs = produce(self._base, path)
            man = dict(self._base)
            man.update(changed)
            with self._lock:
                self._formats[fmt] = man
            self.quantize_s[fmt] = time.perf_counter() - t0 if secs is None else secs
            return man, True

    async def build_format_async(self, fmt: str, produce: AsyncProduce) -> tuple[Manifest | None, bool]:
        """``build_format`` for callers on one event loop (the embedded backend's worker
        handles): the same once-per-format rule without a thread per waiting replica.

        ``produce`` may return ``(None, secs)``: it quantized for its own replica only and
        wrote nothing (no other replica of the format exists); the format is then not
        recorded, and this returns ``(None, True)``: a replica of the format that asks
        later builds it again."""
        import asyncio
        import time

        while fmt not in self._formats:
            fut = self._building.get(fmt)
            if fut is None:
                break
            with contextlib.suppress(Exception):  # its producer failed: try to build it here
                await asyncio.shield(fut)
        if fmt in self._formats:
            return self._formats[fmt], False
        fut = asyncio.get_running_loop().create_future()
        self._building[fmt] = fut
        try:
            t0 = time.perf_counter()
            path = self._stem.with_suffix(f".{_safe(fmt)}.bin")
            with self._lock:
                self._files.append(path)
            changed, secs = await produce(self._base, path)
            self.quantize_s[fmt] = time.perf_counter() - t0 if secs is None else secs
            if changed is None:  # built for its producer alone (nothing written): not recorded
                return None, True
            man = dict(self._base)
            man.update(changed)
            with self._lock:
                self._formats[fmt] = man
            return man, True
        finally:
            del self._building[fmt]
            fut.set_result(None)

    # -- lifetime ------------------------------------------------------------------
    def acquire(self) -> None:
        with self._lock:
            if self._retired and self._holds == 0 and not self._files_exist():
                raise FileNotFoundError("weights version was already released")
            self._holds += 1

    def release(self) -> None:
        with self._lock:
            self._holds -= 1
            self._maybe_delete()

    def retire(self) -> None:
        """No new loads will start from this version (the store evicted it)."""
        with self._lock:
            self._retired = True
            self._maybe_delete()

    def _files_exist(self) -> bool:
        return self._files[0].exists()  # the base file: a format file may not exist (nothing changed)

    def _maybe_delete(self) -> None:
        if self._retired and self._holds <= 0:
            for p in self._files:
                _discard(p)


def _discard(path: Path) -> None:
    """Delete ``path``: renamed away at once (its name is gone, as if unlinked), unlinked by a
    background thread. Unlinking frees the file's pages inside the call (~0.3 ms per MB on
    tmpfs), which would otherwise land on the next publication's critical path: the store
    retires the oldest version while publishing the newest."""
    gone = path.with_name(path.name + ".gone")
    try:
        os.rename(path, gone)
    except FileNotFoundError:
        return
    except OSError:
        path.unlink(missing_ok=True)
        return
    with _JANITOR_LOCK:
        _TRASH.append(gone)
        global _JANITOR
        if _JANITOR is None or not _JANITOR.is_alive():
            _JANITOR = threading.Thread(target=_sweep, name="mixrl-shm-janitor", daemon=True)
            _JANITOR.start()
        _JANITOR_WAKE.set()


_TRASH: list[Path] = []
_JANITOR: threading.Thread | None = None
_JANITOR_LOCK = threading.Lock()
_JANITOR_WAKE = threading.Event()


def _sweep() -> None:
    with contextlib.suppress(OSError, AttributeError):  # the lowest priority: it runs when the cores idle
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    while True:
        _JANITOR_WAKE.wait()
        with _JANITOR_LOCK:
            paths = list(_TRASH)
            _TRASH.clear()
            _JANITOR_WAKE.clear()
        for p in paths:
            p.unlink(missing_ok=True)  # a cleaned-up directory took it already


def _safe(fmt: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in fmt)
