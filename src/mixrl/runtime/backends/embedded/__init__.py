"""The embedded backend (the default): one machine, no cluster, samplers as processes.

    orchestrator process                         sampler worker processes
    ┌────────────────────────────────┐   pipe   ┌──────────────────────────┐
    │ event loop: sessions, fleet    │◄────────►│ engine + BatchingSampler │  one per replica
    │ trainer (update in a thread)   │          └──────────────────────────┘
    │ weights ─► /dev/shm (one copy, │── mmap ──► every replica; one quantized
    │   one quantization per format) │            copy per (version, format)
    └────────────────────────────────┘

``runtime.sampler_workers`` picks how replicas run: ``"process"`` (default;
``worker`` + ``process``) so sampling and training overlap on separate cores,
or ``"thread"`` (``threads``), the replicas inside this process, for tests
that need a fully reproducible schedule. Either way the orchestrator sees the
same handles.

Each worker sets ``runtime.torch_threads`` torch threads. Replicas whose
format can be pre-quantized (``formats.format_key``) run their engine with the
weight format switched off and receive weights quantized once per version and
format (by the first worker of that format, at most one quantizing per core,
``slots``; thread replicas quantize here). That worker loads what it quantized
directly; the format's file in shared memory is written only when another live
replica of the format will map it.

Fault injection: ``kill(name)`` (a real SIGKILL of a worker process, or a
thread replica marked dead) and ``corrupt(name, n)``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mixrl.config import ConfigError, RunConfig
from mixrl.fleet.handles import SamplerHandle
from mixrl.runtime.backends.embedded.process import ProcessSampler
from mixrl.runtime.backends.embedded.slots import QuantizeSlots
from mixrl.runtime.backends.embedded.threads import (
    EmbeddedTrainer,
    ThreadSampler,
    group_profile,
    locked,
    replica_seed,
)
from mixrl.runtime.backends.placement import (
    check_gpu_plan,
    replica_device,
    uses_gpu,
    visible_env,
    visible_gpus,
)
from mixrl.runtime.handles import Backend, TrainerHandle
from mixrl.runtime.trainer_state import build_trainer
from mixrl.weights.formats import format_key, quantizer, serving_profile
from mixrl.weights.shared import checkpoint_bytes, shm_shortfall
from mixrl.weights.versions import KEEP_VERSIONS

__all__ = ["EmbeddedBackend", "EmbeddedTrainer", "ProcessSampler", "ThreadSampler", "group_profile", "replica_seed"]


def check_shm(cfg: RunConfig, model_path: str) -> None:
    """Refuse at start-up, in one line, when /dev/shm cannot hold the weight versions the
    sampler workers map: ``KEEP_VERSIONS`` FP32 copies plus one quantized copy per format."""

    formats = {format_key(group_profile(cfg, g.name), False) for g in cfg.fleet.groups} - {None}
    problem = shm_shortfall(checkpoint_bytes(model_path) * (KEEP_VERSIONS + len(formats)))
    if problem is not None:
        raise ConfigError(problem)


class EmbeddedBackend(Backend):
    name = "embedded"

    def __init__(self, cfg: RunConfig, model_path: str, loss_cfg: Any, *, workers: str | None = None,
                 quantize_slots: int | None = None):
        self.cfg, self.model_path, self.loss_cfg = cfg, model_path, loss_cfg
        # worker processes quantizing at once (None: one per usable core), see ``slots``
        self.quantize_slots = QuantizeSlots(quantize_slots)
        self.workers = workers or getattr(cfg.runtime, "sampler_workers", "process")
        if self.workers not in ("process", "thread"):
            raise ValueError(f"runtime.sampler_workers must be 'process' or 'thread', got {self.workers!r}")
        self.samplers: dict[str, ProcessSampler | ThreadSampler] = {}
        self._tied: bool | None = None
        # this host's GPUs: each worker sees only the one it takes (placement.replica_device)
        self.visible = visible_gpus()
        if self.visible or cfg.trainer.num_gpus > 0 or any(uses_gpu(g) for g in cfg.fleet.groups):
            check_gpu_plan(cfg, self.visible, {g.name: group_profile(cfg, g.name).engine for g in cfg.fleet.groups})
        if self.workers == "process":
            check_shm(cfg, model_path)

    def _is_tied(self) -> bool:
        if self._tied is None:
            from transformers import AutoConfig

            self._tied = bool(getattr(AutoConfig.from_pretrained(self.model_path), "tie_word_embeddings", False))
        return self._tied

    async def make_trainer(self) -> TrainerHandle:

        # FSDP2 ranks, one process each (mixrl.runtime.ranks); a CUDA trainer (num_gpus > 0)
        # is a rank process too, even alone: this process keeps no CUDA context
        if self.cfg.trainer.world_size > 1 or self.cfg.trainer.num_gpus > 0:
            from mixrl.runtime.gpu import require_cuda
            from mixrl.weights.shared import SharedVersion

            if self.cfg.trainer.num_gpus > 0:  # here, in one line, not in every rank's traceback
                require_cuda("trainer.num_gpus > 0")
            from mixrl.runtime.ranks import LocalRanks

            ranks = LocalRanks(self.cfg, self.model_path, self.loss_cfg, publish=SharedVersion.from_state_dict)
            return await ranks.started()

        trainer, tok = await asyncio.to_thread(locked, build_trainer, self.cfg, self.model_path, self.loss_cfg)
        return EmbeddedTrainer(trainer, tok)

    async def make_sampler(self, group: str, name: str) -> SamplerHandle:
        prof = group_profile(self.cfg, group)
        fmt = format_key(prof, self._is_tied())
        serve = serving_profile(prof, fmt)
        seed = replica_seed(self.cfg.runtime.seed, name)
        h: ProcessSampler | ThreadSampler
        g = next(x for x in self.cfg.fleet.groups if x.name == group)
        engine_kw: dict[str, Any] = {}
        if g.gpu_memory_utilization is not None:
            if prof.engine != "vllm":
                raise ConfigError(f"fleet group {group!r}: gpu_memory_utilization applies to vLLM profiles only, "
                                  f"{prof.name!r} is engine={prof.engine!r}")
            engine_kw["gpu_memory_utilization"] = g.gpu_memory_utilization
        device = replica_device(self.cfg, group, int(name.rsplit("/", 1)[-1]), self.visible) if self.visible else None
        if prof.engine == "builtin" and device is not None:  # the built-in engine computes on its GPU
            engine_kw["device"] = "cuda" if self.workers == "process" else f"cuda:{device}"  # a worker sees one
        if self.workers == "process":
            h = ProcessSampler(name, group, fmt, prof if fmt is not None else None, self.quantize_slots)
            await h.start(self.model_path, serve, seed, self.cfg.runtime.torch_threads,
                          cuda_visible=visible_env(device) if self.visible else None, engine_kw=engine_kw)
        else:
            from mixrl.sampling.batching import BatchingSampler
            from mixrl.sampling.factory import make_engine

            engine = await asyncio.to_thread(locked, make_engine, self.model_path, serve, group, seed=seed,
                                             **engine_kw)
            h = ThreadSampler(name, group, BatchingSampler(engine), fmt, quantizer(prof) if fmt is not None else None)
        self.samplers[name] = h
        return h

    def kill(self, name: str) -> None:
        self.samplers[name].kill()

    def corrupt(self, name: str, n: int) -> None:
        self.samplers[name].corrupt(n)

    async def shutdown(self) -> None:
        for h in list(self.samplers.values()):
            await h.close()
