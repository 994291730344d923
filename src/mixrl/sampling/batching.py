"""``BatchingSampler``: the async face of one engine replica.

Concurrent ``generate`` calls are collected into batches for the synchronous
``Engine.generate_batch``, which runs in a worker thread so the event loop
keeps serving. Weight updates travel through the same FIFO queue, so they
apply between batches, never inside one: every token of a result has one
version, and a request sent after ``load_weights`` was called sees the new one.

State machine of the background task (one per sampler)::

    IDLE ──item──► COLLECTING ──max_batch, max_wait_ms, idle_ms or a weights item──► RUNNING
      ▲                                                                              │
      └────────────── futures resolved; queued weights item applied ◄────────────────┘
    any state ──engine exception──► FAILED (every pending and later call: ReplicaFailure)

Example (``max_batch=2``, ``max_wait_ms=5``)::

    t=0ms   generate(a), generate(b)   IDLE -> COLLECTING [a, b] -> full -> RUNNING [a, b] (v3)
    t=1ms   generate(c)                queued
    t=2ms   load_weights(sd, 4)        queued behind c
    t=9ms   batch [a, b] done          a, b resolved with version 3;
                                       COLLECTING [c] meets the weights item -> RUNNING [c] (v3)
    t=12ms  batch [c] done             c resolved (v3); weights applied; load_weights returns (v4)
    t=13ms  generate(d)                ... d is generated with version 4

With ``idle_ms=3`` and ``max_wait_ms=100`` (and batches of under 30ms so far), requests
arriving at t=0, 2, 4 ... 40ms run as one batch at about t=43ms (3ms after the last), not
as [t=0..5] [t=6..] ... batches; once one of the last 8 batches took 200ms the gap is 20ms.

Continuous batching: an engine with ``stream()`` (the built-in one) runs a batch
that requests join between decode steps (``sampling/builtin/running.py``). A
request that arrives while it runs is admitted at the next step instead of
waiting for the whole batch, and each result is resolved as soon as its row
finishes (so a session's next turn can join the same batch). A weights item
stops admissions: the running rows finish on the version they started with, then
the weights apply and the requests queued behind them run on the new version, so
the rule above holds unchanged (one version per result; a request sent after
``load_weights`` sees the new one). A batch started from IDLE still gathers with
``max_wait_ms``/``idle_ms`` (one prefill for a burst), but its quiet gap does not
grow with the batch time: a request that misses the start joins the next step.
``batches`` counts prefills (groups of requests that joined together).
``join_threadsafe`` lets another thread (a sampler worker's pipe reader) add a
request to the running batch and take its result from the engine's thread,
with no event-loop round trip; requests no batch admits go through ``generate``.

A failing ``generate_batch`` or ``load_weights`` is a replica failure: the
futures of that batch, everything queued and every later call raise
``ReplicaFailure`` so sessions continue on another replica; a bad *request*
never raises here (the engine returns an error ``finish_reason`` for it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mixrl.records.generation import GenerationRequest, GenerationResult
from mixrl.sampling.base import Engine, ReplicaFailure

Sink = Callable[[list[tuple[Any, "GenerationResult | BaseException"]]], None]


class _Direct:
    """The stand-in future of a request joined from another thread (``join_threadsafe``):
    settling it calls its sink, in the thread that settles it."""

    __slots__ = ("key", "sink", "settled")

    def __init__(self, key: Any, sink: Sink) -> None:
        self.key, self.sink, self.settled = key, sink, False

    def done(self) -> bool:
        return self.settled

    def set_result(self, result: Any) -> None:
        self.settled = True
        self.sink([(self.key, result)])

    def set_exception(self, error: BaseException) -> None:
        self.settled = True
        self.sink([(self.key, error)])


@dataclass(eq=False)  # hashed by identity (the in-flight set)
class _Item:
    future: asyncio.Future[Any] | _Direct
    request: GenerationRequest | None = None  # a generation, or
    weights: tuple[Mapping[str, Any], int] | None = None  # a weight update (state dict, version)
    enqueued: float = 0.0


class BatchingSampler:
    """The async replica over one engine: concurrent ``generate`` calls become batches."""

    def __init__(self, engine: Engine, *, max_batch: int = 64, max_wait_ms: float = 5,
                 idle_ms: float | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if idle_ms is not None and idle_ms < 0:
            raise ValueError(f"idle_ms must be >= 0, got {idle_ms}")
        self.engine = engine
        self.group = engine.group
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        # None: collect for max_wait_ms. A number: also close the batch once no request came
        # for idle_ms or a tenth of a recent batch's run time (the longest of the last 8),
        # whichever is longer, so a long max_wait_ms gathers a burst that trickles in (HTTP
        # requests parsed one after another) without holding a lone request for all of it.
        # A batch costs about the same whatever its size, so splitting a burst costs a whole
        # batch, a longer gap a tenth at most; and on a loaded machine arrivals and batches
        # slow down together.
        self.idle = None if idle_ms is None else idle_ms / 1000.0
        self._runs: collections.deque[float] = collections.deque(maxlen=8)  # recent batches' seconds
        self.failure: BaseException | None = None  # set once: FAILED
        self.batches = 0  # batches run (continuous: prefills), for tests and metrics
        self.steps = 0  # decode steps of continuous batches
        self._queue: asyncio.Queue[_Item] | None = None
        self._task: asyncio.Task[None] | None = None
        self._carry: _Item | None = None  # an item taken while collecting, handled next
        # continuous batching (engines with stream()): requests for the running batch, taken
        # by the worker thread between steps; _admitting is False once a weights item waits
        self._continuous = callable(getattr(engine, "stream", None))
        self._lock = threading.Lock()
        self._inbox: collections.deque[_Item] = collections.deque()
        self._admitting = False
        self._stop = False
        self._flight: set[_Item] = set()  # admitted to a continuous batch, result not yet delivered

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        fut = self._submit(_Item(asyncio.get_running_loop().create_future(), request=request))
        return await fut

    def generate_to(self, request: GenerationRequest, key: Any, sink: Sink) -> None:
        """``generate`` without an awaitable (on the event loop's thread): the result, or
        ``ReplicaFailure``, reaches ``sink([(key, result), ...])`` from whichever thread
        settles it (the engine's, for a continuous batch), so results do not wake the loop."""
        self._submit(_Item(_Direct(key, sink), request=request))

    def join_threadsafe(self, request: GenerationRequest, key: Any, sink: Sink) -> bool:
        """From any thread: add ``request`` to the running continuous batch if it is admitting
        requests, and return True; its result (or ``ReplicaFailure``) then reaches
        ``sink([(key, result), ...])``, called in the engine's thread with every row a decode
        step finished, without waking the event loop. False (nothing done): no batch runs, or
        a weights item waits; the caller goes through ``generate``. A caller that sent
        ``load_weights`` must not join a request sent after it before that call has started
        (the batch still admits until the weights item is submitted)."""
        if not self._continuous or self.failure is not None or self._stop:
            return False
        item = _Item(_Direct(key, sink), request=request, enqueued=time.perf_counter())
        with self._lock:
            if not self._admitting:
                return False
            self._inbox.append(item)
        return True

    async def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        fut = self._submit(_Item(asyncio.get_running_loop().create_future(), weights=(state_dict, version)))
        await fut

    async def close(self) -> None:
        """Stop the background task; pending calls raise ReplicaFailure."""
        self._stop = True  # a running batch ends at its next step
        with self._lock:
            self._admitting = False
            left = list(self._inbox) + list(self._flight)
            self._inbox.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        failure = ReplicaFailure(f"sampler {self.group!r} closed")
        for b in left:
            if not b.future.done():
                b.future.set_exception(failure)
        self._fail_all(failure)

    # ------------------------------------------------------------------ internals
    def _submit(self, item: _Item) -> asyncio.Future[Any]:
        if self.failure is not None:
            raise ReplicaFailure(f"sampler {self.group!r} has failed: {self.failure!r}")
        if self._queue is None:
            self._queue = asyncio.Queue()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        item.enqueued = time.perf_counter()
        if self._admitting and self._carry is None and self._queue.empty():
            with self._lock:
                if self._admitting:
                    if item.request is not None:  # joins the running batch at its next step
                        self._inbox.append(item)
                        return item.future
                    self._admitting = False  # weights: the running rows finish first
        self._queue.put_nowait(item)
        return item.future

    async def _next(self, timeout: float | None) -> _Item | None:
        if self._carry is not None:
            item, self._carry = self._carry, None
            return item
        assert self._queue is not None
        if timeout is None:
            return await self._queue.get()
        try:
            return await asyncio.wait_for(self._queue.get(), max(timeout, 0.0))
        except TimeoutError:
            return None

    async def _loop(self) -> None:
        while True:
            first = await self._next(None)  # IDLE
            if first is None:
                continue
            if first.weights is not None:
                await self._apply(first)
                continue
            batch = [first]  # COLLECTING
            deadline = time.perf_counter() + self.max_wait
            while len(batch) < self.max_batch:
                left = deadline - time.perf_counter()
                # a request that misses a continuous batch's start joins it a step later: no long gap
                runs = 0.0 if self._continuous else max(self._runs, default=0.0)
                gap = left if self.idle is None else max(self.idle, runs / 10)
                item = await self._next(min(left, gap))
                if item is None:
                    break
                if item.weights is not None:  # weights wait for the requests sent before them
                    self._carry = item
                    break
                batch.append(item)
            await self._run(batch)  # RUNNING
            if self.failure is not None:
                return

    async def _run(self, batch: list[_Item]) -> None:
        batch = [b for b in batch if not b.future.done()]  # caller gave up (cancelled)
        if not batch:
            return
        if self._continuous:
            await self._stream(batch)
            return
        start = time.perf_counter()
        try:
            results = await asyncio.to_thread(self.engine.generate_batch, [b.request for b in batch])  # type: ignore[misc]
            if len(results) != len(batch):
                raise RuntimeError(f"engine returned {len(results)} results for {len(batch)} requests")
        except Exception as e:  # noqa: BLE001 - any engine error is a replica failure
            self._fail(e, batch)
            return
        self.batches += 1
        # the gap uses the longest of the last 8: one short batch (a 1-token request) does not
        # shrink the gap the next burst gets
        self._runs.append(time.perf_counter() - start)
        for b, r in zip(batch, results, strict=True):
            r.timings["queue_s"] = start - b.enqueued
            r.timings["sampler_batch"] = float(len(batch))
            if not b.future.done():
                b.future.set_result(r)

    async def _stream(self, batch: list[_Item]) -> None:
        """Run a continuous batch until it has no rows and nothing waits to join it."""
        assert self._queue is not None
        while self._carry is None and not self._queue.empty():  # queued behind the batch: join it
            item = self._queue.get_nowait()
            if item.weights is not None:
                self._carry = item
            else:
                batch.append(item)
        self._inbox.extend(batch)
        self._admitting, self._stop = self._carry is None, False
        flight = self._flight = set()
        try:
            await asyncio.to_thread(self._drive, asyncio.get_running_loop(), flight)
        except Exception as e:  # noqa: BLE001 - any engine error is a replica failure
            with self._lock:
                self._admitting = False
                left = list(self._inbox)
                self._inbox.clear()
            self._fail(e, list(flight) + left)

    def _drive(self, loop: asyncio.AbstractEventLoop, flight: set[_Item]) -> None:
        """Worker thread: admit what the inbox holds, step, post finished results."""
        run = self.engine.stream()  # type: ignore[attr-defined]
        while not self._stop:
            with self._lock:
                take = [it for it in self._inbox if not it.future.done()]  # as _run: callers that gave up
                self._inbox.clear()
                flight.update(take)
                if not take and run.idle:
                    self._admitting = False
                    return
            if take:
                done = run.add([(it, it.request) for it in take])
                if done:
                    self._post(loop, flight, done)
            before = run.cohorts
            run.fill(self.max_batch)
            self.batches += run.cohorts - before
            if run.rows:
                self.steps += 1
                done = run.step()
                if done:
                    self._post(loop, flight, done)

    def _post(self, loop: asyncio.AbstractEventLoop, flight: set[_Item], done: list[tuple[Any, Any]]) -> None:
        with self._lock:
            for it, _ in done:
                flight.discard(it)
        # rows joined from another thread go to their sink from here, one call per sink and step
        direct: dict[Sink, list[tuple[Any, Any]]] = {}
        queued = []
        now = time.perf_counter()
        for it, r in done:
            f = it.future
            if isinstance(f, _Direct):
                if not f.settled:
                    f.settled = True
                    direct.setdefault(f.sink, []).append((f.key, _stamp(it, r, now)))
            else:
                queued.append((it, r))
        for sink, out in direct.items():
            sink(out)
        if queued:
            with contextlib.suppress(RuntimeError):  # the loop closed under a stopping sampler
                loop.call_soon_threadsafe(self._deliver, queued)

    def _deliver(self, done: list[tuple[_Item, GenerationResult]]) -> None:
        now = time.perf_counter()
        for it, r in done:
            if not it.future.done():
                it.future.set_result(_stamp(it, r, now))

    async def _apply(self, item: _Item) -> None:
        assert item.weights is not None
        try:
            await asyncio.to_thread(self.engine.load_weights, *item.weights)
        except Exception as e:  # noqa: BLE001 - a replica that cannot load cannot serve
            self._fail(e, [item])
            return
        if not item.future.done():
            item.future.set_result(None)

    def _fail(self, error: BaseException, batch: list[_Item]) -> None:
        self.failure = error
        failure = ReplicaFailure(f"sampler {self.group!r} failed: {error!r}")
        failure.__cause__ = error
        for b in batch:
            if not b.future.done():
                b.future.set_exception(failure)
        self._fail_all(failure)

    def _fail_all(self, failure: ReplicaFailure) -> None:
        pending = [self._carry] if self._carry is not None else []
        self._carry = None
        while self._queue is not None and not self._queue.empty():
            pending.append(self._queue.get_nowait())
        for b in pending:
            if not b.future.done():
                b.future.set_exception(failure)


def _stamp(it: _Item, r: GenerationResult, now: float) -> GenerationResult:
    """Time in the sampler beyond the engine's work on the row: the inbox and the wait to be
    admitted while the batch was full (continuous batches have no batch start to measure from)."""
    engine = r.timings.get("prefill_s", 0.0) + r.timings.get("decode_s", 0.0)
    r.timings["queue_s"] = max(0.0, now - it.enqueued - engine)
    r.timings["sampler_batch"] = r.timings.get("joined", 1.0)
    return r
