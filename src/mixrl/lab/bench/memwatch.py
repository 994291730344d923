"""Peak memory of a process tree while a benchmark runs: PSS sampled from ``/proc``.

PSS (proportional set size) charges each page shared by n processes 1/n to each, so
the sum over a tree counts shared memory once: the weights a trainer publishes in
shared memory and its sampler worker processes map are not counted once per mapping
(their RSS would be). A thread samples this process and all its descendants every
``every`` seconds; ``phase(name)`` starts a named section, whose own peak is kept
beside the overall one. Linux only: elsewhere ``available`` is False and peaks stay 0.

Where it goes (``breakdown()``): at the sample of the overall peak, each process's PSS split as
``/proc/PID/smaps_rollup`` splits it (``anon``: private heap and tensors, ``file``: mapped
libraries and files, ``shmem``: mapped shared memory, the weight versions in /dev/shm), named
by its ``comm`` (a sampler worker names itself ``s:<replica>``). PSS counts a file in /dev/shm
only where a process maps it: ``extra_bytes`` (a callable, e.g. the bytes of the run's
shared-memory files) is sampled beside it, and ``peak_total_bytes`` is the peak of PSS without
its shmem part plus those files once: the memory the tree holds, mapped or not.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixrl.weights.accounting import process_pss
from mixrl.weights.shared import shm_bytes  # noqa: F401 - the run's shared-memory files, for e2e


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def tree_pss(root: int | None = None) -> dict[int, dict[str, int]]:
    """``process_pss`` of ``root`` (default: this process) and every descendant, by pid."""
    out: dict[int, dict[str, int]] = {}
    todo, seen = [root or os.getpid()], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        one = process_pss(pid)
        if one is None:
            continue
        out[pid] = one
        todo += _children(pid)
    return out


def tree_pss_bytes(root: int | None = None) -> int:
    """PSS of ``root`` (default: this process) and every descendant, in bytes."""
    return sum(p["pss"] for p in tree_pss(root).values())


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


class PeakMemory:
    """``with PeakMemory() as m: ... m.phase("sync") ...``; then ``m.peak_bytes``, ``m.peaks``."""

    def __init__(self, every: float = 0.5, extra_bytes: Callable[[], int] | None = None) -> None:
        self.every = every
        self.extra_bytes = extra_bytes
        self.available = Path(f"/proc/{os.getpid()}/smaps_rollup").exists()
        self.peak_bytes = 0
        self.peak_total_bytes = 0
        self.peaks: dict[str, int] = {}
        self.at_peak: dict[str, Any] = {}  # the overall peak's sample: per process, extra bytes, phase
        self._phase: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mixrl-memwatch", daemon=True)

    def phase(self, name: str) -> None:
        self._sample()
        self._phase = name
        self.peaks.setdefault(name, 0)

    def _sample(self) -> None:
        if not self.available:
            return
        procs = tree_pss()
        now = sum(p["pss"] for p in procs.values())
        extra = self.extra_bytes() if self.extra_bytes is not None else 0
        self.peak_total_bytes = max(self.peak_total_bytes,
                                    now - sum(p.get("shmem", 0) for p in procs.values()) + extra)
        if now > self.peak_bytes:
            self.peak_bytes = now
            self.at_peak = {"procs": {pid: (process_name(pid), p) for pid, p in procs.items()},
                            "extra": extra, "phase": self._phase}
        if self._phase is not None:
            self.peaks[self._phase] = max(self.peaks[self._phase], now)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def gb(self) -> dict[str, object]:
        """Peaks in GB (2**30 bytes): ``peak_pss_gb`` overall, ``peak_pss_gb_by_phase`` per phase,
        ``peak_total_gb`` (PSS less its shmem part, plus ``extra_bytes``; see the module doc)."""
        return {"peak_pss_gb": round(self.peak_bytes / 2**30, 2),
                "peak_pss_gb_by_phase": {k: round(v / 2**30, 2) for k, v in self.peaks.items()},
                "peak_total_gb": round(self.peak_total_bytes / 2**30, 2)}

    def breakdown(self) -> dict[str, Any]:
        """The overall peak's sample in MB (2**20 bytes): its phase, the extra bytes, and per
        process (``comm`` and pid) its PSS and the anon/file/shmem parts, largest first."""
        mb = 2**20
        procs = sorted(self.at_peak.get("procs", {}).items(), key=lambda kv: -kv[1][1]["pss"])
        return {"phase": self.at_peak.get("phase"), "extra_mb": round(self.at_peak.get("extra", 0) / mb, 1),
                "processes": [{"name": name, "pid": pid, **{k: round(v / mb, 1) for k, v in p.items()}}
                              for pid, (name, p) in procs]}
