"""Scaled FP8 fake quantization with FP32 scales (per row, per tensor, per 128x128 tile).

    s = amax / fmax,   x̂ = cast_fp8(clamp(x / s, −fmax, fmax)) · s

where ``amax`` is taken over the scale group and ``fmax`` is the largest finite
value of the element type (448 for E4M3, 57344 for E5M2). The element cast is
torch's ``float8_e4m3fn`` / ``float8_e5m2`` conversion (round to nearest even),
so this is the numerics of an FP8 GEMM with FP32 scales (vLLM's per-tensor /
per-channel FP8, DeepSeek-V3's 128x128 weight blocks). The round trip
``cast_fp8(y).float()`` is computed in FP32 arithmetic (``round_to_grid``: the
value's binade gives its grid step, a power of two, and ``round`` goes to the
nearest even multiple), bit-identical to torch's casts (tested) and several
times faster on CPU, where converting FP8 back to FP32 is an unvectorized loop.

Edge cases (why):
- ``amax`` ignores NaN and ±inf, so one bad element cannot poison the scale of
  its whole group; the element itself follows the hardware's saturating
  ("satfinite") conversion: NaN stays NaN, ±inf and overflow saturate to ±fmax·s.
- An all-zero group gets scale 1 (any scale represents 0 exactly); scales are
  kept >= the smallest normal FP32 so ``x / s`` never divides by zero.
- Tiles at the ragged edge of a block-128 layout are zero-padded: zeros do not
  change a tile's ``amax``, so this equals a short final tile.
"""

from __future__ import annotations

import torch

_TINY = torch.finfo(torch.float32).tiny


# element type -> (mantissa bits, exponent of the smallest normal)
GRIDS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


def round_to_grid(y: torch.Tensor, mbits: int, emin: int) -> torch.Tensor:
    """float32 ``y`` rounded to nearest even onto the values of a float format with
    ``mbits`` mantissa bits and smallest normal ``2**emin`` (subnormals below it): the
    step in the binade [2^e, 2^(e+1)) is 2^(max(e, emin) - mbits). ``y`` must lie in the
    format's finite range (callers clamp first); NaN stays NaN."""
    expo = y.view(torch.int32) & 0x7F800000  # the binade 2^e, as bits
    step = expo.sub_(mbits << 23).clamp_min_((127 + emin - mbits) << 23).view(torch.float32)
    return torch.div(y, step).round_().mul_(step)  # exact: step is a power of two


def finite_amax(x: torch.Tensor, dim: tuple[int, ...] | int | None = None) -> torch.Tensor:
    """max |x| over ``dim`` (all dims if None), ignoring NaN and ±inf; keepdim."""
    mag = torch.nan_to_num(x.abs(), nan=0.0, posinf=0.0)  # the same values as a where(isfinite), faster
    if dim is None:
        return mag.amax().reshape([1] * x.dim())
    return mag.amax(dim=dim, keepdim=True)


def cast_scaled(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Quantize float32 ``x`` to ``dtype`` with scale ``amax / fmax`` (broadcast) and back."""
    fmax = torch.finfo(dtype).max
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax)).clamp_min(_TINY)
    # clamp keeps NaN; the explicit clamp makes saturation independent of the
    # torch version's own cast behaviour for out-of-range values.
    q = round_to_grid((x / scale).clamp_(-fmax, fmax), *GRIDS[dtype])  # = .to(dtype).float()
    return q.mul_(scale)


def fp8_rowwise(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One scale per row of the last dim. x: [..., K] float32 -> [..., K]."""
    return cast_scaled(x, finite_amax(x, dim=-1), dtype)


def fp8_tensorwise(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One scale for the whole tensor. x: any shape, float32."""
    return cast_scaled(x, finite_amax(x), dtype)


def fp8_block128(x: torch.Tensor, dtype: torch.dtype, block: int = 128) -> torch.Tensor:
    """One scale per ``block x block`` tile of the last two dims (leading dims folded
    into rows). x: [..., R, C] float32 (1-D is treated as one row)."""
    shape = x.shape
    x2 = x.reshape(1, -1) if x.dim() < 2 else x.reshape(-1, shape[-1])  # [R, C]
    r, c = x2.shape
    rp, cp = -(-r // block) * block, -(-c // block) * block
    padded = torch.nn.functional.pad(x2, (0, cp - c, 0, rp - r))  # [Rp, Cp], zeros
    tiles = padded.reshape(rp // block, block, cp // block, block)
    q = cast_scaled(tiles, finite_amax(tiles, dim=(1, 3)), dtype)
    return q.reshape(rp, cp)[:r, :c].reshape(shape)
