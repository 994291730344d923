"""What a Ray actor reserves: placement-group bundles and the logical CPUs of a local cluster.

Ray-free arithmetic for the Ray backend (``ray_backend`` turns these into placement groups).
"""

from __future__ import annotations

from mixrl.config.run import RunConfig


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
