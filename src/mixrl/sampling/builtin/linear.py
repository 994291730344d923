"""Linear layers with weights prepacked once for oneDNN, as CPU inference engines do.

``F.linear`` hands each call to a BLAS GEMM that re-packs the weight every time;
for the small-M GEMMs of decoding (M = live batch rows) that packing costs about
as much as the multiply itself. oneDNN's prepacked path (the kernel that
``torch.compile`` freezing uses on x86) packs once at load instead. Its
summation order differs from BLAS, which is precisely the kind of kernel-level
mismatch a real sampler has (the engine's FP32 log-probs still match HF's full
forward to ~1e-6).

The decode step also uses oneDNN's fused epilogues (``plus``: residual add,
``times``: the SwiGLU product, ``silu``: the gate activation), so the
elementwise ops after a GEMM cost no extra pass over memory.

When packing is unavailable (a torch build without oneDNN, a dtype it does not
take) or its probe (the plain GEMM and each epilogue) disagrees with
``F.linear``, ``PackedLinear`` falls back to ``F.linear`` on the plain weight
(the epilogues then run as separate ops); the choice is visible as ``packed``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The probe's verdict per (shape, dtype, bias dtype, batch hint): it judges the kernels, not the
# values, and probing costs more than packing (every weights load packs every Linear again).
_VERDICTS: dict[tuple[object, ...], bool] = {}


def _pack(w: torch.Tensor, b: torch.Tensor | None, batch_hint: int) -> torch.Tensor | None:
    key = (tuple(w.shape), w.dtype, None if b is None else b.dtype, batch_hint)
    verdict = _VERDICTS.get(key)
    if verdict is False:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
        if verdict:
            return packed
        probe = torch.linspace(-1, 1, 2 * w.shape[1], dtype=w.dtype).view(2, -1)
        other = torch.linspace(-2, 2, 2 * w.shape[0], dtype=w.dtype).view(2, -1)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, b, "none", [], "")
        # the fused epilogues the forward uses must agree too (add, mul, swish)
        got_add = torch.ops.mkldnn._linear_pointwise.binary(probe, other, packed, b, "add")
        got_mul = torch.ops.mkldnn._linear_pointwise.binary(probe, other, packed, b, "mul")
        got_silu = torch.ops.mkldnn._linear_pointwise(probe, packed, b, "swish", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        _VERDICTS[key] = False  # no packing for this dtype in this torch build
        return None
    ref = F.linear(probe, w, b)
    tol = 1e-4 if w.dtype == torch.float32 else 5e-2
    pairs = ((got, ref), (got_add, ref + other), (got_mul, ref * other), (got_silu, F.silu(ref)))
    ok = all(float((g.float() - r.float()).abs().max()) <= tol * (float(r.abs().max()) + 1.0) for g, r in pairs)
    if all(bool(torch.isfinite(r).all()) for _, r in pairs):  # a non-finite weight says nothing of the kernels
        _VERDICTS[key] = ok
    return packed if ok else None


class PackedLinear:
    """``y = x @ w.T + b`` with ``w`` [out, in] in the compute dtype; x [..., in]."""

    __slots__ = ("weight", "bias", "_packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, batch_hint: int = 64) -> None:
        self.bias = bias
        self._packed = _pack(weight.contiguous(), bias, batch_hint)
        # the plain copy is only needed by the fallback: do not hold the weights twice
        self.weight = None if self._packed is not None else weight.contiguous()

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``other + x @ w.T + b`` (a residual add fused into the GEMM's epilogue)."""
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), other, self._packed, self.bias, "add")
        return other + self(x)

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``(x @ w.T + b) * other`` (the SwiGLU product fused into the up projection)."""
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), other, self._packed, self.bias, "mul")
        return self(x) * other

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x @ w.T + b)`` (the activation fused into the gate projection)."""
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self.bias, "swish", [], "")
        return F.silu(self(x))
