"""Can torch use this machine's GPU? One line when a GPU is there but unusable.

``torch==2.13.0`` from the public index is a CUDA 13 build (it needs an R580+
driver); on a CUDA 12 driver, or with a ``+cpu`` wheel, ``torch.cuda`` reports
no device although ``nvidia-smi`` lists one. A run that asked for a GPU
(``trainer.num_gpus > 0``) must fail saying so rather than train on the CPU.
"""

from __future__ import annotations

import glob
import shutil
from typing import Any

from mixrl.config import ConfigError

DEVICE_GLOB = "/dev/nvidia[0-9]*"
INSTALL_HINT = "see README, section GPU, for the install command"


def gpu_present(device_glob: str = DEVICE_GLOB) -> str | None:
    """What shows an NVIDIA GPU on this machine (a device node or ``nvidia-smi``), or None."""
    nodes = sorted(glob.glob(device_glob))
    if nodes:
        return nodes[0]
    return shutil.which("nvidia-smi")


def cuda_problem(device_glob: str = DEVICE_GLOB) -> str | None:
    """None when torch can use CUDA; else one line saying why not (and whether a GPU is here)."""
    import torch

    if torch.cuda.is_available():
        return None
    where = gpu_present(device_glob)
    if where is None:
        return "no NVIDIA GPU is visible on this machine"
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU build"
    else:
        try:
            torch.cuda.init()
            why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device"
        except Exception as e:  # the driver's own reason, e.g. "driver ... is too old"
            why = f"torch {torch.__version__} (CUDA {torch.version.cuda}): {str(e).splitlines()[0]}"
    return f"a GPU is present ({where}) but torch cannot use it: {why}; {INSTALL_HINT}"


def require_cuda(what: str, device_glob: str = DEVICE_GLOB) -> None:
    """Raise ``ConfigError`` (one line) when ``what`` needs CUDA and torch cannot use it."""
    problem = cuda_problem(device_glob)
    if problem is not None:
        raise ConfigError(f"{what}: {problem}")


def placement_of(trainer: Any) -> dict[str, Any]:
    """Where a trainer's parameters and optimizer state live, and what CUDA allocated."""
    import torch

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    state = [v for st in trainer.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {"param_devices": sorted({str(local(p).device) for p in trainer.model.parameters()}),
            "optimizer_devices": sorted({str(local(v).device) for v in state if v.dim() > 0}),
            "max_memory_allocated": int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else 0}
