"""Counting the bytes tensors hold, each storage once: ``tensor_bytes(obj)``.

A memory breakdown (``mixrl bench e2e``'s) counts what a process's objects hold rather than
estimating it from parameter counts: the engine's laid-out weights (fused, transposed, packed
copies, or views of a mapped file), the trainer's parameters, gradients and optimizer state.
Two tensors viewing one storage (a tied embedding and head, a view of a fused weight) count
once; a storage is split into ``owned`` (memory this process allocated) and ``mapped`` (a view
of a file mapped from shared memory, which PSS charges to every process that maps it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def _tensors(obj: Any, seen: set[int], depth: int = 0) -> Iterator[torch.Tensor]:
    if depth > 8 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield from _tensors(obj.grad, seen, depth + 1)
        return
    if isinstance(obj, dict):
        items: Any = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = obj
    elif isinstance(obj, torch.nn.Module):
        items = [*obj.parameters(), *obj.buffers()]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif hasattr(obj, "__slots__") or hasattr(obj, "__dict__"):
        names = [n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
        items = [getattr(obj, n, None) for n in names] + list(getattr(obj, "__dict__", {}).values())
    else:
        return
    for x in items:
        if isinstance(x, (torch.Tensor, dict, list, tuple, set, frozenset, torch.nn.Module)) or (
                hasattr(x, "__slots__") or dataclasses.is_dataclass(x)) and not isinstance(x, (str, bytes, type)):
            yield from _tensors(x, seen, depth + 1)


def shared_ranges(marker: str = "mixrl-w-") -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of the weight versions' files (their path
    holds ``marker``), from ``/proc/self/maps``; empty where it cannot be read."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if marker in line:
                    lo, hi = line.split(" ", 1)[0].split("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return out


def tensor_bytes(*objs: Any) -> dict[str, int]:
    """{"owned", "mapped", "tensors"}: bytes of the distinct storages the tensors reachable from
    ``objs`` use (through dicts, lists, dataclasses, slots, modules, ``.grad``), each once;
    ``mapped``: those that view a mapped weight-version file (``shared_ranges``)."""
    ranges = shared_ranges()
    storages: dict[int, tuple[int, bool]] = {}
    n, seen = 0, set()
    for obj in objs:
        for t in _tensors(obj, seen):
            n += 1
            try:
                st = t.untyped_storage()
                ptr, size = st.data_ptr(), st.nbytes()
            except (RuntimeError, NotImplementedError):  # an opaque layout (mkldnn): its elements
                ptr, size = id(t), t.numel() * t.element_size()
            storages[ptr] = (size, any(lo <= ptr < hi for lo, hi in ranges))
    owned = sum(s for s, m in storages.values() if not m)
    return {"owned": owned, "mapped": sum(s for s, m in storages.values() if m), "tensors": n}


_FIELDS = {"Pss:": "pss", "Pss_Anon:": "anon", "Pss_File:": "file", "Pss_Shmem:": "shmem"}


def process_pss(pid: int | str = "self") -> dict[str, int] | None:
    """{pss, anon, file, shmem} bytes of one process (``/proc/PID/smaps_rollup``), None when it
    is gone or cannot be read (not Linux)."""
    try:
        out = {}
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key = _FIELDS.get(line.split(" ", 1)[0])
            if key is not None:
                out[key] = int(line.split()[1]) * 1024
        return out if "pss" in out else None
    except (OSError, ValueError, IndexError):
        return None
