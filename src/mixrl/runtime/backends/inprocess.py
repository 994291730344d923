"""In-process backend: every replica and the trainer live in this process.

Sampler replicas are ``BatchingSampler``s over real engines (each replica its
own engine and its own quantized copy of the weights); the trainer's update runs
in a worker thread so the event loop keeps the samplers decoding meanwhile
(torch releases the GIL inside its kernels).

Fault injection (tests, demos): ``kill(name)`` makes a replica behave as a
crashed process (every call in flight or later raises ``ReplicaFailure``);
``corrupt(name, n)`` makes its next ``n`` results malformed (a NaN log-prob, or
one log-prob too few), as a faulty engine would.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import threading
from typing import Any

from mixrl.config.run import RunConfig
from mixrl.fleet.handles import SamplerHandle
from mixrl.rollout.types import Trajectory
from mixrl.runtime.handles import Backend, TrainerHandle
from mixrl.sampling.base import GenerationRequest, GenerationResult, ReplicaFailure

# Loading an HF model swaps global module state (meta-device initialisation), so two
# loads in two threads at once can leave one model with meta tensors: one at a time.
_LOAD_LOCK = threading.Lock()


def _locked(fn: Any, *args: Any, **kw: Any) -> Any:
    with _LOAD_LOCK:
        return fn(*args, **kw)


def group_profile(cfg: RunConfig, group: str) -> Any:
    """The group's precision profile with its config overrides applied."""
    from mixrl.sampling.profiles import get_profile, with_overrides

    g = next(x for x in cfg.fleet.groups if x.name == group)
    prof = get_profile(g.profile)
    return with_overrides(prof, **g.overrides) if g.overrides else prof


def replica_seed(run_seed: int, name: str) -> int:
    """A stable per-replica engine seed (independent of Python's hash salt)."""
    h = 1469598103934665603
    for ch in f"{run_seed}/{name}":
        h = ((h ^ ord(ch)) * 1099511628211) & ((1 << 63) - 1)
    return h


class InProcessSampler(SamplerHandle):
    def __init__(self, name: str, group: str, sampler: Any):
        self.name, self.group = name, group
        self._sampler = sampler  # mixrl.sampling.batching.BatchingSampler
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
            res = _corrupted(res, self._corrupt)
        return res

    async def load_weights(self, ref: Any, version: int) -> None:
        if self.dead:
            raise ReplicaFailure(f"replica {self.name} is dead")
        await self._sampler.load_weights(ref, version)

    async def close(self) -> None:
        # Bounded: on Python 3.11 a cancellation racing an ``asyncio.wait_for`` inside the
        # sampler's loop can be lost; the timeout cancels it a second time.
        with contextlib.suppress(TimeoutError, ReplicaFailure):
            await asyncio.wait_for(self._sampler.close(), timeout=2.0)


def _corrupted(res: GenerationResult, k: int) -> GenerationResult:
    """A malformed copy: alternately a NaN log-prob and a missing log-prob."""
    lps = list(res.logprobs)
    if k % 2 == 0:
        lps[0] = math.nan
        return dataclasses.replace(res, logprobs=lps)
    bad = dataclasses.replace(res)  # bypass the constructor's check, as a remote record would
    object.__setattr__(bad, "logprobs", lps[:-1])
    return bad


class InProcessTrainer(TrainerHandle):
    def __init__(self, trainer: Any, tokenizer: Any):
        self.trainer = trainer  # mixrl.train.trainer.Trainer
        self.tokenizer = tokenizer
        self._lock = asyncio.Lock()

    async def step(self, trajectories: list[Trajectory], advantages: list[float]) -> dict[str, float]:
        async with self._lock:
            return await asyncio.to_thread(self.trainer.step, trajectories, advantages)

    async def version(self) -> int:
        return int(self.trainer.version)

    async def weights(self) -> Any:
        # The trainer hands out detached CPU copies: later steps never change a published version.
        return self.trainer.state_dict_for_samplers()

    async def state(self) -> dict[str, Any]:
        from mixrl.runtime.trainer_state import trainer_state

        return trainer_state(self.trainer)

    async def load_state(self, state: dict[str, Any]) -> None:
        from mixrl.runtime.trainer_state import load_trainer_state

        load_trainer_state(self.trainer, state)

    async def save_policy(self, out_dir: str) -> None:
        from mixrl.runtime.trainer_state import save_policy

        await asyncio.to_thread(save_policy, self.trainer, self.tokenizer, out_dir)


class InProcessBackend(Backend):
    name = "inprocess"

    def __init__(self, cfg: RunConfig, model_path: str, loss_cfg: Any):
        self.cfg, self.model_path, self.loss_cfg = cfg, model_path, loss_cfg
        self.samplers: dict[str, InProcessSampler] = {}

    async def make_trainer(self) -> TrainerHandle:
        from mixrl.runtime.trainer_state import build_trainer

        trainer, tok = await asyncio.to_thread(_locked, build_trainer, self.cfg, self.model_path, self.loss_cfg)
        return InProcessTrainer(trainer, tok)

    async def make_sampler(self, group: str, name: str) -> SamplerHandle:
        from mixrl.sampling.batching import BatchingSampler
        from mixrl.sampling.factory import make_engine

        prof = group_profile(self.cfg, group)
        seed = replica_seed(self.cfg.runtime.seed, name)
        engine = await asyncio.to_thread(_locked, make_engine, self.model_path, prof, group, seed=seed)
        h = InProcessSampler(name, group, BatchingSampler(engine))
        self.samplers[name] = h
        return h

    def kill(self, name: str) -> None:
        self.samplers[name].kill()

    def corrupt(self, name: str, n: int) -> None:
        self.samplers[name].corrupt(n)
