"""Handles over the Ray actors (``actors``): what the orchestrator calls.

A dead actor raises ``RayActorError``, which the sampler handle turns into
``ReplicaFailure`` so the fleet's failover path takes over; a failed trainer
rank becomes ``RankFailure`` after every rank is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group

from mixrl.fleet.handles import SamplerHandle, Superseded
from mixrl.records.generation import GenerationRequest, GenerationResult
from mixrl.records.trajectory import Trajectory
from mixrl.runtime.handles import TrainerHandle
from mixrl.runtime.ranks import RankFailure
from mixrl.sampling.base import ReplicaFailure
from mixrl.weights.broadcast import Broadcast
from mixrl.weights.format_refs import FormatRefs
from mixrl.weights.refs import WeightsRef


class RayRanks(TrainerHandle):
    """``trainer.world_size`` rank actors; every command goes to all of them, rank 0 answers."""

    def __init__(self, actors: list[Any], pg: Any):
        self.actors, self.pg, self.actor = actors, pg, actors[0]
        self._lock = asyncio.Lock()

    async def _all(self, cmd: str, *args: Any) -> list[Any]:

        async with self._lock:  # collective: same order on every rank
            refs = [a.call.remote(cmd, *args) for a in self.actors]
            try:
                await asyncio.gather(*refs)
            except (RayActorError, RayTaskError) as e:
                for a in self.actors:
                    ray.kill(a, no_restart=True)
                raise RankFailure(f"a trainer rank failed during {cmd!r}: {e}") from e
            return refs

    async def step(self, trajectories: list[Trajectory], advantages: list[float]) -> dict[str, float]:
        return await (await self._all("step", trajectories, advantages))[0]

    async def version(self) -> int:
        return await (await self._all("version"))[0]

    async def weights(self) -> WeightsRef:
        return (await self._all("weights"))[0]  # rank 0's gathered state stays in the object store

    async def state(self) -> dict[str, Any]:
        return await (await self._all("state"))[0]

    async def load_state(self, state: dict[str, Any]) -> None:
        await self._all("load_state", state)

    async def save_policy(self, out_dir: str) -> None:
        await self._all("save_policy", out_dir)

    async def close(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)


def _replica_error(e: BaseException, name: str) -> BaseException:
    """Map Ray's errors onto the fleet's: a dead actor or a failed engine is a replica failure."""
    if isinstance(e, RayActorError):
        return ReplicaFailure(f"replica {name}: actor died ({type(e).__name__})")
    if isinstance(e, RayTaskError) and isinstance(getattr(e, "cause", None), ReplicaFailure):
        return ReplicaFailure(f"replica {name}: {e.cause}")
    return e


class RaySampler(SamplerHandle):
    def __init__(self, name: str, group: str, actor: Any, pg: Any = None, fmt: str | None = None,
                 formats: FormatRefs | None = None, trainer: Any = None, device: str = "cpu"):
        self.name, self.group, self.actor, self.pg = name, group, actor, pg
        self.fmt, self.formats = fmt, formats if formats is not None else FormatRefs()
        self.trainer, self.device = trainer, device  # broadcast transport: the trainer actor
        self._joined = False

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        try:
            return await self.actor.generate.remote(request)
        except (RayActorError, RayTaskError) as e:
            raise _replica_error(e, self.name) from e

    async def alive(self) -> None:
        try:
            await self.actor.pid.remote()
        except RayActorError as e:  # died, or its node is unreachable (ActorUnavailableError)
            raise _replica_error(e, self.name) from e

    async def load_weights(self, ref: WeightsRef, version: int) -> None:
        if isinstance(ref, Broadcast):
            await self._receive(ref.version)
            return
        try:
            if self.fmt is None:
                await self.actor.load_weights.remote(ref, version)  # Ray resolves ref in the actor
                return
            q, mine = self.formats.claim(version, self.fmt, lambda: self.actor.quantize.remote(ref))
            try:
                await self.actor.load_weights.remote(ref, version, q)
            except RayTaskError:
                if mine:
                    raise
                # the replica that quantized died or failed: build this version's format here
                self.formats.drop(version, self.fmt, q)
                q, _ = self.formats.claim(version, self.fmt, lambda: self.actor.quantize.remote(ref))
                await self.actor.load_weights.remote(ref, version, q)
        except (RayActorError, RayTaskError) as e:
            if self.fmt is not None:
                self.formats.drop(version, self.fmt, self.formats.refs.get((version, self.fmt)))
            raise _replica_error(e, self.name) from e

    async def _receive(self, version: int) -> None:
        """Broadcast transport: the trainer actor sends ``version`` over this replica's channel."""
        try:
            if not self._joined:
                host, port = await self.trainer.channel_open.remote(self.name, self.device)
                await self.actor.channel_join.remote(host, port, self.device)
                self._joined = True
            sent = self.trainer.send_weights.remote(self.name, version)
            loaded, _ = await asyncio.gather(self.actor.recv_weights.remote(version), sent)
        except (RayActorError, RayTaskError) as e:
            raise _replica_error(e, self.name) from e
        if not loaded:
            raise Superseded(f"the trainer no longer holds weights version {version}")

    async def close(self) -> None:
        if self._joined:
            with contextlib.suppress(Exception):  # the trainer may be gone already
                await self.trainer.channel_close.remote(self.name)
        ray.kill(self.actor, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)


class RayTrainer(TrainerHandle):
    def __init__(self, actor: Any, pg: Any = None, broadcast: bool = False):
        self.actor, self.pg, self.broadcast = actor, pg, broadcast

    async def step(self, trajectories: list[Trajectory], advantages: list[float]) -> dict[str, float]:
        return await self.actor.step.remote(trajectories, advantages)

    async def version(self) -> int:
        return await self.actor.version.remote()

    async def weights(self) -> WeightsRef:
        if self.broadcast:
            return Broadcast(await self.actor.publish.remote())
        # The reference itself is what the weight store holds: the data stays in the object
        # store (actor calls run in order, so this is the state after the last step).
        return self.actor.weights.remote()

    async def state(self) -> dict[str, Any]:
        return await self.actor.state.remote()

    async def load_state(self, state: dict[str, Any]) -> None:
        await self.actor.load_state.remote(state)

    async def save_policy(self, out_dir: str) -> None:
        await self.actor.save_policy.remote(out_dir)

    async def probe_logprobs(self, prompts: list[list[int]]) -> list[list[float]]:
        return await self.actor.probe_logprobs.remote(prompts)

    async def close(self) -> None:
        ray.kill(self.actor, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)
