"""The sampler fleet: groups of replicas, weight sync, and a retrying ``generate``.

Lifecycle of one replica (see ``router`` for the states):

1. ``add_replica(group)`` asks the backend for a handle; the replica is
   ``catching_up`` and pulls the newest stored version (quantizing on load);
   only then is it ``ready`` and routed to.
2. On ``publish`` every live replica pulls the newest version in the
   background; a replica that is already loading loops until it has caught up
   (versions published meanwhile are skipped, never queued).
3. A replica that raises ``ReplicaFailure`` (in ``generate``, while loading,
   or when the fleet asks every ``health_s`` whether it lives, idle or not)
   is ``failed``: it gets no more traffic, the sessions on it continue on
   another replica, and, with ``restart_failed``, a fresh replica replaces it
   (it serves once caught up).
4. ``remove_replica`` drains: no new requests, in-flight ones finish, then it
   is closed.

``generate(session, request)`` is what a session's turns call. The request
carries the whole prefix, so a turn cut by a failure is simply asked again on
another replica (same group if one is alive, else another group): the session
continues from the tokens it has. A result is checked before it is used
(lengths, finite log-probs, token budget, candidate offsets); a malformed
result is rejected, counted in ``fleet/malformed_results`` and asked again.
When the retries are spent the error is raised, and the session records
``infra_failed`` (never a reward of 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mixrl.fleet.handles import SamplerHandle, Superseded
from mixrl.fleet.load_check import LoadCheck, StaleWeights
from mixrl.fleet.router import CATCHING_UP, DRAINING, FAILED, READY, NoReplicaAvailable, Router
from mixrl.records.generation import LOGPROB_TOL, GenerationRequest, GenerationResult
from mixrl.sampling.base import ReplicaFailure
from mixrl.weights.store import WeightStore

# per result (GenerationResult.timings), summed per group into sampler/<key>/<group>
KV_METRICS = ("prefill_tokens", "reused_tokens", "kv_evictions", "reused_stale_tokens")

RETRYABLE_FINISH = ("numerical_error", "error")
MakeReplica = Callable[[str, str], Awaitable[SamplerHandle]]  # (group, replica name) -> handle


@dataclass
class GroupSpec:
    name: str
    relative_throughput: float
    replicas: int
    min_replicas: int
    max_replicas: int


class SessionFailed(RuntimeError):
    """A session's request failed on every replica it was retried on."""


def check_result(res: GenerationResult, req: GenerationRequest) -> str:
    """Empty string if ``res`` is usable for ``req``, else what is wrong with it."""
    n = len(res.token_ids)
    if len(res.logprobs) != n:
        return f"{len(res.logprobs)} logprobs for {n} tokens"
    if len(res.cand_offsets) != n + 1 or (res.cand_offsets and res.cand_offsets[0] != 0):
        return f"cand_offsets of length {len(res.cand_offsets)} for {n} tokens"
    if len(res.cand_ids) != len(res.cand_logprobs) or (res.cand_offsets and res.cand_offsets[-1] != len(res.cand_ids)):
        return "candidate ids, log-probs and offsets disagree"
    if any(b < a for a, b in zip(res.cand_offsets, res.cand_offsets[1:], strict=False)):
        return "cand_offsets decrease"
    if res.finish_reason in RETRYABLE_FINISH or res.finish_reason == "context_exceeded":
        return ""  # an error status is judged by the caller, not a malformed record
    if n > req.params.max_new_tokens:
        return f"{n} tokens for max_new_tokens={req.params.max_new_tokens}"
    if not all(math.isfinite(x) and x <= LOGPROB_TOL for x in res.logprobs):  # the trajectory's tolerance
        return f"non-finite or positive (> {LOGPROB_TOL:g}) sampled-token log-probs"
    if any(not math.isfinite(x) for x in res.cand_logprobs):
        return "non-finite candidate log-probs"
    return ""


class Fleet:
    def __init__(
        self,
        groups: list[GroupSpec],
        make_replica: MakeReplica,
        store: WeightStore,
        *,
        seed: int = 0,
        max_retries: int = 8,
        restart_failed: bool = True,
        wait_for_replica_s: float = 120.0,
        health_s: float = 2.0,
        load_check: LoadCheck | None = None,
    ):
        self.specs = {g.name: g for g in groups}
        self.router = Router({g.name: g.relative_throughput for g in groups}, seed=seed)
        self.store = store
        self.handles: dict[str, SamplerHandle] = {}
        self.versions: dict[str, int] = {}  # replica -> version it serves
        self._make = make_replica
        self._next_index = dict.fromkeys(self.specs, 0)
        self.desired = {g.name: g.replicas for g in groups}  # replicas a group should have
        self._sync_tasks: dict[str, asyncio.Task[None]] = {}
        self._bg: set[asyncio.Task[Any]] = set()
        self.max_retries = max_retries
        self.restart_failed = restart_failed
        self.wait_for_replica_s = wait_for_replica_s
        self.health_s = health_s  # how often serving replicas are asked whether they live (0: never)
        self.load_check = load_check  # fleet.check_loads: every load proven (fleet.load_check)
        self.counts = {"replica_failures": 0, "malformed_results": 0, "retried_requests": 0, "sampler_errors": 0}
        self.kv_counts: dict[str, dict[str, float]] = {}  # group -> the engines' KV accounting, summed
        self._changed = asyncio.Event()  # set whenever a replica becomes ready
        self.closed = False

    # -- replicas -----------------------------------------------------------------
    async def start(self) -> None:
        """Create the initial replicas and wait until they serve the newest weights.

        A replica whose engine cannot start (a format the platform cannot run, a
        broken install) is a replica failure: counted, reported on stderr (the
        run log), and the fleet goes on with the others. Only a fleet where no
        replica starts at all is an error.
        """
        names, errors = [], []
        # Replicas start concurrently (worker processes build their engines in parallel);
        # names are assigned in group order before the first await, so they are stable.
        groups = [g.name for g in self.specs.values() for _ in range(g.replicas)]
        outcomes = await asyncio.gather(*(self._add(g) for g in groups), return_exceptions=True)
        for g, out in zip(groups, outcomes, strict=True):
            if isinstance(out, BaseException):
                if not isinstance(out, Exception):  # cancelled, interrupted: not a start-up error
                    raise out
                self.counts["replica_failures"] += 1
                errors.append(f"group {g!r}: {type(out).__name__}: {out}")
                print(f"sampler replica failed to start, continuing without it: {errors[-1]}",
                      file=sys.stderr, flush=True)
            else:
                names.append(out)
        self.start_errors = errors
        if not names:
            raise RuntimeError("no sampler replica could start:\n" + "\n".join(errors))
        await asyncio.gather(*(self._sync_tasks[n] for n in names if n in self._sync_tasks))
        if self.health_s > 0:
            self._spawn(self._watch())

    async def _watch(self) -> None:
        """Every ``health_s``, ask each serving replica whether it lives: one that died idle
        (its node removed, its process gone) fails over now, not at its next request. A slow
        answer is not a death: only a ``ReplicaFailure`` counts."""
        while not self.closed:
            await asyncio.sleep(self.health_s)
            names = [n for n, r in self.router.replicas.items() if r.state in (READY, CATCHING_UP) and n in self.handles]
            outs = await asyncio.gather(*(asyncio.wait_for(self.handles[n].alive(), 10 * self.health_s)
                                          for n in names), return_exceptions=True)
            for name, out in zip(names, outs, strict=True):
                if isinstance(out, ReplicaFailure):
                    self._mark_failed(name, out)

    async def add_replica(self, group: str, *, wait: bool = True) -> str:
        """Scale ``group`` up by one; with ``wait``, return once the replica serves."""
        spec = self.specs.get(group)
        if spec is None:
            raise ValueError(f"unknown sampler group {group!r}; known: {sorted(self.specs)}")
        if self.live(group) >= spec.max_replicas:
            raise ValueError(f"group {group!r} already has max_replicas={spec.max_replicas}")
        self.desired[group] = self.live(group) + 1
        name = await self._add(group)
        if wait:
            await self._sync_tasks[name]
        return name

    async def _add(self, group: str) -> str:
        name = f"{group}/{self._next_index[group]}"
        self._next_index[group] += 1
        self.router.add(name, group)
        self.versions[name] = -1
        try:
            self.handles[name] = await self._make(group, name)
        except Exception:
            self.router.forget(name)
            raise
        self._schedule_sync(name)
        return name

    async def remove_replica(self, name: str) -> None:
        """Drain and close one replica (its in-flight requests finish first)."""
        info = self.router.replicas[name]
        if self.live(info.group) <= self.specs[info.group].min_replicas and info.state in (READY, CATCHING_UP):
            raise ValueError(f"group {info.group!r} is at min_replicas={self.specs[info.group].min_replicas}")
        if info.state in (READY, CATCHING_UP):
            self.desired[info.group] = self.live(info.group) - 1
        info.state = DRAINING
        self.store.forget_replica(name)
        while info.inflight > 0:
            await asyncio.sleep(0.01)
        await self._close(name)

    def live(self, group: str) -> int:
        """Replicas of ``group`` that serve or will serve (ready or catching up)."""
        return sum(1 for r in self.router.replicas.values() if r.group == group and r.state in (READY, CATCHING_UP))

    def _mark_failed(self, name: str, err: BaseException) -> None:
        info = self.router.replicas.get(name)
        if info is None or info.state == FAILED:
            return
        info.state = FAILED
        self.counts["replica_failures"] += 1
        self.store.forget_replica(name)
        self._spawn(self._close(name))
        if self.restart_failed and not self.closed and self.live(info.group) < self.desired[info.group]:
            self._spawn(self._restart(info.group))

    async def _restart(self, group: str) -> None:
        try:
            await self._add(group)
        except Exception:  # a replacement that cannot start is one more failure, counted
            self.counts["replica_failures"] += 1

    async def _close(self, name: str) -> None:
        h = self.handles.pop(name, None)
        self.router.forget(name)
        t = self._sync_tasks.pop(name, None)
        if t is not None and t is not asyncio.current_task():
            t.cancel()
        if h is not None:
            with contextlib.suppress(Exception):  # closing a dead replica may fail; it is gone anyway
                await h.close()

    def _spawn(self, coro: Awaitable[Any]) -> None:
        t = asyncio.ensure_future(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    # -- weights --------------------------------------------------------------------
    def publish(self, version: int, state_dict: dict[str, Any]) -> None:
        """Store a new version; every live replica starts pulling it."""
        ready = [r.name for r in self.router.replicas.values() if r.state in (READY, CATCHING_UP)]
        self.store.publish(version, state_dict, ready)
        for name in ready:
            self._schedule_sync(name)

    def _schedule_sync(self, name: str) -> None:
        t = self._sync_tasks.get(name)
        if t is None or t.done():
            self._sync_tasks[name] = asyncio.ensure_future(self._catch_up(name))

    async def _catch_up(self, name: str) -> None:
        if name not in self.handles:  # still being created: it syncs once its handle exists
            return
        while name in self.handles and self.versions.get(name, -1) < self.store.latest:
            version, ref = self.store.get()
            try:
                await self.handles[name].load_weights(ref, version)
            except Superseded as e:
                if version < self.store.latest:
                    continue  # a newer version evicted it meanwhile: load that one
                self._mark_failed(name, ReplicaFailure(f"{name}: the newest weights version {version} is not held: {e}"))
                return
            except ReplicaFailure as e:
                self._mark_failed(name, e)
                return
            except Exception as e:  # any other load error: the replica cannot serve; never a silent stall
                logging.getLogger("mixrl").error(
                    "replica %s failed to load weights version %d:\n%s", name, version, traceback.format_exc())
                self._mark_failed(name, ReplicaFailure(f"{name}: loading weights version {version}: {e!r}"))
                return
            self.versions[name] = version
            self.store.served(version, name)
            if self.load_check is not None and name in self.router.replicas:
                try:
                    await self.load_check.after_load(name, self.router.replicas[name].group, self.handles[name], version)
                except StaleWeights as e:  # the run stops on it (the orchestrator reads load_check.failure)
                    self._mark_failed(name, ReplicaFailure(str(e)))
                    return
        info = self.router.replicas.get(name)
        if info is not None and info.state == CATCHING_UP and name in self.handles:
            info.state = READY
            self._changed.set()

    async def wait_synced(self, version: int) -> None:
        """Until every live replica serves ``version`` or newer (sync mode); ``StaleWeights`` when
        ``fleet.check_loads`` caught a replica serving other weights."""
        while True:
            if self.load_check is not None and self.load_check.failure is not None:
                raise self.load_check.failure
            behind = [
                n for n, r in self.router.replicas.items()
                if r.state in (READY, CATCHING_UP) and self.versions.get(n, -1) < version
            ]
            if not behind:
                return
            await asyncio.gather(*(self._sync_tasks[n] for n in behind if n in self._sync_tasks), return_exceptions=True)
            await asyncio.sleep(0)

    # -- requests --------------------------------------------------------------------
    async def _pick(self, session: str, exclude: set[str], min_version: int = -1):
        """A ready replica, waiting for one to come up (restart, scale-up) if none is.

        With ``min_version``, a picked replica that still serves an older version is
        waited for (it is loading the newest one) rather than skipped: skipping would
        move the session to another group and bias the groups' shares."""
        deadline = time.monotonic() + self.wait_for_replica_s
        while True:
            try:
                info = self.router.pick(session, exclude)
                if self.versions.get(info.name, -1) >= min_version:
                    return info
                if time.monotonic() > deadline or self.closed:
                    raise NoReplicaAvailable(f"no replica serves version >= {min_version} for session {session!r}")
                t = self._sync_tasks.get(info.name)
                if t is not None and not t.done():
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(asyncio.shield(t), timeout=0.5)
                else:
                    await asyncio.sleep(0.005)
                continue
            except NoReplicaAvailable:
                if exclude and self.router.ready():
                    exclude.clear()  # every ready replica was tried: allow them again
                    continue
                if time.monotonic() > deadline or self.closed:
                    raise
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=0.5)

    async def generate(self, session: str, request: GenerationRequest, min_version: int = -1) -> GenerationResult:
        """One turn of ``session``, retried across replicas (see the module docstring).

        ``min_version``: only a replica serving that weights version or a newer one
        generates it (staleness admission: the prompt's tokens must be trainable)."""
        if not request.session:  # the engine may keep the session's KV between its turns
            request = dataclasses.replace(request, session=session)
        tried: set[str] = set()
        last_error = ""
        last_result: GenerationResult | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.counts["retried_requests"] += 1
            info = await self._pick(session, tried, min_version)
            handle = self.handles.get(info.name)
            if handle is None:  # closed between pick and call
                tried.add(info.name)
                continue
            info.inflight += 1
            try:
                res = await handle.generate(request)
            except ReplicaFailure as e:
                self._mark_failed(info.name, e)
                last_error = f"replica {info.name} failed: {e}"
                continue
            finally:
                info.inflight -= 1
            problem = check_result(res, request)
            if problem:
                self.counts["malformed_results"] += 1
                tried.add(info.name)
                last_error = f"malformed result from {info.name}: {problem}"
                continue
            if res.finish_reason in RETRYABLE_FINISH:
                self.counts["sampler_errors"] += 1
                tried.add(info.name)
                last_error, last_result = f"{info.name}: {res.finish_reason} {res.error}", res
                continue
            info.served += 1
            kv = self.kv_counts.setdefault(res.group, dict.fromkeys(KV_METRICS, 0.0))
            for k in KV_METRICS:
                kv[k] += res.timings.get(k, 0.0)
            return res
        if last_result is not None:
            return last_result  # the session records it as infra_failed with the engine's reason
        raise SessionFailed(f"session {session}: {self.max_retries + 1} attempts failed; last: {last_error}")

    def end_session(self, session: str) -> None:
        self.router.release(session)

    # -- reporting -------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        out = {f"fleet/{k}": float(v) for k, v in self.counts.items()}
        for g, kv in self.kv_counts.items():  # totals since the start (built-in engine: prefix_cache)
            out.update({f"sampler/{k}/{g}": v for k, v in kv.items()})
        for g in self.specs:
            out[f"fleet/replicas/{g}"] = float(len(self.router.ready(g)))
            out[f"fleet/inflight/{g}"] = float(self.router.inflight(g))
        if self.store.latencies:
            v = max(self.store.latencies)
            out["fleet/publish_s"] = self.store.latencies[v]
        if self.load_check is not None:
            out.update(self.load_check.metrics())
        return out

    async def close(self) -> None:
        self.closed = True
        for t in list(self._bg):
            t.cancel()
        for name in list(self.handles):
            await self._close(name)
