"""``ProcessSampler``: the parent's handle on one sampler worker process.

Calls become messages on the worker's pipe (see ``worker`` for the protocol);
one reader thread per worker receives the replies and resolves the asyncio
futures on the parent's loop. Sampling therefore runs in another interpreter
and overlaps the trainer for real (no shared GIL).

Failure is the worker process's death, observed as the pipe closing: every
call in flight and every later call raises ``ReplicaFailure``, and the fleet
continues the sessions elsewhere. ``kill()`` sends SIGKILL (fault injection);
``corrupt(n)`` makes the next ``n`` results malformed, as a faulty engine would.

Weights: ``load_weights`` takes a ``SharedVersion`` (or a plain state dict,
which it first writes to shared memory) and sends the worker only manifests;
the worker maps the files. For a pre-quantized format, the first replica of
that format to ask builds it (``SharedVersion.build_format_async``): its worker
quantizes the mapped base version with the group's profile, writes the
changed tensors into the format's file and loads them itself (one message: no
round trip between the quantization and its own load); every other replica of
the format waits for the file, then maps it. A format with no other live
replica (``QuantizeSlots.members``) gets no file: nobody would map it. One quantization per (version, format), each in
a worker process, so the formats of one version are built in parallel and never
hold the trainer's interpreter; the backend's ``QuantizeSlots`` bounds how many
run at once (one per core, the slowest format first).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import threading
from typing import Any

from mixrl.fleet.handles import SamplerHandle
from mixrl.records.generation import GenerationRequest, GenerationResult
from mixrl.runtime.backends.embedded import worker
from mixrl.runtime.backends.embedded.slots import QuantizeSlots
from mixrl.sampling.base import ReplicaFailure
from mixrl.system.quiet import install_filters
from mixrl.weights.refs import WeightsRef
from mixrl.weights.shared import SharedVersion

START_TIMEOUT_S = 600.0  # a loaded 2-core machine can take minutes to import torch and build an engine


def mp_context() -> Any:
    """forkserver where the platform has it (children fork from a clean server that has
    already imported torch: fast starts), else spawn; both need picklable arguments only."""
    import multiprocessing as mp

    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        install_filters()  # TORCH_LOGS before the server imports torch (the environment is inherited)
        ctx.set_forkserver_preload([  # the quieting first: torchao and torch logs for every import after it
            "mixrl.runtime.backends.embedded.preload", "torch", "transformers", "transformers.models.qwen3.modeling_qwen3", "mixrl.runtime.backends.embedded.worker",
            "mixrl.sampling.batching", "mixrl.sampling.factory", "mixrl.sampling.builtin.engine", "mixrl.numerics",
            "mixrl.runtime.backends.embedded.preloaded",  # last: the server's heap frozen before any fork
        ])
        return ctx
    return mp.get_context("spawn")


class ProcessSampler(SamplerHandle):
    def __init__(self, name: str, group: str, fmt: str | None = None, quant_profile: Any = None,
                 slots: QuantizeSlots | None = None):
        self.name, self.group = name, group
        # this replica's weight format (None: base weights) and the profile that quantizes into it
        self.fmt, self.quant_profile = fmt, quant_profile
        self.slots = slots  # shared by one backend's workers: how many quantize at once
        self.dead = False
        self.load_s: list[float] = []  # the worker's own load time per version
        self._corrupt = 0
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._send_lock = threading.Lock()
        self._outbox: list[tuple[str, int, Any]] = []  # calls of this loop iteration, sent at its end
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[Any] | None = None
        self.proc: Any = None
        self.conn: Any = None
        self.pid = -1
        # the worker's CPU seconds when it became ready (its start-up) and the last reading
        # (kept once the process is gone; see ``runtime.cpu``)
        self.cpu_ready: float | None = None
        self._cpu_last: float | None = None
        self._exited = False
        self._member = False  # counted in ``slots.members``

    # -- life cycle ------------------------------------------------------------------
    async def start(self, model_path: str, profile: Any, seed: int, threads: int, timeout: float = START_TIMEOUT_S,
                    batching: dict[str, Any] | None = None, cuda_visible: str | None = None,
                    engine_kw: dict[str, Any] | None = None) -> None:
        """Start the worker and wait until its engine is built. ``batching``: the worker's
        ``BatchingSampler`` keyword arguments (``max_batch``, ``max_wait_ms``, ``idle_ms``);
        ``cuda_visible``: its ``CUDA_VISIBLE_DEVICES`` (None: inherited); ``engine_kw``: more
        engine arguments (``gpu_memory_utilization``)."""

        ctx = mp_context()
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=worker.main,
                                args=(child, model_path, profile, self.group, seed, threads, self.quant_profile, batching,
                                      cuda_visible, engine_kw),
                                name=f"mixrl-sampler-{self.name}", daemon=True)
        await asyncio.to_thread(self.proc.start)
        child.close()
        threading.Thread(target=self._read, name=f"mixrl-reader-{self.name}", daemon=True).start()
        try:
            self.pid = await asyncio.wait_for(self._ready, timeout)
        except BaseException:
            await self.close()
            raise
        if self.slots is not None and self.fmt is not None and not self.dead:
            self.slots.join(self.fmt)  # a live replica of its format (left when it is lost)
            self._member = True

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except Exception:  # noqa: BLE001 - EOF, reset, or a reply that cannot be read: the worker is lost
                break
            if msg[0] == "many":  # the replies of one worker loop iteration: one wake-up here
                self._post(self._deliver_many, msg[2])
            else:
                self._post(self._deliver, *msg)
        self.cpu_s()  # its last reading: the process has exited (not yet reaped) or is exiting
        self._exited = True
        self._post(self._lost)

    def cpu_s(self) -> float | None:
        """The worker process's CPU seconds (user + system) so far: read while it runs,
        the last reading once it has exited (its pid may be reused)."""
        if self.pid > 0 and not self._exited:
            from mixrl.runtime.cpu import proc_cpu

            c = proc_cpu(self.pid)
            if c is not None:
                self._cpu_last = c
        return self._cpu_last

    def _post(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self._loop.call_soon_threadsafe(fn, *args)

    def _deliver_many(self, msgs: list[tuple[str, int, Any]]) -> None:
        for m in msgs:
            self._deliver(*m)

    def _deliver(self, kind: str, rid: int, payload: Any) -> None:
        if kind == "ready":
            if self._ready is not None and not self._ready.done():
                self.pid = int(payload)
                self.cpu_ready = self.cpu_s()
                self._ready.set_result(payload)
            return
        if kind == "fatal":
            if self._ready is not None and not self._ready.done():
                last = payload.strip().splitlines()[-1] if payload.strip() else "unknown error"
                self._ready.set_exception(RuntimeError(f"sampler worker {self.name} could not start: {last}\n{payload}"))
            return
        fut = self._pending.pop(rid, None)
        if fut is None or fut.done():
            return
        if kind == "ok":
            fut.set_result(payload)
        else:
            fut.set_exception(ReplicaFailure(f"replica {self.name}: {payload}"))

    def _lost(self) -> None:
        self.dead = True
        if self._member and self.slots is not None and self.fmt is not None:
            self._member = False
            self.slots.leave(self.fmt)
        err = ReplicaFailure(f"replica {self.name}: worker process {self.pid} exited")
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(f"sampler worker {self.name} exited during start-up"))
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()

    async def _call(self, kind: str, payload: Any) -> Any:
        if self.dead:
            raise ReplicaFailure(f"replica {self.name} is dead")
        assert self._loop is not None
        rid = next(self._ids)
        fut = self._loop.create_future()
        self._pending[rid] = fut
        # Calls made in one loop iteration (the turns of sessions answered together) travel
        # as one message: one write, one wake-up of the worker, one cohort there.
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append((kind, rid, payload))
        try:
            return await fut
        finally:
            self._pending.pop(rid, None)

    def _expect(self) -> tuple[int, asyncio.Future[Any]]:
        """(id, future) for a reply the worker sends without a message of its own (the load
        that follows a ``quant``); failed like any call if the worker dies first."""
        assert self._loop is not None
        rid = next(self._ids)
        fut = self._loop.create_future()
        self._pending[rid] = fut
        return rid, fut

    def _flush(self) -> None:
        msgs, self._outbox = self._outbox, []
        if not msgs:
            return
        try:
            with self._send_lock:
                self.conn.send(msgs[0] if len(msgs) == 1 else ("many", 0, msgs))
        except (OSError, ValueError) as e:  # broken pipe / closed connection
            self.dead = True
            err = ReplicaFailure(f"replica {self.name}: cannot reach worker ({e})")
            for _, rid, _ in msgs:
                fut = self._pending.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_exception(err)

    # -- SamplerHandle ---------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        res = await self._call("gen", request)
        if self.dead:  # killed while this request was being decoded: its output is lost
            raise ReplicaFailure(f"replica {self.name} died during the request")
        if self._corrupt > 0 and res.token_ids:
            from mixrl.runtime.backends.embedded.threads import corrupted

            self._corrupt -= 1
            res = corrupted(res, self._corrupt)
        return res

    async def alive(self) -> None:
        if self.dead:  # the reader saw the pipe close: the process is gone
            raise ReplicaFailure(f"replica {self.name}: worker process {self.pid} is gone")

    async def load_weights(self, ref: WeightsRef, version: int) -> None:
        if self.dead:
            raise ReplicaFailure(f"replica {self.name} is dead")
        own = not isinstance(ref, SharedVersion)
        sv = SharedVersion.from_state_dict(ref) if own else ref
        sv.acquire()  # before any await: the store may evict (retire) this version meanwhile
        loaded: asyncio.Future[Any] | None = None  # set when this worker quantizes: it then loads too
        try:
            man = sv.manifest()
            if self.fmt is not None:
                fmt = self.fmt

                async def produce(base: Any, path: Any) -> tuple[Any, float]:
                    nonlocal loaded
                    async with self.slots.slot(fmt) if self.slots is not None else contextlib.nullcontext():
                        # the file is for the format's other replicas: none, none written
                        shared = self.slots is None or self.slots.members.get(fmt, 0) > 1
                        load_rid, loaded = self._expect()
                        man, secs = await self._call("quant", (base, str(path) if shared else None, (load_rid, version)))
                    return man, secs

                man = (await sv.build_format_async(self.fmt, produce))[0]
            secs = await loaded if loaded is not None else await self._call("load", (man, version))
            loaded = None
            self.load_s.append(float(secs))
        except BaseException:
            if loaded is not None:  # the quantization failed (or this call was cancelled): its load with it
                if loaded.done() and not loaded.cancelled():
                    loaded.exception()  # retrieved, not logged
                else:
                    loaded.cancel()
            raise
        finally:
            sv.release()
            if own:
                sv.retire()

    def kill(self) -> None:
        """SIGKILL the worker process (a crash, for tests and demos)."""
        self.dead = True
        if self.proc is not None and self.proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)

    def corrupt(self, n: int) -> None:
        self._corrupt += n

    async def stats(self) -> dict[str, Any]:
        """The worker's counters: requests, prompt_tokens, gen_tokens, joined_direct (requests that
        joined a running batch from its pipe reader), prefills, steps, cpu_s."""
        return dict(await self._call("stats", None))

    async def close(self) -> None:
        proc, self.dead = self.proc, True
        if proc is None:
            return
        self.proc = None
        self._flush()
        with contextlib.suppress(OSError, ValueError), self._send_lock:
            self.conn.send(("stop", 0, None))
        await asyncio.to_thread(proc.join, 5.0)
        if proc.is_alive():
            proc.kill()
            await asyncio.to_thread(proc.join, 5.0)
        with contextlib.suppress(OSError):
            self.conn.close()
        self._lost()
