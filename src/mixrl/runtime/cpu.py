"""CPU seconds of a run's training loop: this process and the sampler worker processes.

``proc_cpu(pid)`` reads a process's user + system CPU seconds from ``/proc``.
``LoopCPU`` takes readings at the loop's start, after every update and at the
end, and sums per replica what it used *in the loop*:

- a replica serving at the start counts from its reading then;
- a replica started during the loop (a replacement, a scale-up) counts from the
  moment it became ready: its start-up (interpreter, engine build) is reported
  apart, as ``sampler_startup_s``, not as sampling work;
- a replica that died counts up to its last reading (its handle reads its
  process once more when the pipe closes, then keeps that value).

Replicas are the backend's (every one it started, dead ones included) when it
keeps them (``backend.samplers``), else the fleet's current ones. Replicas
without a local process (thread replicas, remote actors) have no reading:
``samplers_s`` is then None (thread replicas count in this process).
"""

from __future__ import annotations

import os
import time
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (None without /proc or once it is reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


def _readable(h: Any) -> bool:
    return callable(getattr(h, "cpu_s", None))


class LoopCPU:
    def __init__(self, backend: Any, fleet: Any) -> None:
        self.backend, self.fleet = backend, fleet
        self.p0: float | None = None
        self.p1: float | None = None
        self.w0: dict[str, float] = {}  # replica name -> CPU s at the loop's start
        self.w1: dict[str, float] = {}  # ... and at its end (a dead one: its last reading)
        self.seen: dict[str, Any] = {}  # every replica handle the loop saw

    def _replicas(self) -> dict[str, Any]:
        reps = dict(self.fleet.handles)
        reps.update(getattr(self.backend, "samplers", None) or {})
        return {n: h for n, h in reps.items() if _readable(h)}

    def start(self) -> None:
        self.p0 = time.process_time()
        for n, h in self._replicas().items():
            self.seen[n] = h
            c = h.cpu_s()
            if c is not None:
                self.w0[n] = c

    def poll(self) -> None:
        """A reading of every replica (kept by its handle: the last one counts if it dies)."""
        for n, h in self._replicas().items():
            self.seen.setdefault(n, h)
            h.cpu_s()

    def stop(self) -> None:
        self.poll()
        self.p1 = time.process_time()
        for n, h in self.seen.items():
            c = h.cpu_s()
            if c is not None:
                self.w1[n] = c

    def summary(self, trainer_s: float) -> dict[str, float | None]:
        """CPU seconds over the loop: this process (trainer and event loop), the trainer's
        updates alone, the sampler workers' serving, and the start-up of replicas started in it."""
        if self.p0 is None or self.p1 is None:
            return {"orchestrator_s": None, "trainer_s": trainer_s, "samplers_s": None, "sampler_startup_s": None}
        workers = startup = 0.0
        for n, h in self.seen.items():
            end = self.w1.get(n)
            if end is None:
                continue
            if n in self.w0:
                workers += end - self.w0[n]
            elif getattr(h, "cpu_ready", None) is not None:
                workers += end - h.cpu_ready
                startup += h.cpu_ready
        known = bool(self.w0) or any(getattr(h, "cpu_ready", None) is not None for h in self.seen.values())
        return {"orchestrator_s": self.p1 - self.p0, "trainer_s": trainer_s,
                "samplers_s": workers if known else None, "sampler_startup_s": startup if known else None}
