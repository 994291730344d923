"""Fair shares of the fleet between clients: ``FairGate``.

Every generation (one choice of a request) takes a slot of ``capacity`` (the
fleet's rows: ``max_batch`` per replica) for as long as it runs. A client is
the API key it sent (when the server has several) or its address. Waiting
generations queue per client, at most ``max_queued`` each (a request that would
pass it is answered 429 at once, nothing queued); a freed slot goes to the next
client in round-robin order, so a client with a thousand choices waiting and a
client with one alternate.

Headroom: the last ``reserve`` slots (``capacity // 8`` by default) go only to a
client holding fewer than its fair share of the rest (``(capacity - reserve) //
active clients``), so clients sending many long generations fill at most
``capacity - reserve`` rows together (a client alone too: the price of the rule),
and a light client's request starts at the engine's next step instead of waiting
for a long reply to end. Example (capacity 4, reserve 1)::

    A sends 9 choices     A holds 3 (the 4th slot is headroom: A holds its share, 3 // 1)
    B sends 1             B holds 1 at once (0 < 3 // 2); A's next waits for a slot
    A's, B's end          the freed slot goes to whoever is next in turn
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class QueueFull(Exception):
    """A client's queue would pass its bound."""

    def __init__(self, client: str, limit: int) -> None:
        super().__init__(f"{client} has {limit} generations waiting at most")
        self.limit = limit


class FairGate:
    def __init__(self, capacity: int = 64, reserve: int | None = None, max_queued: int = 256) -> None:
        if capacity < 1 or max_queued < 1:
            raise ValueError("capacity and max_queued must be >= 1")
        self.capacity, self.max_queued = capacity, max_queued
        self.reserve = min(capacity - 1, capacity // 8 if reserve is None else reserve)
        self.held: collections.Counter[str] = collections.Counter()  # client -> slots held
        self.queued: collections.Counter[str] = collections.Counter()  # client -> admitted, not yet holding
        self.waiting: dict[str, collections.deque[asyncio.Future[None]]] = {}  # in turn order
        self.last: dict[str, int] = {}  # client -> when it was last given a slot (the turn order)
        self.total = self._tick = 0
        self.granted: list[str] = []  # the order slots were given, when ``trace`` (tests)
        self.trace = False

    def admit(self, client: str, n: int) -> None:
        """Room in ``client``'s queue for ``n`` more generations, or ``QueueFull``."""
        if self.queued[client] + n > self.max_queued:
            raise QueueFull(client, self.max_queued)
        self.queued[client] += n

    def _active(self) -> int:
        return len(self.held.keys() | self.waiting.keys())

    def _may(self, client: str) -> bool:
        if self.total >= self.capacity:
            return False
        room = self.capacity - self.reserve
        return self.total < room or self.held[client] < max(1, room // max(1, self._active()))

    def _grant(self, client: str) -> None:
        self.held[client] += 1
        self.total += 1
        self._tick += 1
        self.last[client] = self._tick
        self.queued[client] -= 1
        if self.queued[client] <= 0:
            del self.queued[client]
        if self.trace:
            self.granted.append(client)

    @asynccontextmanager
    async def slot(self, client: str) -> AsyncIterator[None]:
        """Hold one slot while the body runs (admitted first with ``admit``)."""
        if client not in self.waiting and self._may(client):
            self._grant(client)
        else:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.waiting.setdefault(client, collections.deque()).append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._release(client)  # granted as it was cancelled
                else:
                    self._forget(client, fut)
                raise
        try:
            yield
        finally:
            self._release(client)

    def _forget(self, client: str, fut: asyncio.Future[None]) -> None:
        q = self.waiting.get(client)
        if q is not None and fut in q:
            q.remove(fut)
            if not q:
                del self.waiting[client]
        self.queued[client] -= 1
        if self.queued[client] <= 0:
            del self.queued[client]
        if client not in self.held and client not in self.waiting:
            self.last.pop(client, None)

    def _release(self, client: str) -> None:
        self.held[client] -= 1
        self.total -= 1
        if self.held[client] <= 0:
            del self.held[client]
            if client not in self.waiting:
                self.last.pop(client, None)
        self._dispatch()

    def _dispatch(self) -> None:
        """Give free slots in turn: to the waiting client that may take one and was given one
        longest ago (one never given one first, in order of arrival)."""
        while self.waiting and self.total < self.capacity:
            ready = [c for c in self.waiting if self._may(c)]
            if not ready:
                return
            client = min(ready, key=lambda c: self.last.get(c, -1))
            q = self.waiting[client]
            fut = q.popleft()
            if not q:
                del self.waiting[client]
            if not fut.cancelled():  # a cancelled one is forgotten by its own task
                self._grant(client)
                fut.set_result(None)
