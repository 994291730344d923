"""Which weights a sampler format changes, so the publisher can quantize them once.

A built-in engine fake-quantizes the Linear weights of every decoder layer
(``*_proj.weight``) and, with ``quantize_lm_head``, the output head, through
its precision's ``weight`` hook. ``format_key(profile, tied)`` names that
transformation (replicas of two groups with the same key share one quantized
copy of each version); ``quantizer(profile)`` applies it, with the engine's
own hook, so a replica that loads pre-quantized weights with its weight
format switched off (``serving_profile``) computes exactly what it would have
computed quantizing on load.

Not cached (the replica quantizes on load, as before): engines other than
the built-in one (vLLM quantizes with its own kernels), identity formats
(nothing to do) and a quantized head tied to the embedding (the engine
quantizes the head but not the embedding lookup, which one tensor cannot carry).

Real FP8 (``fp8_gemm = "scaled_mm"``) shares the ``fp8_e4m3`` copy of the emulated
FP8 groups: its layers cast the received weights to E4M3 with per-channel scales,
which on weights already on that grid gives back the same values and scales
(quantizing is idempotent there, tested), so it keeps its profile unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from mixrl.sampling.builtin.precision import from_profile
from mixrl.sampling.profiles import with_overrides

_IDENTITY = {None, "", "none", "fp32", "float32"}


def format_key(profile: Any, tied: bool) -> str | None:
    if getattr(profile, "engine", "builtin") != "builtin":
        return None
    wf = getattr(profile, "weight_format", None)
    if wf is None or str(wf).lower() in _IDENTITY:
        return None
    head = bool(getattr(profile, "quantize_lm_head", False))
    if head and tied:
        return None
    return f"{wf}+head" if head else str(wf)


def quantizer(profile: Any) -> Any:
    """``(name, tensor) -> quantized fp32 tensor or None`` with the engine's own weight hook."""

    if getattr(profile, "fp8_gemm", "emulated") == "scaled_mm":  # its layers quantize: the same grid
        profile = with_overrides(profile, fp8_gemm="emulated")
    prec = from_profile(profile)
    head = bool(getattr(profile, "quantize_lm_head", False))

    def quantize(name: str, t: torch.Tensor) -> torch.Tensor | None:
        if name.endswith("_proj.weight") or (head and name.endswith("lm_head.weight")):
            with torch.inference_mode():
                return prec.weight(t.detach().to(torch.float32, copy=True))
        return None

    return quantize


def serving_profile(profile: Any, key: str | None) -> Any:
    """The profile a replica's engine runs with when it receives weights already in ``key``."""
    if key is None or getattr(profile, "fp8_gemm", "emulated") == "scaled_mm":
        return profile

    return with_overrides(profile, weight_format="none", quantize_lm_head=False)


class Quantized(Mapping[str, torch.Tensor]):
    """``base`` with ``quantize(name, tensor)`` applied to each tensor as it is read, nothing
    kept: a load that reads each weight once (the built-in engine's) holds one quantized tensor
    at a time beside what it builds, not a quantized copy of the model; the same values as
    quantizing every tensor first. ``seconds``: the quantizations' time so far."""

    def __init__(self, base: Mapping[str, torch.Tensor], quantize: Any) -> None:
        self.base, self.quantize, self.seconds = base, quantize, 0.0

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.base[name]
        t0 = time.perf_counter()
        q = self.quantize(name, t)
        self.seconds += time.perf_counter() - t0
        return t if q is None else q

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)

    def __contains__(self, name: object) -> bool:
        return name in self.base
