"""Peak memory of a process tree while a benchmark runs: PSS sampled from ``/proc``.

PSS (proportional set size) charges each page shared by n processes 1/n to each, so
the sum over a tree counts shared memory once: the weights a trainer publishes in
shared memory and its sampler worker processes map are not counted once per mapping
(their RSS would be). A thread samples this process and all its descendants every
``every`` seconds; ``phase(name)`` starts a named section, whose own peak is kept
beside the overall one. Linux only: elsewhere ``available`` is False and peaks stay 0.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def tree_pss_bytes(root: int | None = None) -> int:
    """PSS of ``root`` (default: this process) and every descendant, in bytes."""
    total, todo, seen = 0, [root or os.getpid()], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError):  # gone, or not ours to read
            continue
        todo += _children(pid)
    return total


class PeakMemory:
    """``with PeakMemory() as m: ... m.phase("sync") ...``; then ``m.peak_bytes``, ``m.peaks``."""

    def __init__(self, every: float = 0.5) -> None:
        self.every = every
        self.available = Path(f"/proc/{os.getpid()}/smaps_rollup").exists()
        self.peak_bytes = 0
        self.peaks: dict[str, int] = {}
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
        now = tree_pss_bytes()
        self.peak_bytes = max(self.peak_bytes, now)
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
        """Peaks in GB (2**30 bytes): ``peak_pss_gb`` overall, ``peak_pss_gb_by_phase`` per phase."""
        return {"peak_pss_gb": round(self.peak_bytes / 2**30, 2),
                "peak_pss_gb_by_phase": {k: round(v / 2**30, 2) for k, v in self.peaks.items()}}
