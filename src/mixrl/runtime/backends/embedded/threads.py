"""Thread replicas and the trainer handle of the embedded backend.

``ThreadSampler`` keeps a replica's engine in the orchestrator's own process
(``runtime.sampler_workers = "thread"``): decoding runs in worker threads that
share the interpreter with the trainer, so it overlaps only where torch
releases the GIL. Tests that need an exactly reproducible schedule use it;
runs use worker processes (``process.ProcessSampler``).

``EmbeddedTrainer`` runs the trainer in this process (its update in a worker
thread, so the event loop keeps serving) and publishes each version once into
shared memory (``fleet.shared_weights``), which every replica maps.

Fault injection (both replica kinds): ``kill()`` makes a replica behave as a
crashed process (every call in flight or later raises ``ReplicaFailure``);
``corrupt(n)`` makes its next ``n`` results malformed (a NaN log-prob, or one
log-prob too few), as a faulty engine would.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import threading
from typing import Any

from mixrl.config import RunConfig
from mixrl.fleet.handles import SamplerHandle
from mixrl.records.generation import GenerationRequest, GenerationResult
from mixrl.records.trajectory import Trajectory
from mixrl.runtime.handles import TrainerHandle
from mixrl.sampling.base import ReplicaFailure
from mixrl.sampling.profiles import get_profile, with_overrides
from mixrl.system.memory import release_freed_memory
from mixrl.system.seeds import stable_seed
from mixrl.train.surface import TrainerSurface
from mixrl.weights.refs import WeightsRef
from mixrl.weights.shared import SharedVersion, map_manifest

# Loading an HF model swaps global module state (meta-device initialisation), so two
# loads in two threads at once can leave one model with meta tensors: one at a time.
LOAD_LOCK = threading.Lock()


def locked(fn: Any, *args: Any, **kw: Any) -> Any:
    with LOAD_LOCK:
        return fn(*args, **kw)


def group_profile(cfg: RunConfig, group: str) -> Any:
    """The group's precision profile with its config overrides applied."""

    g = next(x for x in cfg.fleet.groups if x.name == group)
    prof = get_profile(g.profile)
    return with_overrides(prof, **g.overrides) if g.overrides else prof


def replica_seed(run_seed: int, name: str) -> int:
    """A stable per-replica engine seed (``system.seeds.stable_seed``: never Python's salted hash)."""
    return stable_seed("replica", run_seed, name)


class ThreadSampler(SamplerHandle):
    def __init__(self, name: str, group: str, sampler: Any, fmt: str | None = None, quantize: Any = None):
        self.name, self.group = name, group
        self._sampler = sampler  # mixrl.sampling.batching.BatchingSampler
        self.fmt, self.quantize = fmt, quantize
        self.dead = False
        self._corrupt = 0

    def kill(self) -> None:
        self.dead = True

    def corrupt(self, n: int) -> None:
        self._corrupt += n

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self.dead:
            raise ReplicaFailure(f"replica {self.name} is dead")
        res = await self._sampler.generate(request)
        if self.dead:  # died while this request was being decoded: its output is lost
            raise ReplicaFailure(f"replica {self.name} died during the request")
        if self._corrupt > 0 and res.token_ids:
            self._corrupt -= 1
            res = corrupted(res, self._corrupt)
        return res

    async def alive(self) -> None:
        if self.dead:
            raise ReplicaFailure(f"replica {self.name} is dead")

    async def load_weights(self, ref: WeightsRef, version: int) -> None:
        if self.dead:
            raise ReplicaFailure(f"replica {self.name} is dead")
        if not isinstance(ref, SharedVersion):  # a plain state dict: quantized on load by the engine
            await self._sampler.load_weights(ref, version)
            return
        ref.acquire()
        try:
            man = ref.manifest() if self.fmt is None else await asyncio.to_thread(ref.for_format, self.fmt, self.quantize)
            await self._sampler.load_weights(map_manifest(man), version)
        finally:
            ref.release()

    async def close(self) -> None:
        # Bounded: on Python 3.11 a cancellation racing an ``asyncio.wait_for`` inside the
        # sampler's loop can be lost; the timeout cancels it a second time.
        with contextlib.suppress(TimeoutError, ReplicaFailure):
            await asyncio.wait_for(self._sampler.close(), timeout=2.0)


def corrupted(res: GenerationResult, k: int) -> GenerationResult:
    """A malformed copy: alternately a NaN log-prob and a missing log-prob."""
    lps = list(res.logprobs)
    if k % 2 == 0:
        lps[0] = math.nan
        return dataclasses.replace(res, logprobs=lps)
    bad = dataclasses.replace(res)  # bypass the constructor's check, as a remote record would
    object.__setattr__(bad, "logprobs", lps[:-1])
    return bad


class EmbeddedTrainer(TrainerHandle):
    """The trainer in the orchestrator's process: ``TrainerSurface`` on a thread, one call at a time;
    each published version written once into shared memory (later steps never change it)."""

    def __init__(self, trainer: Any, tokenizer: Any):
        self.surface = TrainerSurface(trainer, tokenizer)
        self.trainer = trainer  # mixrl.train.trainer.Trainer
        self._lock = asyncio.Lock()

    async def step(self, trajectories: list[Trajectory], advantages: list[float]) -> dict[str, float]:
        async with self._lock:
            return await asyncio.to_thread(self._step, trajectories, advantages)

    def _step(self, trajectories: list[Trajectory], advantages: list[float]) -> dict[str, float]:
        """One update, then the allocator's free pages back to the OS: an update's activations and
        gradients (GBs on a real model) are freed into glibc's heaps, which keep them otherwise."""
        out = self.surface.step(trajectories, advantages)
        release_freed_memory()
        return out

    async def version(self) -> int:
        return self.surface.version()

    async def weights(self) -> SharedVersion:
        # written from the trainer's own tensors (no copy first): the lock keeps updates out meanwhile
        async with self._lock:
            return await asyncio.to_thread(lambda: SharedVersion.from_state_dict(self.surface.weight_views()))

    def memory(self) -> dict[str, int] | None:
        """The trainer's tensor bytes by kind, measured (``Trainer.tensor_bytes``)."""
        return self.surface.tensor_bytes()

    async def state(self) -> dict[str, Any]:
        return self.surface.state_dict()

    async def load_state(self, state: dict[str, Any]) -> None:
        self.surface.load_state_dict(state)

    async def save_policy(self, out_dir: str) -> None:
        await asyncio.to_thread(self.surface.save_policy, out_dir)

    async def probe_logprobs(self, prompts: list[list[int]]) -> list[list[float]]:
        async with self._lock:
            return await asyncio.to_thread(self.surface.probe_logprobs, prompts)
