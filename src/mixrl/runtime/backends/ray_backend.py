"""Ray backend: sampler replicas and the trainer as Ray actors.

This module (with ``ray_auth``) is the only one that imports Ray. The orchestrator is the same as
in-process; only the handles differ:

- a sampler replica is an async actor holding an engine behind a ``BatchingSampler``;
- the trainer is an actor; ``weights()`` returns an object reference to the state dict
  *in the object store*: written once per version, read there by every replica (the
  driver never copies the weights);
- quantization once per (version, format) (``FormatRefs``): for a format the built-in
  engine can take pre-quantized (``embedded.formats.format_key``), the first replica of
  the format to load a version quantizes it in its actor (``quantize``, the group's own
  weight hook) into one more object; every replica of the format loads base + that
  object with its engine's weight format off (bit-identical to quantizing on load);
- or, with ``runtime.ray.weight_transport = "broadcast"``, no object store: the trainer
  actor sends each replica the version it asks for over that replica's own two-rank
  process group (``fleet.broadcast``: NCCL between GPUs, gloo otherwise); replicas quantize on load;
- a dead actor raises ``RayActorError``, which the handle turns into ``ReplicaFailure``
  so the fleet's failover path takes over.

Placement: every sampler replica and trainer rank reserves real Ray resources
(``num_cpus``, ``num_gpus``, ``memory`` from its fleet group or ``[trainer]``)
in a placement group; a group that names an ``accelerator_type`` also asks for
Ray's ``accelerator_type:<name>`` resource, which only nodes of that hardware
have (Ray sets it on GPU nodes; others declare it with ``ray start --resources``).
So each group lands on its hardware, and a replica whose node is removed fails
over like any dead replica (the fleet's health watch pings idle ones). A new
local cluster declares as many logical CPUs as the fleet needs at its largest.

Authentication: every cluster runs with Ray's token authentication (``ray_auth``;
mixrl never opts out). ``start`` joins ``runtime.ray.address`` or ``$RAY_ADDRESS``,
its token checked first; else it starts a local cluster: token auth on, no
dashboard, a private temporary directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import threading
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mixrl.config.run import ConfigError, RunConfig
from mixrl.fleet.broadcast import Broadcast
from mixrl.fleet.handles import SamplerHandle, Superseded
from mixrl.rollout.types import Trajectory
from mixrl.runtime.backends.format_refs import FormatRefs
from mixrl.runtime.backends.placement import bundle, cpus_needed
from mixrl.runtime.backends.ray_auth import RayAuthError, _require_token_mode, check_cluster_token  # noqa: F401
from mixrl.runtime.handles import Backend, TrainerHandle
from mixrl.sampling.base import GenerationRequest, GenerationResult, ReplicaFailure

# Actors take their resources from their placement-group bundle (``_placed``).
_ACTOR_OPTS: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
PLACEMENT_TIMEOUT_S = 60.0  # a bundle no node can hold fails its replica instead of waiting forever


def _actor_options(pg: Any, index: int, b: dict[str, float]) -> dict[str, Any]:
    """Options that put an actor into bundle ``index`` of ``pg``, asking for the bundle's resources."""
    if pg is None:
        return {}
    custom = {k: v for k, v in b.items() if k not in ("CPU", "GPU", "memory")}
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
            "num_cpus": b.get("CPU", 0), "num_gpus": b.get("GPU", 0), "memory": b.get("memory") or None,
            "resources": custom or None}


async def _placed(bundles: list[dict[str, float]], strategy: str, what: str) -> Any:
    """A ready placement group for ``bundles`` (None when nothing is reserved)."""
    if not any(bundles):
        return None
    pg = placement_group(bundles, strategy=strategy, name=what)
    try:
        await asyncio.wait_for(pg.ready(), PLACEMENT_TIMEOUT_S)
    except TimeoutError:
        remove_placement_group(pg)
        raise ReplicaFailure(f"{what}: no node of the cluster can hold {bundles[0]} "
                             f"(waited {PLACEMENT_TIMEOUT_S:g} s)") from None
    return pg


@ray.remote(**_ACTOR_OPTS)
class SamplerActor:
    def __init__(self, model_path: str, profile: Any, group: str, seed: int, threads: int,
                 quant_profile: Any = None) -> None:
        import torch

        from mixrl.sampling.batching import BatchingSampler
        from mixrl.sampling.factory import make_engine

        torch.set_num_threads(threads)
        self.sampler = BatchingSampler(make_engine(model_path, profile, group, seed=seed))
        self.quant_profile = quant_profile  # this group's format, if pre-quantized
        self._quantize: Any = None

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self.sampler.generate(request)

    async def quantize(self, state_dict: Any) -> dict[str, Any]:
        """The tensors this group's format changes in one version (the version's one
        quantization into the format; its result goes to the object store for every
        replica of the format)."""
        if self._quantize is None:
            from mixrl.runtime.backends.embedded.formats import quantizer

            self._quantize = quantizer(self.quant_profile)
        q = self._quantize

        def run() -> dict[str, Any]:
            return {k: t for k, t in ((k, q(k, v)) for k, v in state_dict.items()) if t is not None}

        return await asyncio.to_thread(run)  # generation goes on meanwhile

    async def load_weights(self, state_dict: Any, version: int, quantized: Any = None) -> None:
        await self.sampler.load_weights({**state_dict, **quantized} if quantized else state_dict, version)

    async def channel_join(self, host: str, port: int, device: str) -> None:
        """Rank 1 of this replica's weights channel to the trainer (broadcast transport)."""
        from mixrl.fleet.broadcast import join

        self.channel = await asyncio.to_thread(join, host, port, device)

    async def recv_weights(self, version: int) -> bool:
        """One version over the channel (the trainer sends it meanwhile), loaded; False if
        the trainer no longer held it."""
        sd = await asyncio.to_thread(self.channel.recv)
        if sd is not None:
            await self.sampler.load_weights(sd, version)
        return sd is not None

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


@ray.remote(concurrency_groups={"weights": 8}, **_ACTOR_OPTS)  # type: ignore[call-overload]
class TrainerActor:
    def __init__(self, cfg: dict[str, Any], model_path: str, loss_cfg: Any) -> None:
        from mixrl.runtime.trainer_state import build_trainer

        self.trainer, self.tokenizer = build_trainer(RunConfig.model_validate(cfg), model_path, loss_cfg)
        self.sender: Any = None
        self._sender_lock = threading.Lock()

    def step(self, trajectories: list[Trajectory], advantages: list[float]) -> dict[str, float]:
        return self.trainer.step(trajectories, advantages)

    def version(self) -> int:
        return int(self.trainer.version)

    def weights(self) -> dict[str, Any]:
        return self.trainer.state_dict_for_samplers()  # detached CPU copies

    # -- broadcast (fleet.broadcast.Sender): sends in their own threads, never holding the update
    def publish(self) -> int:
        return self._sender().hold(int(self.trainer.version), self.trainer.state_dict_for_samplers())

    @ray.method(concurrency_group="weights")
    def channel_open(self, name: str, device: str) -> tuple[str, int]:
        return self._sender().open(name, ray.util.get_node_ip_address(), device)

    @ray.method(concurrency_group="weights")
    def send_weights(self, name: str, version: int) -> bool:
        return bool(self._sender().send(name, version))

    @ray.method(concurrency_group="weights")
    def channel_close(self, name: str) -> None:
        self._sender().close(name)

    def _sender(self) -> Any:
        with self._sender_lock:  # methods of two concurrency groups may ask first
            if self.sender is None:
                from mixrl.fleet.broadcast import Sender

                self.sender = Sender()
            return self.sender

    def state(self) -> dict[str, Any]:
        from mixrl.runtime.trainer_state import trainer_state

        return trainer_state(self.trainer)

    def load_state(self, state: dict[str, Any]) -> None:
        from mixrl.runtime.trainer_state import load_trainer_state

        load_trainer_state(self.trainer, state)

    def save_policy(self, out_dir: str) -> None:
        from mixrl.runtime.trainer_state import save_policy

        save_policy(self.trainer, self.tokenizer, out_dir)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


@ray.remote(**_ACTOR_OPTS)
class RankActor:
    """One FSDP2 trainer rank (``runtime.ranks.RankWorker``) in a bundle of the trainer's placement group."""

    def address(self) -> tuple[str, int]:
        from mixrl.train.distributed import free_port

        return ray.util.get_node_ip_address(), free_port()  # rank 0 hosts the rendezvous

    def setup(self, rank: int, world: int, addr: str, port: int, cfg: dict[str, Any], model_path: str,
              loss_cfg: Any) -> None:
        from mixrl.runtime.ranks import RankWorker

        self.rank = rank
        self.worker = RankWorker(rank, world, addr, port, cfg, model_path, loss_cfg)

    def call(self, cmd: str, *args: Any) -> Any:
        out = getattr(self.worker, cmd)(*args)
        return out if self.rank == 0 or cmd == "memory_bytes" else None

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


class RayRanks(TrainerHandle):
    """``trainer.world_size`` rank actors; every command goes to all of them, rank 0 answers."""

    def __init__(self, actors: list[Any], pg: Any):
        self.actors, self.pg, self.actor = actors, pg, actors[0]
        self._lock = asyncio.Lock()

    async def _all(self, cmd: str, *args: Any) -> list[Any]:
        from mixrl.runtime.ranks import RankFailure

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

    async def weights(self) -> Any:
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

    async def load_weights(self, ref: Any, version: int) -> None:
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

    async def weights(self) -> Any:
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

    async def close(self) -> None:
        ray.kill(self.actor, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)


class RayBackend(Backend):
    name = "ray"

    def __init__(self, cfg: RunConfig, model_path: str, loss_cfg: Any):
        self.cfg, self.model_path, self.loss_cfg = cfg, model_path, loss_cfg
        self.samplers: dict[str, RaySampler] = {}
        self.trainer: Any = None
        self._started_here = False
        self.formats = FormatRefs()  # one quantization per (version, format), in the object store
        self.broadcast = cfg.runtime.ray.weight_transport == "broadcast"
        self._tied: bool | None = None

    def _is_tied(self) -> bool:
        if self._tied is None:
            from transformers import AutoConfig

            self._tied = bool(getattr(AutoConfig.from_pretrained(self.model_path), "tie_word_embeddings", False))
        return self._tied

    async def start(self) -> None:
        if ray.is_initialized():
            return
        address = self.cfg.runtime.ray.address or os.environ.get("RAY_ADDRESS")
        _require_token_mode()
        if address:
            check_cluster_token(address)
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        else:
            tmp = tempfile.mkdtemp(prefix="mixrl-ray-")
            ray.init(
                num_cpus=self.cfg.runtime.ray.num_cpus or max(os.cpu_count() or 1, cpus_needed(self.cfg)),
                include_dashboard=False, _temp_dir=tmp, log_to_driver=False, configure_logging=False,
            )
        self._started_here = True

    def _trainer_bundle(self) -> dict[str, float]:
        t = self.cfg.trainer
        return bundle(t.num_cpus, t.num_gpus, t.memory_gb, t.accelerator_type)

    async def make_trainer(self) -> TrainerHandle:
        b = self._trainer_bundle()
        world = self.cfg.trainer.world_size
        if self.broadcast and world > 1:
            raise ConfigError("runtime.ray.weight_transport = \"broadcast\" needs trainer.world_size = 1, "
                              f"got {world}")
        if world > 1:  # FSDP2 ranks: one actor per bundle of one placement group
            pg = await _placed([b] * world, "PACK", "mixrl-trainer-ranks")
            actors = [RankActor.options(**_actor_options(pg, i, b)).remote()  # type: ignore[attr-defined]
                      for i in range(world)]
            addr, port = await actors[0].address.remote()
            cfg = self.cfg.model_dump(mode="json")
            await asyncio.gather(*[a.setup.remote(i, world, addr, port, cfg, self.model_path, self.loss_cfg)
                                   for i, a in enumerate(actors)])
            self.trainer = RayRanks(actors, pg)
            return self.trainer
        pg = await _placed([b], "STRICT_PACK", "mixrl-trainer")
        actor = TrainerActor.options(**_actor_options(pg, 0, b)).remote(  # type: ignore[attr-defined]
            self.cfg.model_dump(mode="json"), self.model_path, self.loss_cfg
        )
        await actor.version.remote()  # raises here if the trainer cannot be built
        self.trainer = RayTrainer(actor, pg, self.broadcast)
        return self.trainer

    async def make_sampler(self, group: str, name: str) -> SamplerHandle:
        from mixrl.runtime.backends.embedded.formats import format_key, serving_profile
        from mixrl.runtime.backends.inprocess import group_profile, replica_seed

        trainer = self.trainer.actor if self.broadcast and self.trainer is not None else None
        if self.broadcast and trainer is None:  # before placing anything, so nothing is left behind
            raise ReplicaFailure(f"replica {name}: the broadcast transport needs the trainer actor first")
        prof = group_profile(self.cfg, group)
        # None: the engine quantizes on load itself (always, when versions come by broadcast)
        fmt = None if self.broadcast else format_key(prof, self._is_tied())
        g = next(x for x in self.cfg.fleet.groups if x.name == group)
        b = bundle(g.num_cpus, g.num_gpus, g.memory_gb, g.accelerator_type)
        pg = await _placed([b], "STRICT_PACK", f"mixrl-{name}")
        actor = SamplerActor.options(**_actor_options(pg, 0, b)).remote(  # type: ignore[attr-defined]
            self.model_path, serving_profile(prof, fmt), group, replica_seed(self.cfg.runtime.seed, name),
            self.cfg.runtime.torch_threads, prof if fmt is not None else None,
        )
        try:
            await actor.pid.remote()
        except RayActorError as e:
            if pg is not None:
                remove_placement_group(pg)
            raise ReplicaFailure(f"replica {name} could not start: {e}") from e
        device = "cuda" if g.num_gpus > 0 and self.cfg.trainer.num_gpus > 0 else "cpu"  # NCCL GPU to GPU
        h = RaySampler(name, group, actor, pg, fmt, self.formats, trainer, device)
        self.samplers[name] = h
        return h

    async def placement(self) -> list[dict[str, Any]]:
        """Where every live actor runs: name, group, requested accelerator, node id and its resources."""
        nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        want = {g.name: g.accelerator_type for g in self.cfg.fleet.groups}
        rows = []
        handles: list[tuple[str, str, str | None, Any]] = [
            (n, h.group, want.get(h.group), h.actor) for n, h in self.samplers.items()]
        if getattr(self, "trainer", None) is not None:
            handles.append(("trainer", "trainer", self.cfg.trainer.accelerator_type, self.trainer.actor))
        for name, group, accel, actor in handles:
            try:
                node = await actor.node.remote()
            except (RayActorError, RayTaskError):
                continue  # dead: not placed anywhere
            types = sorted(k.split(":", 1)[1] for k in nodes.get(node, {}).get("Resources", {})
                           if k.startswith("accelerator_type:"))
            rows.append({"actor": name, "group": group, "wants": accel or "-", "node": node[:12],
                         "node_accelerators": ",".join(types) or "-"})
        return rows

    def kill(self, name: str) -> None:
        """Kill a replica's actor process (fault injection)."""
        ray.kill(self.samplers[name].actor, no_restart=True)

    async def shutdown(self) -> None:
        if self._started_here:
            ray.shutdown()
