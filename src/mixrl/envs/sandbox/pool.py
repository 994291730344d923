"""Admission of sandboxes: the memory caps of live sandboxes never add up past the parent cap.

    await POOL.acquire("episode", limits.cgroup_memory_bytes)   # waits (counted) while full
    POOL.release("episode", limits.cgroup_memory_bytes)         # at Sandbox.close

Every sandbox's cgroup has its own ``memory.max``; all of them sit under one parent capped
at ``HOST.total_memory()``. If the caps of the live sandboxes could add up past the parent
cap, memory-hungry episodes would push the parent to its limit and the kernel's OOM killer
would pick a process of *another* episode — a grader, and a correct fix would score 0. So a
sandbox is admitted only while the caps of the live ones, its own included, fit in its
budget; the memory any episode can use is then bounded by its own cap, and an OOM kill
only ever hits the episode that ran out.

Two budgets: ``grading`` (``HOST.grading_memory()``, reserved for graders: an episode
waiting to be graded never waits behind episodes still running) and ``episode`` (the rest
of the parent cap). Each is first come, first served::

    budget episode = 4 GiB, caps 1 GiB:  e1 e2 e3 e4 admitted; e5 waits (waits += 1)
    e2 closes                         :  e5 admitted (wait_s += how long it waited)

A request larger than its whole budget can never be admitted: ``SandboxError`` naming the
setting. Waiting polls every ``POLL_S`` (no thread is held, any event loop may wait).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter, deque

from mixrl.envs.sandbox.limits import HOST, SandboxError

POLL_S = 0.02
KINDS = ("episode", "grading")


class MemoryPool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.used: Counter[str] = Counter()  # kind -> bytes of caps admitted and not released
        self.live: Counter[str] = Counter()  # kind -> sandboxes admitted and not released
        self.waits: Counter[str] = Counter()  # kind -> admissions that had to wait
        self.wait_s: Counter[str] = Counter()  # kind -> seconds spent waiting
        self._queues: dict[str, deque[int]] = {k: deque() for k in KINDS}
        self._ids = itertools.count()

    @staticmethod
    def budgets() -> dict[str, int]:
        total, grading = HOST.total_memory(), HOST.grading_memory()
        return {"episode": total - grading, "grading": grading}

    def _try(self, kind: str, n: int, ticket: int, budget: int) -> bool:
        q = self._queues[kind]
        with self._lock:
            if (not q or q[0] == ticket) and self.used[kind] + n <= budget:
                if q and q[0] == ticket:
                    q.popleft()
                self.used[kind] += n
                self.live[kind] += 1
                return True
            if ticket not in q:
                q.append(ticket)
            return False

    async def acquire(self, kind: str, n: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"MemoryPool.acquire: kind must be one of {KINDS}, got {kind!r}")
        budget = self.budgets()[kind]
        if n > budget:
            raise SandboxError(f"memory: a {kind} sandbox's cgroup_memory_bytes ({n}) exceeds the whole {kind} "
                               f"budget ({budget}); raise configure(total_memory_bytes=...) or lower "
                               "grading_memory_bytes / the sandbox's limit")
        ticket = next(self._ids)
        if self._try(kind, n, ticket, budget):
            return
        t0 = time.monotonic()
        with self._lock:
            self.waits[kind] += 1
        try:
            while not self._try(kind, n, ticket, budget := self.budgets()[kind]):
                if n > budget:  # the budget was lowered below this request while it waited
                    raise SandboxError(f"{kind} memory cap {n} bytes exceeds the {kind} budget {budget} bytes")
                await asyncio.sleep(POLL_S)
        except BaseException:
            with self._lock:
                if ticket in self._queues[kind]:
                    self._queues[kind].remove(ticket)
            raise
        finally:
            with self._lock:
                self.wait_s[kind] += time.monotonic() - t0

    def release(self, kind: str, n: int) -> None:
        with self._lock:
            self.used[kind] -= n
            self.live[kind] -= 1

    def queued(self, kind: str) -> int:
        """Admissions of ``kind`` waiting now."""
        with self._lock:
            return len(self._queues[kind])

    def stats(self) -> dict[str, float]:
        """``pool/<kind>_waits``, ``pool/<kind>_wait_s``, ``pool/<kind>_live`` for logs and benches."""
        with self._lock:
            out: dict[str, float] = {}
            for k in KINDS:
                out[f"pool/{k}_waits"] = float(self.waits[k])
                out[f"pool/{k}_wait_s"] = round(self.wait_s[k], 3)
                out[f"pool/{k}_live"] = float(self.live[k])
            return out


POOL = MemoryPool()
