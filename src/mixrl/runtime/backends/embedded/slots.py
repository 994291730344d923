"""How many sampler workers quantize a weights version at once, and in which order.

Each (version, format) is quantized by one worker process. Started all at once,
the formats of one version share the machine's cores with each other and with
the replicas already loading a finished format, so the slowest format (the
publication's critical path) takes twice as long as it does alone. Instead,
``QuantizeSlots(n)`` lets at most ``n`` quantizations run (``n`` = the cores
this process may use, one per free core), and hands a freed slot to the
waiting format that took longest last time (unknown formats first, in order
of arrival): the slowest format starts at once, the short ones share the other
cores with the first loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
import os
import time
from collections.abc import AsyncIterator


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


class QuantizeSlots:
    def __init__(self, n: int | None = None):
        self.n = usable_cores() if n is None else n
        if self.n < 1:
            raise ValueError(f"QuantizeSlots needs n >= 1, got {self.n}")
        self.busy = 0
        self.cost: dict[str, float] = {}  # format -> seconds its last quantization held a slot
        self._waiting: list[tuple[float, int, asyncio.Future[None]]] = []  # (-cost, arrival, future)
        self._seq = itertools.count()
        self.members: dict[str, int] = {}  # format -> live replicas of it (see ``ProcessSampler``)

    def join(self, fmt: str) -> None:
        self.members[fmt] = self.members.get(fmt, 0) + 1

    def leave(self, fmt: str) -> None:
        self.members[fmt] = max(0, self.members.get(fmt, 0) - 1)

    @contextlib.asynccontextmanager
    async def slot(self, fmt: str) -> AsyncIterator[None]:
        """Hold one slot while quantizing ``fmt`` (waits for one if all are busy)."""
        if self.busy < self.n and not self._waiting:
            self.busy += 1
        else:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (-self.cost.get(fmt, math.inf), next(self._seq), fut))
            try:
                await fut  # resolved by _release: the slot passes straight to this waiter
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # handed a slot, then cancelled: give it on
                    self._release()
                raise
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.cost[fmt] = time.perf_counter() - t0
            self._release()

    def _release(self) -> None:
        while self._waiting:
            fut = heapq.heappop(self._waiting)[2]
            if not fut.done():  # a cancelled waiter is skipped
                fut.set_result(None)
                return
        self.busy -= 1
