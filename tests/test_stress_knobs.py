"""Stress-regime knobs: each one changes the numbers the sampler computes with, exactly as
``mixrl.numerics`` says, and the static FP8 KV scale matches a float64 reference."""

from __future__ import annotations

import pytest
import torch

from mixrl import numerics
from mixrl.numerics.kv_static import (
    calibrate_kv_scale,
    calibration_amax,
    kv_hook,
    quantize_kv_static,
)
from mixrl.sampling.builtin.precision import from_profile
from mixrl.sampling.profiles import get_profile, load_profiles, with_overrides

torch.set_num_threads(1)

STRESS = ("stress-b200-nvfp4", "stress-b300-mxfp4", "stress-h100-fp8")


def _e4m3_grid() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    return torch.unique(codes[torch.isfinite(codes)])  # every finite E4M3 value, sorted


def _ref_static(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / s in FP32 (the kernel's arithmetic), saturate at ±448, nearest E4M3 value found in
    float64 over the whole grid, times s (exact in float64, then one rounding to FP32)."""
    grid = _e4m3_grid()
    s32 = float(torch.tensor(scale, dtype=torch.float32))
    y = (x.to(torch.float32) / s32).to(torch.float64).clamp(-448, 448)
    d = (y[..., None] - grid).abs()
    best = d.argmin(dim=-1)
    # a tie (exact midpoint) goes to the even mantissa; random data never ties, asserted below
    srt = d.sort(dim=-1).values
    assert bool((srt[..., 1] - srt[..., 0] > 1e-12 * y.abs().clamp_min(1)).all())
    return (grid[best] * s32).to(torch.float32)


def test_static_kv_matches_float64_reference() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 7, 16, generator=g) * torch.logspace(-3, 1, 16)  # mixed magnitudes
    for scale in (0.011, 1.0):
        got = quantize_kv_static(x, "fp8_e4m3", scale).to(torch.float64)
        assert torch.equal(got, _ref_static(x, scale).to(torch.float64))


def test_static_scale_saturates_and_keeps_nan() -> None:
    x = torch.tensor([1000.0, -1e9, float("inf"), float("nan"), 0.0])
    q = quantize_kv_static(x, "fp8_e4m3", 1.0)
    assert q[:3].tolist() == [448.0, -448.0, 448.0] and torch.isnan(q[3]) and q[4] == 0


def test_static_scale_is_coarser_than_per_token_on_small_rows() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 64, 32, generator=g)
    x[..., 1::2, :] *= 1e-5  # half the tokens fall into E4M3 subnormals under the static scale
    scale = float(x.abs().max()) / 448  # calibrated on the whole tensor, once
    small = x[..., 1::2, :]
    err_static = (quantize_kv_static(x, "fp8_e4m3", scale) - x)[..., 1::2, :].norm() / small.norm()
    err_dyn = (numerics.quantize_kv(x, "fp8_e4m3") - x)[..., 1::2, :].norm() / small.norm()
    assert err_static > 5 * err_dyn


def test_bad_static_scale_and_format() -> None:
    with pytest.raises(ValueError, match="FP8 kv format"):
        kv_hook("nvfp4", 0.01)
    with pytest.raises(ValueError, match="finite number > 0"):
        kv_hook("fp8_e4m3", float("nan"))
    base = get_profile("h100-fp8")
    with pytest.raises(ValueError, match="kv_static_scale needs kv_format"):
        with_overrides(base, kv_format="nvfp4", kv_static_scale=0.01)
    with pytest.raises(ValueError, match="kv_static_scale"):
        with_overrides(base, kv_static_scale=-1.0)


@pytest.mark.parametrize("name", STRESS)
def test_stress_profile_hooks_are_the_numerics_functions(name: str) -> None:
    p = load_profiles()[name]
    prec = from_profile(p)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, 64, generator=g)
    kv = torch.randn(1, 2, 5, 16, generator=g) * 2
    act = torch.randn(5, 64, generator=g) * 3
    assert torch.equal(prec.weight(w), numerics.quantize_weight(w, p.weight_format))
    assert not torch.equal(prec.weight(w), w)
    want_kv = (quantize_kv_static(kv, p.kv_format, p.kv_static_scale) if p.kv_static_scale
               else numerics.quantize_kv(kv, p.kv_format))
    assert prec.kv is not None and torch.equal(prec.kv(kv), want_kv) and not torch.equal(want_kv, kv)
    assert prec.act is not None and p.activation_format != "none"
    assert torch.equal(prec.act(act), numerics.quantize_activation(act, p.activation_format))
    assert not torch.equal(prec.act(act), act)
    assert prec.quantize_lm_head is p.quantize_lm_head is True


def test_fp16_profile_casts_everything() -> None:
    prec = from_profile(get_profile("fp16"))
    x = torch.randn(4, 8, dtype=torch.float32) / 3
    for hook in (prec.weight, prec.kv, prec.act):
        assert torch.equal(hook(x), x.half().float()) and not torch.equal(hook(x), x)


@pytest.fixture(scope="module")
def bundled():
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import resolve

    path = resolve("bundled")
    return path, AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_calibration_amax_is_the_cache_maximum(bundled) -> None:
    _, model = bundled
    prompts = [[1, 5, 9, 12, 40], [3, 3, 7]]
    amax = calibration_amax(model, prompts)
    ref = 0.0
    for ids in prompts:
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
        for layer in cache.layers:
            ref = max(ref, float(layer.keys.detach().abs().max()), float(layer.values.detach().abs().max()))
    assert amax == ref > 0
    assert calibrate_kv_scale(model, prompts) == pytest.approx(ref / 448, rel=1e-12)


def test_engine_static_kv_changes_logprobs(bundled) -> None:
    from mixrl.records.generation import GenerationRequest, SamplingParams
    from mixrl.sampling.factory import make_engine

    path, _ = bundled
    base = with_overrides(get_profile("h100-fp8"), compute_dtype="float32")
    out = {}
    for tag, prof in (("dyn", base), ("static", with_overrides(base, kv_static_scale=0.05))):
        eng = make_engine(str(path), prof, group=tag, seed=0)
        req = [GenerationRequest([1, 5, 9, 12, 40, 7], SamplingParams(
            temperature=1.0, max_new_tokens=8, record="none", seed=11), request_id="0")]
        out[tag] = eng.generate_batch(req)[0]
    a, b = out["dyn"], out["static"]
    n = min(len(a.logprobs), len(b.logprobs))
    assert n > 0 and any(abs(x - y) > 1e-6 for x, y in zip(a.logprobs[:n], b.logprobs[:n], strict=True))
