"""The FP32-arithmetic FP8 / NVFP4 rounding is bit-identical to torch's casts and torchao.

``fp8.round_to_grid`` replaces ``.to(float8).float()`` and ``microscaling.nvfp4``
replaces torchao's encode-pack-decode chain (speed only): these compare the two
bit for bit (``view(int32)``), on grid points, ties, random values and the edges
(zeros, subnormals, saturation, ±inf, NaN, tiny and huge magnitudes).
"""

from __future__ import annotations

import pytest
import torch

from mixrl.numerics import fp8, microscaling, quantize_kv, quantize_weight
from mixrl.numerics.torchao_ref import torchao_mx

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(_bits(a)[~nan], _bits(b)[~nan])


def _grid_probe(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of ``dtype``, the midpoints between neighbours (ties), the floats
    just either side of each midpoint, and random values over the whole range."""
    vals = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    vals = torch.unique(vals[torch.isfinite(vals)])  # ascending, ±0 merged
    mid = (vals[1:] + vals[:-1]) / 2  # exact: neighbours differ by one step
    up = torch.nextafter(mid, torch.full_like(mid, float("inf")))
    down = torch.nextafter(mid, torch.full_like(mid, -float("inf")))
    g = torch.Generator().manual_seed(0)
    fmax = torch.finfo(dtype).max
    rnd = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-6, 1e-3, 0.1, 1.0, 30.0, fmax / 4)])
    sub = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-39, -1e-39])  # FP32 subnormals and zeros
    return torch.cat([vals, mid, up, down, rnd.clamp(-fmax, fmax), sub])


@pytest.mark.parametrize("dtype", FP8)
def test_round_to_grid_equals_torch_fp8_cast(dtype: torch.dtype) -> None:
    y = _grid_probe(dtype)
    _same(fp8.round_to_grid(y, *fp8.GRIDS[dtype]), y.to(dtype).float())
    nan = torch.tensor([float("nan"), -float("nan")])
    assert torch.isnan(fp8.round_to_grid(nan, *fp8.GRIDS[dtype])).all()


def _cast_scaled_reference(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp8.cast_scaled`` through torch's cast (the definition)."""
    fmax = torch.finfo(dtype).max
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax)).clamp_min(torch.finfo(torch.float32).tiny)
    return (x / scale).clamp(-fmax, fmax).to(dtype).to(torch.float32) * scale


def _edge_weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 80, generator=g) * 0.02
    rows = torch.randn(8, 48, generator=g)
    rows[0] = 0.0  # an all-zero group
    rows[1] *= 1e-38  # tiny: scales near the FP32 minimum
    rows[2] *= 1e37  # huge
    rows[3, 5] = float("inf")
    rows[4, 7] = -float("inf")
    rows[5, 1] = float("nan")
    rows[6, :24] = 0.0
    tiny = torch.full((2, 32), 1e-40)
    tiny[:, ::3] = 0.0  # NVFP4: 0 · (an infinite reciprocal scale) is NaN, torchao's encoder decides
    return [w, rows, torch.randn(3, 5, 33, generator=g), torch.full((4, 32), 1e-40), tiny, torch.zeros(2, 16)]


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_layouts_equal_the_torch_cast_definition(dtype: torch.dtype) -> None:
    for x in _edge_weights():
        for dim in (-1, None):
            amax = fp8.finite_amax(x, dim=dim)
            _same(fp8.cast_scaled(x, amax, dtype), _cast_scaled_reference(x, amax, dtype))


def _nvfp4_reference(x: torch.Tensor, outer: str) -> torch.Tensor:
    """``microscaling.nvfp4`` through torchao's encoder (the definition)."""
    t = torchao_mx()
    x2, k = microscaling._rows_padded(x, 16)
    if outer == "tensor":
        s = microscaling._outer_scale(fp8.finite_amax(x2).reshape(()))
        q = t.NVFP4Tensor.to_nvfp4(x2, 16, per_tensor_scale=s).dequantize(torch.float32)
    else:
        x3 = x2.unsqueeze(1)
        s = microscaling._outer_scale(fp8.finite_amax(x3, dim=(1, 2)))
        q = t.NVFP4Tensor.to_nvfp4(x3, 16, per_tensor_scale=s).dequantize(torch.float32).squeeze(1)
    return q[:, :k].reshape(x.shape)


def test_nvfp4_grid_path_is_taken_unless_a_scaled_element_is_nan() -> None:
    w = torch.randn(32, 64)
    blocks = w.abs().view(32, 4, 16).amax(-1)
    assert microscaling._nvfp4_grid(w, blocks, microscaling._outer_scale(blocks.amax()), 16) is not None
    w[3, 4] = float("nan")
    assert microscaling._nvfp4_grid(w, blocks, torch.tensor(0.01), 16) is None


@pytest.mark.parametrize("outer", ["tensor", "row"])
def test_nvfp4_equals_torchao_bit_for_bit(outer: str) -> None:
    g = torch.Generator().manual_seed(2)
    cases = [*_edge_weights(), torch.randn(384, 128, generator=g) * 0.03, torch.randn(1, 7, generator=g),
             _grid_probe(torch.float8_e4m3fn)[:4096].reshape(64, 64)]
    # scaled elements exactly on E2M1 ties: a block of amax 6 holds 0.25, 0.75, ..., 5
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2)
    cases += [ties.reshape(1, 16), -ties.reshape(1, 16)]
    for x in cases:
        _same(microscaling.nvfp4(x, outer=outer), _nvfp4_reference(x, outer))


def test_public_functions_still_match_their_reference() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=g) * 0.05
    _same(quantize_weight(w, "nvfp4"), _nvfp4_reference(w, "tensor"))
    k = torch.randn(2, 4, 5, 32, generator=g)
    _same(quantize_kv(k, "nvfp4"), _nvfp4_reference(k, "row"))
    _same(quantize_weight(w, "fp8_e4m3"), _cast_scaled_reference(w, fp8.finite_amax(w, -1), torch.float8_e4m3fn))
