"""Real FP8 linear layers: E4M3 operands multiplied by ``torch._scaled_mm`` (``fp8_gemm = "scaled_mm"``).

The emulated FP8 W8A8 path rounds a weight and each token's activation onto the
E4M3 grid (``numerics.quantize_weight`` / ``quantize_activation``: one FP32 scale
per output channel, one per token), casts both to the compute dtype and multiplies
them in it. This path keeps the E4M3 values themselves: the weight is quantized once
on load (per output channel) and stored as ``float8_e4m3fn`` with its FP32 scales,
each input row is quantized per token as it arrives, and ``torch._scaled_mm``
multiplies the two with row-wise scales into bf16, the kernel vLLM's FP8 linear
layers use on Hopper GPUs (``cutlass_scaled_mm``, row-wise). On a GPU the tensor cores
accumulate as they do in production; on a CPU the same call runs oneDNN's reference
path. The operands and scales are bit-identical to the emulation's (the test checks
it), so what differs is accumulation and rounding: what a real FP8 sampler adds.

Shapes: ``_scaled_mm`` wants the reduction dim and the output dim in multiples of 16
(and the rows too on some kernels): both are zero-padded once on load, the rows per
call, and the padding is sliced off (zeros add nothing to a dot product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
_FMAX = torch.finfo(E4M3).max
_TINY = torch.finfo(torch.float32).tiny
ALIGN = 16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``x [R, K]`` -> (E4M3 values ``[R, K]``, FP32 scale ``[R, 1]``): the scale and
    rounding of ``numerics.fp8.cast_scaled`` per row (NaN/inf ignored by the amax), so
    ``q.float() * s`` equals ``quantize_weight(x, "fp8_e4m3")`` / ``quantize_activation``."""
    amax = torch.nan_to_num(x.abs(), nan=0.0, posinf=0.0).amax(dim=-1, keepdim=True)
    s = torch.where(amax > 0, amax / _FMAX, torch.ones_like(amax)).clamp_min(_TINY)
    return (x / s).clamp(-_FMAX, _FMAX).to(E4M3), s


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class ScaledLinear:
    """``y = x @ w.T + b`` with ``w`` [out, in] held as E4M3 plus one FP32 scale per output channel."""

    __slots__ = ("wq", "scale", "bias", "n_in", "n_out", "out_dtype")
    kernel = "scaled_mm"
    packed = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16) -> None:
        w = weight.detach().float()
        self.n_out, self.n_in = w.shape
        wq, s = quantize_rows(w)
        wq = F.pad(wq.view(torch.uint8), (0, _up(self.n_in) - self.n_in, 0, _up(self.n_out) - self.n_out)).view(E4M3)
        self.wq = wq.t()  # [in, out] column-major: the layout _scaled_mm takes for its second operand
        self.scale = F.pad(s, (0, 0, 0, _up(self.n_out) - self.n_out), value=1.0).t().contiguous()  # [1, out]
        self.bias = None if bias is None else bias.to(out_dtype)
        self.out_dtype = out_dtype

    @classmethod
    def fused(cls, parts: list[torch.Tensor], bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16) -> ScaledLinear:
        """One layer over ``parts`` stacked along ``out``: per-channel scales make this the same
        as quantizing each part on its own."""
        return cls(torch.cat([p.float() for p in parts]), bias, out_dtype)

    def to(self, device: torch.device | str) -> ScaledLinear:
        for name in ("wq", "scale", "bias"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.n_in).float()
        rows = x2.shape[0]
        x2 = F.pad(x2, (0, _up(self.n_in) - self.n_in, 0, _up(rows) - rows))
        xq, sx = quantize_rows(x2)
        y = torch._scaled_mm(xq, self.wq, scale_a=sx, scale_b=self.scale, out_dtype=self.out_dtype)
        return y[:rows, : self.n_out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._mm(x)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.n_out)

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``other + x @ w.T + b`` (the residual add, in the compute dtype)."""
        return other + self(x).to(other.dtype)


class ScaledSwiGLU:
    """``silu(x @ gate.T) * (x @ up.T)`` with gate and up in one FP8 GEMM."""

    __slots__ = ("gate_up", "inter")

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> None:
        self.inter = gate.shape[0]
        self.gate_up = ScaledLinear.fused([gate, up], None, out_dtype)

    def to(self, device: torch.device | str) -> ScaledSwiGLU:
        self.gate_up.to(device)
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        return F.silu(gu[..., : self.inter]) * gu[..., self.inter :]
