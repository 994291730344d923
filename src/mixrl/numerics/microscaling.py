"""Block-scaled formats through torchao's reference implementations.

- MXFP8 / MXFP4 (OCP Microscaling Formats v1.0, §5-6): 32 elements share one
  E8M0 (power-of-two) scale ``2^(floor(log2 amax) − emax_elem)``; elements are
  E4M3 or E2M1. torchao ``MXTensor.to_mx(..., scaling_mode=FLOOR)``.
- NVFP4: 16 E2M1 elements share one FP8 E4M3 scale, and the whole group of
  blocks shares one FP32 outer scale ``amax / (448 · 6)`` so the E4M3 block
  scales use their full range. Without the outer scale, blocks of small weights
  (|w| ~ 0.02, block scale ~ 0.005) fall into E4M3 subnormals and lose bits.
  torchao ``NVFP4Tensor.to_nvfp4(..., per_tensor_scale=...)``.

Blocks run along the last dim. A last dim that is not a multiple of the block
is zero-padded and cut back afterwards: zeros leave every block's ``amax``
unchanged, so this is exactly a short final block (no fallback format).

Non-finite values follow the formats: E2M1 has no NaN or inf, so a block with a
NaN (or, for MX, an inf) gets a NaN scale and dequantizes to NaN as a whole —
it never turns into a finite number. The NVFP4 outer scale ignores NaN/inf.

NVFP4 runs torchao's ``nvfp4_quantize`` arithmetic op for op, then (instead of
encoding E2M1 codes bit by bit, packing and decoding them) rounds the scaled
elements onto the E2M1 grid in FP32 (``fp8.round_to_grid``) and multiplies by
the same FP32 scales: bit-identical to ``NVFP4Tensor.to_nvfp4(...).dequantize``
(tested), about ten times faster on CPU. A tensor whose scaled elements hold a NaN
(a NaN input, or an outer scale so small that ``0 · inf`` appears) goes through
torchao itself, whose encoder gives NaN a code of its own.
"""

from __future__ import annotations

import torch

from mixrl.numerics.fp8 import GRIDS, finite_amax, round_to_grid
from mixrl.numerics.torchao_ref import torchao_mx

_TINY = torch.finfo(torch.float32).tiny


def _rows_padded(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """x: [..., K] -> contiguous float32 [R, Kp] with Kp a multiple of block; returns K."""
    k = x.shape[-1] if x.dim() else 1
    x2 = x.reshape(-1, k).to(torch.float32)  # [R, K]
    pad = -k % block
    if pad:
        x2 = torch.nn.functional.pad(x2, (0, pad))
    return x2.contiguous(), k


def mx(x: torch.Tensor, element: str, block: int = 32) -> torch.Tensor:
    """MXFP8 (element "float8_e4m3fn") or MXFP4 ("e2m1"). x: [..., K] -> float32 [..., K]."""
    t = torchao_mx()
    elem = torch.float8_e4m3fn if element == "float8_e4m3fn" else torch.float4_e2m1fn_x2
    x2, k = _rows_padded(x, block)  # [R, Kp]
    if x2.numel() == 0:
        return x.to(torch.float32)
    q = t.MXTensor.to_mx(x2, elem, block).dequantize(torch.float32)  # [R, Kp]
    return q[:, :k].reshape(x.shape)


def _outer_scale(amax: torch.Tensor) -> torch.Tensor:
    """FP32 outer scale amax / (448 · 6); 1 where the group is all zero."""
    s = torchao_mx().per_tensor_amax_to_scale(amax)
    return torch.where(amax > 0, s, torch.ones_like(s)).clamp_min(_TINY)


def nvfp4(x: torch.Tensor, *, outer: str, block: int = 16) -> torch.Tensor:
    """NVFP4 fake quantization. x: [..., K] -> float32 [..., K].

    outer="tensor": one FP32 outer scale for the whole tensor (weights);
    outer="row": one per row of the last dim (a token, or a token and head), so a
    quantized KV entry never depends on what else was in the batch.
    """
    if outer not in ("tensor", "row"):
        raise ValueError(f"nvfp4 outer must be 'tensor' or 'row', got {outer!r}")
    x2, k = _rows_padded(x, block)  # [R, Kp]
    if x2.numel() == 0:
        return x.to(torch.float32)
    r, kp = x2.shape
    max_abs = torch.nn.functional.max_pool1d(x2.abs().view(1, 1, -1), block).view(r, kp // block)
    # the outer scale's finite amax: the largest block max when that is finite (max is exact)
    amax = max_abs.amax() if outer == "tensor" else max_abs.amax(dim=1, keepdim=True)  # [] or [R, 1]
    if not bool(torch.isfinite(amax).all()):
        amax = finite_amax(x2).reshape(()) if outer == "tensor" else finite_amax(x2, dim=-1)
    scale = _outer_scale(amax)
    q = _nvfp4_grid(x2, max_abs, scale, block)
    if q is None:
        t = torchao_mx()
        if outer == "tensor":
            q = t.NVFP4Tensor.to_nvfp4(x2, block, per_tensor_scale=scale).dequantize(torch.float32)
        else:  # [R, 1, Kp]: torchao treats dim 0 as experts, each with its own outer scale
            q = t.NVFP4Tensor.to_nvfp4(x2.unsqueeze(1), block, per_tensor_scale=scale.view(-1, 1, 1))
            q = q.dequantize(torch.float32).squeeze(1)
    return q[:, :k].reshape(x.shape)


_E4M3_MAX, _E2M1_MAX = 448.0, 6.0
_E4M3_EPS = torch.finfo(torch.float8_e4m3fn).tiny  # torchao's lower clamp of the block scales


def _nvfp4_grid(x2: torch.Tensor, max_abs: torch.Tensor, outer: torch.Tensor, block: int) -> torch.Tensor | None:
    """``to_nvfp4(x2, per_tensor_scale=outer).dequantize()`` for x2 [R, Kp] float32, its
    block maxes of |x| [R, Kp/16] and an outer scale [] or [R, 1], computed as torchao's
    ``nvfp4_quantize`` computes it; None when a scaled element is NaN (torchao's encoder
    then decides)."""
    r, kp = x2.shape
    data = x2.view(r, kp // block, block)  # [R, Kp/16, 16]
    block_scale = max_abs / _E2M1_MAX
    scaled = (block_scale / outer).clamp(min=_E4M3_EPS, max=_E4M3_MAX)
    scaled_fp8 = round_to_grid(scaled, *GRIDS[torch.float8_e4m3fn])  # = .to(float8_e4m3fn).float()
    reciprocal = (1.0 / outer) / scaled_fp8  # [R, Kp/16]
    elems = data * reciprocal.unsqueeze(-1)
    if torch.isnan(elems.sum()):  # one reduction instead of an elementwise test
        return None
    q = round_to_grid(elems.clamp_(-_E2M1_MAX, _E2M1_MAX), 1, 0)  # E2M1: 1 mantissa bit, emin 0
    return q.mul_((outer * scaled_fp8).unsqueeze(-1)).view(r, kp)


def e2m1_values() -> torch.Tensor:
    """The 15 distinct values of FP4 E2M1 (±0 merged), ascending, from torchao's decoder."""
    codes = torch.arange(16, dtype=torch.uint8)
    return torch.unique(torchao_mx().f4_unpacked_to_f32(codes))  # [15]
