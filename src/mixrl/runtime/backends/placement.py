"""What an actor or worker reserves: placement-group bundles and the logical CPUs of a local
Ray cluster; the GPU each embedded sampler worker takes and the memory check of one host.

Ray-free arithmetic (the Ray backend turns bundles into placement groups; the embedded
backend sets each worker's ``CUDA_VISIBLE_DEVICES`` from ``replica_device``).
"""

from __future__ import annotations

from typing import Any

from mixrl.config import ConfigError, RunConfig


def bundle(num_cpus: float, num_gpus: float, memory_gb: float, accelerator_type: str | None) -> dict[str, float]:
    """One placement-group bundle: what a replica or rank reserves (zero entries left out)."""
    b = {"CPU": num_cpus, "GPU": num_gpus, "memory": float(int(memory_gb * 2**30))}
    if accelerator_type:
        b[f"accelerator_type:{accelerator_type}"] = 0.001  # as Ray's own accelerator_type option
    return {k: v for k, v in b.items() if v > 0}


def cpus_needed(cfg: RunConfig) -> int:
    """Logical CPUs of the fleet at its largest plus the trainer ranks."""
    t = cfg.trainer
    need = sum(g.max_replicas * g.num_cpus for g in cfg.fleet.groups) + t.world_size * t.num_cpus
    return int(need + 0.999)


# -- GPUs of one host (the embedded backend; Ray assigns devices to its actors itself)

VLLM_DEFAULT_UTILIZATION = 0.9  # vLLM's own default gpu_memory_utilization
MAX_SHARED_UTILIZATION = 0.95  # what all engines on one device may take together


def uses_gpu(g: Any) -> bool:
    """A replica of group ``g`` runs on a GPU (embedded backend)."""
    return g.num_gpus > 0 or bool(g.cuda_devices)


def replica_device(cfg: RunConfig, group: str, index: int, visible: int) -> int | None:
    """This host's CUDA device replica ``index`` of ``group`` takes; None: no GPU.

    A group's ``cuda_devices`` are taken in turn; groups without them share every
    visible device in turn, each group starting where the one before it (all its
    ``max_replicas``) ends, so two groups do not both start on device 0."""
    offset = 0
    for g in cfg.fleet.groups:
        if g.name == group:
            break
        if uses_gpu(g) and not g.cuda_devices:
            offset += g.max_replicas
    if not uses_gpu(g):
        return None
    if g.cuda_devices:
        return int(g.cuda_devices[index % len(g.cuda_devices)])
    if not visible:
        raise ConfigError(f"fleet group {g.name!r} asks for a GPU (num_gpus={g.num_gpus:g}) but this host has none")
    return (offset + index) % visible


def visible_env(device: int | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a worker on ``device`` (an index into what this process
    sees, itself maybe narrowed by ``CUDA_VISIBLE_DEVICES``); "" hides every GPU."""
    import os

    if device is None:
        return ""
    mine = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return mine[device] if mine else str(device)


def trainer_devices(cfg: RunConfig, visible: int) -> list[int]:
    """Devices the trainer ranks take (``runtime.ranks.rank_device``: rank mod visible)."""
    t = cfg.trainer
    return sorted({r % visible for r in range(t.world_size)}) if t.num_gpus > 0 and visible else []


def check_gpu_plan(cfg: RunConfig, visible: int, engines: dict[str, str] | None = None) -> dict[int, list[str]]:
    """Refuse, in one line, a GPU plan this host cannot hold; what runs on each device.

    Every replica a group may grow to (``max_replicas``) is counted on the device it
    would take. On one device the vLLM engines' ``gpu_memory_utilization`` must sum to at
    most 0.95, and beside a trainer rank every one must set it (vLLM's default 0.9 would
    leave the trainer nothing). ``engines`` (group -> profile engine): built-in engine
    groups reserve nothing up front (they allocate what their batches use) and are only
    listed.
    """
    plan: dict[int, list[str]] = {d: ["trainer"] for d in trainer_devices(cfg, visible)}
    share: dict[int, float] = {}
    for i, g in enumerate(cfg.fleet.groups):
        for d in g.cuda_devices or []:
            if d >= visible:
                raise ConfigError(f"fleet.groups[{i}].cuda_devices: device {d} does not exist "
                                  f"(this host shows {visible} CUDA device(s))")
        for r in range(g.max_replicas):
            d = replica_device(cfg, g.name, r, visible)
            if d is None:
                continue
            if (engines or {}).get(g.name) == "builtin":
                plan.setdefault(d, []).append(f"{g.name}/{r}")
                continue
            if "trainer" in plan.get(d, []) and g.gpu_memory_utilization is None:
                raise ConfigError(f"fleet.groups[{i}].gpu_memory_utilization: unset, but replica {g.name}/{r} "
                                  f"shares GPU {d} with a trainer rank; set the fraction it may take")
            plan.setdefault(d, []).append(f"{g.name}/{r}")
            share[d] = share.get(d, 0.0) + (g.gpu_memory_utilization or VLLM_DEFAULT_UTILIZATION)
    for d, total in share.items():
        if total > MAX_SHARED_UTILIZATION + 1e-9:
            raise ConfigError(f"fleet.groups[].gpu_memory_utilization: the engines on GPU {d} ({', '.join(plan[d])}) "
                              f"would take {total:.2f} of its memory together (at most {MAX_SHARED_UTILIZATION})")
    return plan


def visible_gpus() -> int:
    """CUDA devices this process may use, without initialising CUDA (``CUDA_VISIBLE_DEVICES``,
    else the driver's device nodes)."""
    import glob
    import os

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([x for x in env.split(",") if x.strip() and x.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))


def check_broadcast(cfg: RunConfig) -> None:
    """The broadcast transport puts the trainer and each GPU replica in a two-rank NCCL group:
    with a fraction of a GPU on either side Ray may place both on one device, which NCCL
    cannot run. Refused in one line."""
    t = cfg.trainer
    if cfg.runtime.ray.weight_transport != "broadcast" or t.num_gpus <= 0:
        return
    for i, g in enumerate(cfg.fleet.groups):
        if g.num_gpus > 0 and (g.num_gpus < 1 or t.num_gpus < 1):
            raise ConfigError(
                f"runtime.ray.weight_transport = \"broadcast\" with fractional GPUs (trainer.num_gpus={t.num_gpus:g}, "
                f"fleet.groups[{i}].num_gpus={g.num_gpus:g}): two NCCL ranks could share one device; "
                "give each a whole GPU or use the object store")
