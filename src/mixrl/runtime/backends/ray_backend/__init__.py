"""Ray backend: sampler replicas and the trainer as Ray actors.

This package (``actors``, ``handles``, ``auth`` and the backend here) is the only place that imports Ray. The orchestrator is the same as
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

Authentication: every cluster runs with Ray's token authentication (``auth``;
mixrl never opts out). ``start`` joins ``runtime.ray.address`` or ``$RAY_ADDRESS``,
its token checked first; else it starts a local cluster: token auth on, no
dashboard, a private temporary directory.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mixrl.config import ConfigError, RunConfig
from mixrl.fleet.handles import SamplerHandle
from mixrl.runtime.backends.embedded.threads import group_profile, replica_seed
from mixrl.runtime.backends.placement import bundle, check_broadcast, cpus_needed
from mixrl.runtime.backends.ray_backend.actors import RankActor, SamplerActor, TrainerActor
from mixrl.runtime.backends.ray_backend.auth import (  # noqa: F401
    RayAuthError,
    check_cluster_token,
    check_initialised,
    private_token_file,
    require_token_mode,
)
from mixrl.runtime.backends.ray_backend.handles import RayRanks, RaySampler, RayTrainer
from mixrl.runtime.handles import Backend, TrainerHandle
from mixrl.sampling.base import ReplicaFailure
from mixrl.weights.format_refs import FormatRefs
from mixrl.weights.formats import format_key, serving_profile

PLACEMENT_TIMEOUT_S = 60.0  # a bundle no node can hold fails its replica instead of waiting forever


def _actor_options(pg: Any, index: int, b: dict[str, float]) -> dict[str, Any]:
    """Options that put an actor into bundle ``index`` of ``pg``, asking for the bundle's resources.

    An actor with no GPU in its bundle sees none (Ray leaves ``CUDA_VISIBLE_DEVICES`` unset
    for it, so on a GPU node it would see them all); one with GPUs sees Ray's assignment."""
    hide = {} if b.get("GPU", 0) > 0 else {"runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}}
    if pg is None:
        return hide
    custom = {k: v for k, v in b.items() if k not in ("CPU", "GPU", "memory")}
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
            "num_cpus": b.get("CPU", 0), "num_gpus": b.get("GPU", 0), "memory": b.get("memory") or None,
            "resources": custom or None, **hide}


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


class RayBackend(Backend):
    name = "ray"

    def __init__(self, cfg: RunConfig, model_path: str, loss_cfg: Any):
        self.cfg, self.model_path, self.loss_cfg = cfg, model_path, loss_cfg
        self.samplers: dict[str, RaySampler] = {}
        self.trainer: Any = None
        self._started_here = False
        self._temp_dir: str | None = None  # the local cluster's session files, removed at shutdown
        self.formats = FormatRefs()  # one quantization per (version, format), in the object store
        self.broadcast = cfg.runtime.ray.weight_transport == "broadcast"
        check_broadcast(cfg)
        self._tied: bool | None = None

    def _is_tied(self) -> bool:
        if self._tied is None:
            from transformers import AutoConfig

            self._tied = bool(getattr(AutoConfig.from_pretrained(self.model_path), "tie_word_embeddings", False))
        return self._tied

    async def start(self) -> None:
        if ray.is_initialized():  # the caller's Ray (API use): it must be one with token authentication
            check_initialised()
            return
        address = self.cfg.runtime.ray.address or os.environ.get("RAY_ADDRESS")
        require_token_mode()
        if address:
            check_cluster_token(address)
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        else:
            private_token_file()  # the token of the new cluster: 0600, before Ray writes one with the umask
            tmp = self._temp_dir = tempfile.mkdtemp(prefix="mixrl-ray-")
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

        trainer = self.trainer.actor if self.broadcast and self.trainer is not None else None
        if self.broadcast and trainer is None:  # before placing anything, so nothing is left behind
            raise ReplicaFailure(f"replica {name}: the broadcast transport needs the trainer actor first")
        prof = group_profile(self.cfg, group)
        # None: the engine quantizes on load itself (always, when versions come by broadcast)
        fmt = None if self.broadcast else format_key(prof, self._is_tied())
        g = next(x for x in self.cfg.fleet.groups if x.name == group)
        b = bundle(g.num_cpus, g.num_gpus, g.memory_gb, g.accelerator_type)
        pg = await _placed([b], "STRICT_PACK", f"mixrl-{name}")
        engine_kw: dict[str, Any] = {}
        if g.gpu_memory_utilization is not None:
            engine_kw["gpu_memory_utilization"] = g.gpu_memory_utilization
        if prof.engine == "builtin" and g.num_gpus > 0:  # the built-in engine computes on the bundle's GPU
            engine_kw["device"] = "cuda"
        actor = SamplerActor.options(**_actor_options(pg, 0, b)).remote(  # type: ignore[attr-defined]
            self.model_path, serving_profile(prof, fmt), group, replica_seed(self.cfg.runtime.seed, name),
            self.cfg.runtime.torch_threads, prof if fmt is not None else None, engine_kw or None,
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
            if self._temp_dir is not None:
                shutil.rmtree(self._temp_dir, ignore_errors=True)
