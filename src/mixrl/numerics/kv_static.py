"""Static per-tensor FP8 KV-cache scales, calibrated once (as serving stacks do).

A dynamic KV format (``quantize_kv``) takes one scale per token and head, so a
large key never costs a small one its precision. Serving stacks with an FP8 KV
cache instead use one FP32 scale per cache tensor, fixed at load: vLLM reads
``k_scale``/``v_scale`` from the checkpoint, computes them once from the first
batch (``calculate_kv_scales``), or falls back to 1.0. Entries far below the
scale fall into E4M3's subnormals (or flush to zero); entries above
``scale · 448`` saturate. This is the mismatch a static scale adds:

    s = amax_calibration / fmax,   x̂ = cast_fp8(clamp(x / s, −fmax, fmax)) · s

with ``amax_calibration`` taken once over every layer's keys and values on
calibration prompts (:func:`calibrate_kv_scale`), one scale for the whole cache.

    hook = kv_hook("fp8_e4m3", static_scale=0.05)      # what the engine calls on cache writes
    s = calibrate_kv_scale(model, prompts, "fp8_e4m3")  # HF causal LM, lists of token ids
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mixrl.numerics.formats import get_format

STATIC_KV_FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _element(fmt: str) -> torch.dtype:
    if fmt not in STATIC_KV_FORMATS:
        raise ValueError(
            f"static KV scale needs an FP8 kv format ({', '.join(STATIC_KV_FORMATS)}), got {fmt!r}"
        )
    return STATIC_KV_FORMATS[fmt]


def quantize_kv_static(x: torch.Tensor, fmt: str, scale: float) -> torch.Tensor:
    """Fake-quantize ``x`` (any shape) to FP8 with one fixed FP32 ``scale``; dtype kept.

    NaN stays NaN; ±inf and values beyond ``scale · fmax`` saturate to ±fmax·scale
    (the satfinite conversion of ``fp8.cast_scaled``)."""
    dtype = _element(fmt)
    if not (isinstance(scale, (int, float)) and scale > 0 and scale < float("inf")):
        raise ValueError(f"static KV scale must be a finite number > 0, got {scale!r}")
    fmax = torch.finfo(dtype).max
    s = torch.tensor(float(scale), dtype=torch.float32)
    q = (x.to(torch.float32) / s).clamp(-fmax, fmax).to(dtype)
    return (q.to(torch.float32) * s).to(x.dtype)


def kv_hook(fmt: str, static_scale: float | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The engine's cache-write hook: dynamic per-token scales, or one static scale."""
    if static_scale is None:
        from mixrl.numerics.quant import quantize_kv

        get_format(fmt, what="kv format")
        return lambda x: quantize_kv(x, fmt)
    _element(fmt)
    scale = float(static_scale)
    quantize_kv_static(torch.zeros(1), fmt, scale)  # validate the scale now, not mid-decode
    return lambda x: quantize_kv_static(x, fmt, scale)


@torch.no_grad()
def calibration_amax(model: Any, prompts: Sequence[Sequence[int]]) -> float:
    """max |entry| over every layer's cached keys (after RoPE) and values, FP32 forward.

    ``model``: an HF causal LM; ``prompts``: token-id lists, run one at a time so no
    padding enters the statistic."""
    amax = 0.0
    for ids in prompts:
        out = model(torch.tensor([list(ids)], dtype=torch.long), use_cache=True)  # no_grad above
        cache = out.past_key_values
        layers = getattr(cache, "layers", None)
        pairs = ([(lay.keys, lay.values) for lay in layers] if layers is not None
                 else [(cache.key_cache[i], cache.value_cache[i]) for i in range(len(cache.key_cache))])  # fmt: skip
        for k, v in pairs:
            for t in (k, v):
                t = t.float()
                amax = max(amax, float(t[torch.isfinite(t)].abs().max()))
    return amax


def calibrate_kv_scale(
    model: Any, prompts: Sequence[Sequence[int]], fmt: str = "fp8_e4m3"
) -> float:
    """One FP32 scale for the whole KV cache: calibration amax / the format's fmax."""
    fmax = torch.finfo(_element(fmt)).max
    amax = calibration_amax(model, prompts)
    return amax / fmax if amax > 0 else 1.0


__all__ = [
    "STATIC_KV_FORMATS",
    "quantize_kv_static",
    "kv_hook",
    "calibration_amax",
    "calibrate_kv_scale",
]
