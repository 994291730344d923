"""Ray actors: a sampler replica, the trainer (``world_size = 1``), one FSDP2 trainer rank.

Each actor runs in its own process with the resources of its placement-group bundle;
Ray shows it only the GPUs of that bundle (``CUDA_VISIBLE_DEVICES``), so a GPU actor's
device is always ``cuda:0`` of what it sees. Handles in ``handles``, the backend
that places them in this package's ``__init__``.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import ray

from mixrl.config import RunConfig
from mixrl.records.generation import GenerationRequest, GenerationResult
from mixrl.records.trajectory import Trajectory
from mixrl.runtime.gpu import placement_of
from mixrl.runtime.ranks import RankWorker, rank_device
from mixrl.runtime.trainer_state import build_trainer
from mixrl.sampling.batching import BatchingSampler
from mixrl.sampling.factory import make_engine
from mixrl.system.quiet import silence_libraries
from mixrl.train.distributed import free_port
from mixrl.train.surface import TrainerSurface
from mixrl.weights.broadcast import join

# Actors take their resources from their placement-group bundle (``RayBackend``).
ACTOR_OPTS: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}


@ray.remote(**ACTOR_OPTS)
class SamplerActor:
    def __init__(self, model_path: str, profile: Any, group: str, seed: int, threads: int,
                 quant_profile: Any = None, engine_kw: dict[str, Any] | None = None) -> None:
        silence_libraries()  # an actor's process: the libraries it loads stay quiet
        import torch


        torch.set_num_threads(threads)
        self.sampler = BatchingSampler(make_engine(model_path, profile, group, seed=seed, **(engine_kw or {})))
        self.quant_profile = quant_profile  # this group's format, if pre-quantized
        self._quantize: Any = None

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self.sampler.generate(request)

    async def quantize(self, state_dict: Any) -> dict[str, Any]:
        """The tensors this group's format changes in one version (the version's one
        quantization into the format; its result goes to the object store for every
        replica of the format)."""
        if self._quantize is None:
            from mixrl.weights.formats import quantizer

            self._quantize = quantizer(self.quant_profile)
        q = self._quantize

        def run() -> dict[str, Any]:
            return {k: t for k, t in ((k, q(k, v)) for k, v in state_dict.items()) if t is not None}

        return await asyncio.to_thread(run)  # generation goes on meanwhile

    async def load_weights(self, state_dict: Any, version: int, quantized: Any = None) -> None:
        await self.sampler.load_weights({**state_dict, **quantized} if quantized else state_dict, version)

    async def channel_join(self, host: str, port: int, device: str) -> None:
        """Rank 1 of this replica's weights channel to the trainer (broadcast transport)."""

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

    def where(self) -> dict[str, Any]:
        """The GPUs Ray assigned this replica and what CUDA shows it."""
        return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


@ray.remote(concurrency_groups={"weights": 8}, **ACTOR_OPTS)  # type: ignore[call-overload]
class TrainerActor:
    def __init__(self, cfg: dict[str, Any], model_path: str, loss_cfg: Any) -> None:
        silence_libraries()  # an actor's process: the libraries it loads stay quiet

        run = RunConfig.model_validate(cfg)
        # Ray shows this actor only its bundle's GPUs: cuda:0; num_gpus = 0 pins the CPU
        self.device = rank_device(0, run.trainer.num_gpus > 0)
        self.trainer, self.tokenizer = build_trainer(run, model_path, loss_cfg, device=self.device)
        self.surface = TrainerSurface(self.trainer, self.tokenizer)
        self.sender: Any = None
        self._sender_lock = threading.Lock()

    def step(self, trajectories: list[Trajectory], advantages: list[float]) -> dict[str, float]:
        return self.surface.step(trajectories, advantages)

    def version(self) -> int:
        return self.surface.version()

    def weights(self) -> dict[str, Any]:
        return self.surface.weights()  # detached CPU copies

    # -- broadcast (weights.broadcast.Sender): sends in their own threads, never holding the update
    def publish(self) -> int:
        return self._sender().hold(self.surface.version(), self.surface.weights())

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
                from mixrl.weights.broadcast import Sender

                self.sender = Sender()
            return self.sender

    def state(self) -> dict[str, Any]:
        return self.surface.state_dict()

    def load_state(self, state: dict[str, Any]) -> None:
        self.surface.load_state_dict(state)

    def save_policy(self, out_dir: str) -> None:
        self.surface.save_policy(out_dir)

    def probe_logprobs(self, prompts: list[list[int]]) -> list[list[float]]:
        return self.surface.probe_logprobs(prompts)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def where(self) -> dict[str, Any]:
        """The trainer's device as its parameters, CUDA's allocator and Ray's assignment show it."""

        return {**placement_of(self.trainer), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


@ray.remote(**ACTOR_OPTS)
class RankActor:
    """One FSDP2 trainer rank (``runtime.ranks.RankWorker``) in a bundle of the trainer's placement group."""

    def address(self) -> tuple[str, int]:

        return ray.util.get_node_ip_address(), free_port()  # rank 0 hosts the rendezvous

    def setup(self, rank: int, world: int, addr: str, port: int, cfg: dict[str, Any], model_path: str,
              loss_cfg: Any) -> None:
        silence_libraries()  # an actor's process: the libraries it loads stay quiet

        self.rank = rank
        self.worker = RankWorker(rank, world, addr, port, cfg, model_path, loss_cfg)

    def call(self, cmd: str, *args: Any) -> Any:
        out = getattr(self.worker, cmd)(*args)
        return out if self.rank == 0 or cmd == "memory_bytes" else None

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()
