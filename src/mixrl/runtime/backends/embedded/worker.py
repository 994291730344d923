"""The sampler worker process: one replica's engine in its own interpreter.

Started by ``ProcessSampler`` with a spawn-safe multiprocessing context (the
entry point is this module's ``main``; nothing is inherited from the parent but
its arguments). It lowers its own scheduling priority (``SAMPLER_NICE`` above the parent's, so
on an oversubscribed machine the orchestrator's event loop and trainer, the
critical path, are not preempted by samplers), sets its torch threads, builds the engine through
``sampling.factory.make_engine``, wraps it in a ``BatchingSampler`` (so batching
and the weights-between-batches rule are the same as in-process; ``batching``
holds its keyword arguments, the defaults where absent) and serves
messages from one duplex pipe:

    parent -> worker                          worker -> parent
    ("gen",  id, GenerationRequest)           ("ok",  id, GenerationResult)
    ("load", id, (manifest, version))         ("ok",  id, seconds the load took)
    ("quant", id, (base manifest, path))      ("ok",  id, (manifest of path, seconds))
    ("quant", id, (base, path, (id2, version)))   the same, then ("ok", id2, seconds the load took);
                                              path None: nothing written (manifest None)
    ("stats", id, None)                       ("ok",  id, {requests, prompt_tokens, gen_tokens,
                                                           joined_direct, prefills, steps, cpu_s, memory})
    ("stop", 0, None)                         ("err", id, "ExcType: message")
                                              ("ready", 0, pid) / ("fatal", 0, traceback)
    ("many", 0, [message, ...])               ("many", 0, [message, ...])

``many`` carries the messages of one loop iteration of the sender (the turns of the
sessions answered together, the rows one decode step finished): one write and one
wake-up instead of one per message.

A reader thread receives (it blocks in the pipe without the GIL) and hands each
message to the worker's asyncio loop; results go back from the loop. Weights
arrive as a shared-memory manifest (``fleet.shared_weights``): mapped, not
copied. ``quant`` makes this worker the one that quantizes a version into its
group's format (``quant_profile``): it writes the changed tensors into ``path``,
which every other replica of the format then maps. With ``(id2, version)`` it
then loads that version itself, from the tensors it just quantized (no second
message, no mapping of the file it wrote), replying to ``id2`` as a ``load``;
its manifest leaves first, so the format's other replicas load meanwhile. The worker exits when told to stop or when the pipe closes (the parent
died); an engine failure is reported per call as ``err`` and the parent turns
it into ``ReplicaFailure``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from mixrl.system.heap import settle_heap
from mixrl.system.quiet import silence_libraries
from mixrl.weights.accounting import process_pss, tensor_bytes
from mixrl.weights.shared import map_manifest, write_tensors

SAMPLER_NICE = 5  # niceness above the parent's (a weight about 3x lower for the kernel's scheduler)


def main(conn: Any, model_path: str, profile: Any, group: str, seed: int, threads: int, quant_profile: Any = None,
         batching: dict[str, Any] | None = None, cuda_visible: str | None = None,
         engine_kw: dict[str, Any] | None = None) -> None:
    silence_libraries()
    name_process()
    if cuda_visible is not None:  # before anything initialises CUDA: this worker sees its GPU only
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible
    # Ctrl-C reaches the whole process group: the orchestrator handles it (checkpoint, then
    # it stops its workers); a worker dying first would turn the stop into replica failures.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The orchestrator process (event loop, trainer) is the critical path: a sampler works ahead
    # and takes the cycles it leaves, instead of preempting the event loop on every message.
    with contextlib.suppress(OSError, AttributeError):  # no os.nice (Windows): default priority
        os.nice(SAMPLER_NICE)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    torch.set_num_threads(threads)
    try:
        from mixrl.sampling.batching import BatchingSampler
        from mixrl.sampling.factory import make_engine

        batching = batching or {}
        rows = {"max_batch": batching["max_batch"]} if "max_batch" in batching else {}
        # the built-in engine: no checkpoint weights built that the first load would replace at once
        lazy = {"lazy_weights": True} if getattr(profile, "engine", None) == "builtin" else {}
        engine = make_engine(model_path, profile, group, seed=seed, **rows, **lazy, **(engine_kw or {}))
        if hasattr(engine, "free_before_load"):  # the batcher loads between batches: one copy at a time
            engine.free_before_load = True
        sampler = BatchingSampler(engine, **batching)
    except BaseException:  # noqa: BLE001 - reported to the parent, which counts a failed start
        conn.send(("fatal", 0, traceback.format_exc()))
        conn.close()
        return

    settle_heap()  # full collections no longer walk torch's and the engine's start-up heap
    conn.send(("ready", 0, os.getpid()))
    asyncio.run(serve(conn, sampler, quant_profile))


def name_process() -> None:
    """``comm`` = ``s:<replica>`` (``mixrl-sampler-<replica>`` is the multiprocessing name), so a
    memory or CPU breakdown read from /proc names the replica; at most 15 bytes, the kernel's limit."""
    import multiprocessing as mp

    name = "s:" + mp.current_process().name.removeprefix("mixrl-sampler-")
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(name[:15])


class WorkerServer:
    """Serves one pipe with one ``BatchingSampler`` (the message table is in the module docstring).

    Generation requests join the running batch straight from the reader thread and their
    results leave from the engine's thread (``join_threadsafe``): while a batch decodes,
    the event loop sleeps, instead of waking for every message and every finished row
    and trading the interpreter lock with the engine at each torch call. Anything else,
    and requests no batch admits, go through the loop. A request sent after a load waits
    behind it (through the loop) until that load has finished.

    Threads: ``read_pipe`` runs in the reader thread (with ``join_direct``), ``send_results``
    in the engine's thread, every other method on the event loop. Each counter is written
    by one thread only.
    """

    def __init__(self, conn: Any, sampler: Any, quant_profile: Any = None) -> None:
        self.conn, self.sampler, self.quant_profile = conn, sampler, quant_profile
        self.loop = asyncio.get_running_loop()
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.send_lock = threading.Lock()
        self.outbox: list[Any] = []  # replies of this loop iteration, sent together by ``flush``
        self.loads_sent = 0  # the reader thread's
        self.loads_done = 0  # the loop's
        self.direct = {"requests": 0, "prompt_tokens": 0}  # the reader's direct joins
        self.stats = {"requests": 0, "prompt_tokens": 0}  # the loop's requests
        self.sunk = {"gen_tokens": 0}  # the engine thread's results
        self.quantize: Any = None  # this format's per-tensor quantizer, made on first use

    async def serve(self) -> None:
        """Handle messages until ``stop`` (or the parent is gone), then close the sampler and the pipe."""
        threading.Thread(target=self.read_pipe, name="mixrl-worker-reader", daemon=True).start()
        tasks: set[asyncio.Task[None]] = set()
        while True:
            kind, rid, payload = await self.inbox.get()
            if kind == "stop":
                break
            t = asyncio.ensure_future(self.handle(kind, rid, payload))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        for t in tasks:
            t.cancel()
        await self.sampler.close()
        self.flush()
        self.conn.close()

    # ------------------------------------------------------------ reader thread
    def read_pipe(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the parent is gone
                msg = ("stop", 0, None)
            if msg[0] == "many":  # the calls of one parent loop iteration: handed over together
                rest = [m for m in msg[2] if not self.join_direct(m)]
                if rest:
                    self.loop.call_soon_threadsafe(self.enqueue, rest)
                continue
            if self.join_direct(msg):
                continue
            self.loop.call_soon_threadsafe(self.inbox.put_nowait, msg)
            if msg[0] == "stop":
                return

    def join_direct(self, msg: Any) -> bool:
        """True when ``msg`` is a request that joined the running batch from this thread."""
        kind, rid, payload = msg
        if kind == "load" or (kind == "quant" and len(payload) > 2 and payload[2] is not None):
            self.loads_sent += 1
        if (kind != "gen" or self.loads_sent != self.loads_done
                or not self.sampler.join_threadsafe(payload, rid, self.send_results)):
            return False
        self.direct["requests"] += 1
        self.direct["prompt_tokens"] += len(payload.prompt_ids)
        return True

    # ------------------------------------------------------------ engine thread
    def send_results(self, items: list[tuple[int, Any]]) -> None:
        msgs = []
        for rid, r in items:
            if isinstance(r, BaseException):
                msgs.append(("err", rid, f"{type(r).__name__}: {r}"))
            else:
                self.sunk["gen_tokens"] += len(r.token_ids)
                msgs.append(("ok", rid, r))
        self._send(msgs)

    # ------------------------------------------------------------ event loop
    def enqueue(self, msgs: list[Any]) -> None:
        for m in msgs:
            self.inbox.put_nowait(m)

    def reply(self, msg: Any) -> None:
        """Queue a reply; the replies of one loop iteration (the rows a decode step finished)
        go as one message."""
        if not self.outbox:
            self.loop.call_soon(self.flush)
        self.outbox.append(msg)

    def flush(self) -> None:
        msgs = self.outbox[:]
        self.outbox.clear()
        if msgs:
            self._send(msgs)

    def _send(self, msgs: list[Any]) -> None:
        with self.send_lock, contextlib.suppress(BrokenPipeError, OSError):  # parent gone: nobody to tell
            self.conn.send(msgs[0] if len(msgs) == 1 else ("many", 0, msgs))

    async def handle(self, kind: str, rid: int, payload: Any) -> None:
        try:
            if kind == "gen":  # the result leaves through send_results, from the engine's thread
                self.stats["requests"] += 1
                self.stats["prompt_tokens"] += len(payload.prompt_ids)
                self.sampler.generate_to(payload, rid, self.send_results)
            elif kind == "stats":
                self.reply(("ok", rid, self.counters()))
            elif kind == "load":
                await self.load(rid, *payload)
            elif kind == "quant":
                await self.quantize_then_load(rid, *payload)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to its caller
            self.reply(("err", rid, f"{type(e).__name__}: {e}"))

    def counters(self) -> dict[str, Any]:
        s = self.sampler
        counts = {k: v + self.direct[k] for k, v in self.stats.items()}
        return {**counts, **self.sunk, "joined_direct": self.direct["requests"], "prefills": s.batches,
                "steps": s.steps, "cpu_s": time.process_time(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "memory": self.memory()}

    def memory(self) -> dict[str, Any]:
        """This process's PSS and its parts (``smaps_rollup``) and the engine's tensor bytes, measured."""
        engine = getattr(self.sampler, "engine", None)
        own: dict[str, int] = {}
        if hasattr(engine, "built_weights"):  # the built-in engine: its served weights, its idle KV storage
            w = tensor_bytes(engine.built_weights())
            own = {"weights_owned": w["owned"], "weights_mapped": w["mapped"], "kv_pool": engine.idle_kv_bytes(),
                   "free_before_load": engine.free_before_load}
        return {"pid": os.getpid(), "pss": process_pss(), **own}

    async def load(self, rid: int, manifest: Any, version: int) -> None:

        t0 = time.perf_counter()
        try:
            await self.sampler.load_weights(map_manifest(manifest), version)
        finally:
            self.loads_done += 1
        self.reply(("ok", rid, time.perf_counter() - t0))

    async def quantize_then_load(self, rid: int, base: Any, path: str | None,
                                 then: tuple[int, int] | None = None) -> None:
        if path is None and then is not None:
            await self.quantize_while_loading(rid, base, then)
            return
        try:
            t0 = time.perf_counter()
            tensors = map_manifest(base)
            # generation goes on meanwhile
            man, changed = await asyncio.to_thread(self.quantize_tensors, tensors, path)
        except BaseException as e:
            if then is not None:  # the load it was to be followed by fails with it
                self.loads_done += 1
                self.reply(("err", then[0], f"{type(e).__name__}: {e}"))
            raise
        self.reply(("ok", rid, (man, time.perf_counter() - t0)))
        if then is None:
            return
        self.flush()  # the manifest leaves now: the format's other replicas map it while this one loads
        load_rid, version = then
        # the load reads the file just written (mapped, shared with the format's other replicas),
        # not the quantized tensors: no private copy of them is kept beside the new weights
        tensors.update(map_manifest(man) if man else changed)
        del changed
        t1 = time.perf_counter()
        try:
            await self.sampler.load_weights(tensors, version)
        except BaseException as e:  # noqa: BLE001 - the quantization succeeded: only the load fails
            self.reply(("err", load_rid, f"{type(e).__name__}: {e}"))
            return
        finally:
            self.loads_done += 1
        self.reply(("ok", load_rid, time.perf_counter() - t1))

    async def quantize_while_loading(self, rid: int, base: Any, then: tuple[int, int]) -> None:
        """No other replica reads this format (no file): each weight is quantized as the load
        reads it (``formats.Quantized``), so no quantized copy of the model is held beside the
        new weights; the same values. Replies as ``quantize_then_load``: the quantization's
        seconds, then the load's own (the rest of its time)."""
        from mixrl.weights.formats import Quantized

        load_rid, version = then
        t0 = time.perf_counter()
        try:
            view = Quantized(map_manifest(base), self.quantizer())
            await self.sampler.load_weights(view, version)
        except BaseException as e:  # noqa: BLE001 - both calls fail with it
            for r in (rid, load_rid):
                self.reply(("err", r, f"{type(e).__name__}: {e}"))
            return
        finally:
            self.loads_done += 1
        self.reply(("ok", rid, (None, view.seconds)))
        self.reply(("ok", load_rid, time.perf_counter() - t0 - view.seconds))

    def quantizer(self) -> Any:
        """This format's per-tensor quantizer, made on first use."""
        if self.quantize is None:
            if self.quant_profile is None:
                raise RuntimeError("this worker was started without a weight format to quantize into")
            from mixrl.weights.formats import quantizer

            self.quantize = quantizer(self.quant_profile)
        return self.quantize

    def quantize_tensors(self, tensors: dict[str, Any], path: str | None) -> tuple[Any, dict[str, Any]]:
        """This format's quantization of one version: (the manifest of the file it wrote,
        or None when ``path`` is None: nothing written; the tensors it changed)."""

        quantize = self.quantizer()
        changed = {}
        for k, t in tensors.items():
            q = quantize(k, t)
            if q is not None:
                changed[k] = q
        if path is None:  # no other replica of this format to read it
            return None, changed
        return (write_tensors(changed, Path(path)) if changed else {}), changed


async def serve(conn: Any, sampler: Any, quant_profile: Any = None) -> None:
    """Serve ``conn`` until told to stop (the server needs the running loop)."""
    await WorkerServer(conn, sampler, quant_profile).serve()
