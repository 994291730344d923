"""Linear layers with weights laid out once for the GEMM that serves them, as CPU inference engines do.

FP32: ``torch.mm`` (MKL sgemm) on the weight stored transposed, ``[in, out]``
contiguous, so no call transposes or re-lays it; the residual add rides in the
GEMM's accumulator (``addmm``, beta = 1). At decode shapes (M = 64 rows, the
reference model) this is the fastest of the kernels torch offers on an AVX2 core
(the 21 GEMMs of one decode step, CPU time side by side at load ~8: MKL mm on
the transposed weight 8.5 ms, oneDNN prepacked 11.5, ``F.linear`` 10.5).

Other compute dtypes:

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

``kernel`` says which runs: ``"mkl"`` (FP32), ``"onednn"``, or ``"plain"`` (``F.linear``:
also every weight on an accelerator, where the vendor's GEMM library needs no packing).
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

FP32_KERNEL = "mkl"  # "mkl" | "onednn": the FP32 GEMM (see the module doc)


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

    __slots__ = ("weight", "bias", "_packed", "_wt", "kernel")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, batch_hint: int = 64) -> None:
        self.bias = bias
        self._packed = self._wt = self.weight = None
        if weight.device.type != "cpu":  # an accelerator's own GEMMs
            self.weight, self.kernel = weight.contiguous(), "plain"
            return
        if weight.dtype == torch.float32 and FP32_KERNEL == "mkl":
            self._wt = weight.t().contiguous()  # [in, out]: sgemm reads it without transposing
            self.kernel = "mkl"
            return
        self._packed = _pack(weight.contiguous(), bias, batch_hint)
        # the plain copy is only needed by the fallback: do not hold the weights twice
        self.weight = None if self._packed is not None else weight.contiguous()
        self.kernel = "onednn" if self._packed is not None else "plain"

    @classmethod
    def fused(cls, parts: list[torch.Tensor], bias: torch.Tensor | None = None, batch_hint: int = 64) -> PackedLinear:
        """One Linear over ``parts`` stacked along ``out`` (q, k, v: one GEMM). The result owns
        its memory (the parts may be views of a mapped file or of the trainer's tensors): MKL's
        ``[in, out]`` layout is one transposing copy of the stacked parts (a memcpy ``cat``
        first when there are several: together faster than ``cat`` of transposed views)."""
        if parts[0].dtype == torch.float32 and FP32_KERNEL == "mkl" and parts[0].device.type == "cpu":
            self = cls.__new__(cls)
            self.bias, self._packed, self.weight, self.kernel = bias, None, None, "mkl"
            stacked = parts[0] if len(parts) == 1 else torch.cat(parts)  # a contiguous copy: a plain memcpy
            wt = stacked.t().contiguous()  # [in, sum(out)]: torch's blocked transpose
            if wt.untyped_storage().data_ptr() == parts[0].untyped_storage().data_ptr():
                wt = wt.clone()  # one row or column: already contiguous, still the caller's memory
            self._wt = wt
            return self
        return cls(torch.cat(parts), bias, batch_hint)  # cat copies, even one part

    def transposed(self) -> torch.Tensor | None:
        """The weight as MKL's ``[in, out]`` copy (read-only by convention), None in another layout."""
        return self._wt

    @property
    def packed(self) -> bool:
        return self.kernel != "plain"

    def _mm(self, x: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
        """MKL: ``acc + x @ wt (+ b)`` on 2-D views, reshaped back to x's leading dims."""
        wt = self._wt
        assert wt is not None
        x2 = x.reshape(-1, x.shape[-1])
        if acc is None:
            y = torch.mm(x2, wt) if self.bias is None else torch.addmm(self.bias, x2, wt)
        else:
            y = torch.addmm(acc.reshape(-1, wt.shape[1]), x2, wt)
            if self.bias is not None:
                y.add_(self.bias)
        return y.view(*x.shape[:-1], wt.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._wt is not None:
            return self._mm(x, None)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``other + x @ w.T + b`` (a residual add fused into the GEMM: its epilogue or accumulator)."""
        if self._wt is not None:
            return self._mm(x, other)
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


class SwiGLU:
    """``silu(x @ gate.T) * (x @ up.T)``, both [I, H]: with MKL one GEMM over the stacked
    [2I, H] weight, then silu and the product in place on its two halves; otherwise two
    GEMMs with the activation and the product in their epilogues."""

    __slots__ = ("gate_up", "gate", "up", "inter")

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, batch_hint: int = 64) -> None:
        self.inter = gate.shape[0]
        self.gate_up = self.gate = self.up = None
        if (gate.dtype == torch.float32 and FP32_KERNEL == "mkl") or gate.device.type != "cpu":
            self.gate_up = PackedLinear.fused([gate, up], None, batch_hint)
        else:  # oneDNN: the activation and the product ride in the GEMMs' epilogues
            self.gate = PackedLinear.fused([gate], None, batch_hint)
            self.up = PackedLinear.fused([up], None, batch_hint)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gu = self.gate_up(x)
            g, u = gu[..., : self.inter], gu[..., self.inter :]
            return u.mul_(F.silu(g, inplace=True))  # [..., I] view; HF's order: silu, then the product
        assert self.gate is not None and self.up is not None
        return self.up.times(x, self.gate.silu(x))
