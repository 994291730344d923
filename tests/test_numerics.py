"""Number formats: exact grids, float64 brute-force references, edge cases, error levels."""

from __future__ import annotations

import pytest
import torch

from mixrl.numerics import (
    FORMATS,
    ROW_FORMATS,
    e2m1_values,
    quantize_activation,
    quantize_kv,
    quantize_weight,
    relative_error,
)
from mixrl.numerics.torchao_ref import torchao_mx

torch.set_num_threads(1)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX v1.0 table 5 magnitudes


def exact(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def nearest_on_grid(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """float64 brute force: the grid value nearest to each x (no ties in random data)."""
    d = (x.double().unsqueeze(-1) - grid.double()).abs()  # [..., G]
    return grid.double()[d.argmin(-1)]


def fp8_grid(dtype: torch.dtype) -> torch.Tensor:
    """All finite values of an FP8 type, enumerated from its 256 bit patterns."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).double()
    return torch.unique(v[torch.isfinite(v)])


def e2m1_grid() -> torch.Tensor:
    mags = torch.tensor(E2M1, dtype=torch.float64)
    return torch.unique(torch.cat([-mags, mags]))


# --- the E2M1 grid -----------------------------------------------------------


def test_e2m1_has_the_15_values_of_the_spec() -> None:
    vals = e2m1_values()
    assert vals.numel() == 15
    exact(vals.double(), e2m1_grid())


def test_mxfp4_block_with_amax_6_lands_on_the_nearest_e2m1_value() -> None:
    # floor(log2 6) - emax(E2M1)=2 -> scale 2^0: elements are rounded onto the grid itself.
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(4, 32, generator=g) * 12 - 6).float()  # [4, 32] in (-6, 6)
    x[:, 0] = 6.0
    q = quantize_weight(x, "mxfp4")
    exact(q.double(), nearest_on_grid(x, e2m1_grid()))
    assert set(q.unique().tolist()) <= set(e2m1_grid().tolist())


def test_e2m1_ties_round_to_even_mantissa() -> None:
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([6.0, 0.25, 0.75, 2.5, 5.0, -1.25])
    q = quantize_weight(x, "mxfp4")[0, :6]
    exact(q, torch.tensor([6.0, 0.0, 1.0, 2.0, 4.0, -1.0]))


# --- float64 brute-force references ------------------------------------------


@pytest.mark.parametrize("dtype,name", [(torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2, "e5m2")])
def test_fp8_layouts_match_brute_force(dtype: torch.dtype, name: str) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(130, 200, generator=g) * torch.linspace(0.01, 3, 200)  # [130, 200]
    grid, fmax = fp8_grid(dtype), torch.finfo(dtype).max

    def ref(amax: torch.Tensor) -> torch.Tensor:
        s = amax.float() / fmax  # the scale is an FP32 number in the kernel too
        return (nearest_on_grid(w.float() / s, grid) * s.double()).float()

    exact(quantize_weight(w, f"fp8_{name}_tensor"), ref(w.abs().amax()))
    exact(quantize_weight(w, f"fp8_{name}_channel"), ref(w.abs().amax(-1, keepdim=True)))
    exact(quantize_weight(w, f"fp8_{name}"), quantize_weight(w, f"fp8_{name}_channel"))
    tile = torch.nn.functional.pad(w.abs(), (0, 56, 0, 126)).reshape(2, 128, 2, 128)
    amax = tile.amax(dim=(1, 3), keepdim=True).expand(2, 128, 2, 128).reshape(256, 256)
    exact(quantize_weight(w, f"fp8_{name}_block128"), ref(amax[:130, :200]))


def test_fp8_with_unit_scale_equals_torch_cast() -> None:
    x = torch.randn(8, 64)
    x[:, 0] = 448.0  # amax 448 -> scale exactly 1
    exact(quantize_weight(x, "fp8_e4m3"), x.to(torch.float8_e4m3fn).float())
    exact(quantize_kv(x, "fp8_e4m3"), x.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("fmt,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_ieee_casts_round_trip_like_torch(fmt: str, dtype: torch.dtype) -> None:
    x = torch.randn(16, 48, dtype=torch.float32) * 3
    exact(quantize_weight(x, fmt), x.to(dtype).float())
    exact(quantize_kv(x, fmt), x.to(dtype).float())
    exact(quantize_weight(x.to(dtype), fmt), x.to(dtype))


def test_mxfp4_matches_brute_force_ocp_reference() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 96, generator=g) * 0.05  # [6, 96] -> 3 blocks per row
    blocks = x.double().reshape(6, 3, 32)
    scale = torch.exp2(torch.floor(torch.log2(blocks.abs().amax(-1, keepdim=True))) - 2)
    ref = nearest_on_grid((blocks / scale).clamp(-6, 6), e2m1_grid()) * scale
    exact(quantize_weight(x, "mxfp4").double(), ref.reshape(6, 96))


def test_nvfp4_matches_brute_force_two_level_reference() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 64, generator=g) * 0.02  # [4, 64] -> 4 blocks of 16 per row
    blocks = x.double().reshape(4, 4, 16)
    outer = blocks.abs().max() / (448.0 * 6.0)
    bscale = nearest_on_grid(
        blocks.abs().amax(-1, keepdim=True) / 6 / outer, fp8_grid(torch.float8_e4m3fn)
    )
    ref = nearest_on_grid((blocks / (bscale * outer)).clamp(-6, 6), e2m1_grid()) * bscale * outer
    torch.testing.assert_close(
        quantize_weight(x, "nvfp4").double(), ref.reshape(4, 64), rtol=1e-6, atol=0
    )


# --- edge cases ---------------------------------------------------------------


def test_saturation() -> None:
    x = torch.tensor([[3.0, float("inf"), -float("inf"), 1.0]])
    q = quantize_kv(x, "fp8_e4m3")  # amax ignores inf -> scale 3/448; inf saturates to ±amax
    exact(q[0, 1:3], torch.tensor([3.0, -3.0]))
    blk = torch.zeros(1, 32)
    blk[0, :2] = torch.tensor([7.0, -7.5])  # floor scaling: scale 1, 7 -> E2M1 max 6
    exact(quantize_weight(blk, "mxfp4")[0, :2], torch.tensor([6.0, -6.0]))


@pytest.mark.parametrize("fmt", [f for f in ROW_FORMATS if f != "none"])
def test_nan_never_becomes_finite_and_stays_in_its_row(fmt: str) -> None:
    x = torch.randn(2, 3, 5, 32)  # [batch, heads, seq, head_dim]
    x[0, 1, 2, 7] = float("nan")
    q = quantize_kv(x, fmt)
    assert torch.isnan(q[0, 1, 2, 7])
    clean = torch.ones_like(x, dtype=torch.bool)
    clean[0, 1, 2] = False
    assert torch.isfinite(q[clean]).all()
    if fmt.startswith("fp8"):  # per-row FP32 scale ignores the NaN: its neighbours survive
        assert torch.isfinite(q[0, 1, 2, torch.arange(32) != 7]).all()


def test_nonfinite_weight_raises() -> None:
    w = torch.randn(4, 32)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_weight(w, "nvfp4")


def test_zero_tensors_stay_zero() -> None:
    for fmt in FORMATS:
        if not FORMATS[fmt].weight_only:
            exact(quantize_kv(torch.zeros(2, 3, 16), fmt), torch.zeros(2, 3, 16))
        exact(quantize_weight(torch.zeros(3, 40), fmt), torch.zeros(3, 40))


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_ragged_last_dim_equals_zero_padded_blocks(fmt: str) -> None:
    x = torch.randn(5, 37)
    padded = torch.nn.functional.pad(x, (0, 64 - 37))
    exact(quantize_weight(x, fmt), quantize_weight(padded, fmt)[:, :37])
    exact(quantize_kv(x, fmt), quantize_kv(padded, fmt)[:, :37])


@pytest.mark.parametrize("fmt", [f for f in ROW_FORMATS if f != "none"])
def test_kv_and_activations_are_per_token(fmt: str) -> None:
    x = torch.randn(3, 2, 4, 32)  # [batch, heads, seq, head_dim]
    q = quantize_kv(x, fmt)
    exact(q[1:2], quantize_kv(x[1:2], fmt))  # batch composition does not matter
    y = x.clone()
    y[0, 0, 0] *= 1000  # one loud token changes no other token
    exact(quantize_kv(y, fmt)[0, 0, 1:], q[0, 0, 1:])
    exact(quantize_activation(x, fmt), q)


def test_dtype_and_shape_preserved() -> None:
    for fmt in FORMATS:
        w = torch.randn(24, 40, dtype=torch.bfloat16)
        q = quantize_weight(w, fmt)
        assert q.dtype == torch.bfloat16 and q.shape == w.shape, fmt
    k = torch.randn(2, 2, 3, 20, dtype=torch.float16)
    assert quantize_kv(k, "nvfp4").dtype == torch.float16


def test_unknown_and_misplaced_formats_raise_listing_names() -> None:
    with pytest.raises(ValueError, match="unknown weight format 'fp9'.*nvfp4"):
        quantize_weight(torch.ones(2, 2), "fp9")
    with pytest.raises(ValueError, match="weight-only.*fp8_e4m3"):
        quantize_kv(torch.ones(2, 2), "fp8_e4m3_block128")
    with pytest.raises(ValueError, match="floating-point"):
        quantize_activation(torch.ones(2, 2, dtype=torch.int64), "fp8_e4m3")


# --- error levels (MEASUREMENTS.md) -------------------------------------------


def test_relative_error_ordering_on_gaussian_weights() -> None:
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(5))
    err = {f: relative_error(w, f) for f in ("bf16", "fp8_e4m3", "nvfp4", "mxfp4")}
    assert err["bf16"] < err["fp8_e4m3"] < err["nvfp4"] < err["mxfp4"]
    assert err["fp8_e4m3"] == pytest.approx(0.026, rel=0.08)
    assert err["nvfp4"] == pytest.approx(0.095, rel=0.05)
    assert err["mxfp4"] == pytest.approx(0.116, rel=0.05)


def test_nvfp4_two_level_scale_keeps_small_weights_accurate() -> None:
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(6))
    small = w * 0.02
    assert relative_error(small, "nvfp4") == pytest.approx(relative_error(w, "nvfp4"), rel=1e-3)
    # one level only (no FP32 outer scale): block scales ~0.005 sit in E4M3 subnormals
    one_level = torchao_mx().NVFP4Tensor.to_nvfp4(small).dequantize(torch.float32)
    err_one = float((one_level - small).norm() / small.norm())
    assert err_one > 1.15 * relative_error(small, "nvfp4")
