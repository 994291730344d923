"""Fake quantization of weights, KV-cache entries and activations.

Each function quantizes to a format of ``FORMATS`` and dequantizes back to the
input's dtype (shape unchanged), so a model that runs the returned tensors
computes with the values a kernel in that format would use. The internal
arithmetic is FP32, as in the reference kernels.

- ``quantize_weight(w, fmt)``: weights ``[out, in]``; row scales are per output
  channel, blocks run along ``in`` (the GEMM's reduction dim). Non-finite
  weights are a trainer-side error and raise.
- ``quantize_kv(x, fmt)``: KV entries ``[..., heads, seq, head_dim]``; scales per
  token and head (one row of ``head_dim``), blocks along ``head_dim``.
- ``quantize_activation(x, fmt)``: activations ``[..., hidden]``; dynamic
  per-token scales, blocks along ``hidden``.

For the last two, quantizing a row only ever depends on that row, so a
token's cached value is the same whatever batch it was computed in.
"""

from __future__ import annotations

import torch

from mixrl.numerics import fp8, microscaling
from mixrl.numerics.formats import FORMATS, ROW_FORMATS, FormatSpec, get_format

_FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
_CAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_float(x: torch.Tensor, fn: str) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{fn}: expected a floating-point tensor, got {got}")


def _apply(x: torch.Tensor, spec: FormatSpec, *, outer: str) -> torch.Tensor:
    if spec.scaling == "none":
        return x
    if spec.scaling == "cast":
        return x.to(_CAST[spec.element]).to(x.dtype)
    x32 = x.to(torch.float32)
    if spec.scaling == "row":
        q = fp8.fp8_rowwise(x32, _FP8[spec.element])
    elif spec.scaling == "tensor":
        q = fp8.fp8_tensorwise(x32, _FP8[spec.element])
    elif spec.scaling == "block128":
        q = fp8.fp8_block128(x32, _FP8[spec.element], spec.block)
    elif spec.scaling == "mx":
        q = microscaling.mx(x32, spec.element, spec.block)
    elif spec.scaling == "nv":
        q = microscaling.nvfp4(x32, outer=outer, block=spec.block)
    else:  # pragma: no cover - FORMATS and this dispatch are edited together
        raise AssertionError(f"no implementation for scaling {spec.scaling!r}")
    return q.to(x.dtype)


def quantize_weight(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Fake-quantize a weight ``[out, in]`` (any rank; leading dims fold into rows).

    Raises ValueError for an unknown format or a weight with NaN/inf (quantizing
    it would hide a diverged trainer behind the format's saturation).
    """
    spec = get_format(fmt, what="weight format")
    _check_float(w, "quantize_weight")
    # w * 0 is NaN exactly where w is NaN or ±inf, and a sum of zeros cannot overflow:
    # one reduction (an elementwise isfinite costs more than the quantization on CPU)
    if spec.scaling != "none" and torch.isnan((w * 0).sum()):
        bad = int((~torch.isfinite(w)).sum())
        if bad:
            raise ValueError(
                f"quantize_weight: weight {tuple(w.shape)} has {bad} non-finite values"
            )
    return _apply(w, spec, outer="tensor")


def quantize_kv(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Fake-quantize KV-cache entries ``[..., heads, seq, head_dim]`` per token and head.

    NaN stays NaN (it marks a numerical failure the engine must see); see
    ``fp8`` and ``microscaling`` for how each format treats ±inf.
    """
    spec = get_format(fmt, what="kv format", allowed=ROW_FORMATS)
    _check_float(x, "quantize_kv")
    return _apply(x, spec, outer="row")


def quantize_activation(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Fake-quantize activations ``[..., hidden]`` with dynamic per-token scales."""
    spec = get_format(fmt, what="activation format", allowed=ROW_FORMATS)
    _check_float(x, "quantize_activation")
    return _apply(x, spec, outer="row")


def relative_error(x: torch.Tensor, fmt: str) -> float:
    """‖q(x) − x‖ / ‖x‖ of ``quantize_weight`` (float64 norms); 0 for a zero tensor."""
    q = quantize_weight(x, fmt).to(torch.float64)
    ref = x.to(torch.float64)
    den = float(ref.norm())
    return float((q - ref).norm()) / den if den > 0 else 0.0


__all__ = ["FORMATS", "quantize_weight", "quantize_kv", "quantize_activation", "relative_error"]
