"""The profile catalogue, user TOML merging, validation and overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from mixrl.sampling.profiles import (
    DEFAULT_PRICE_NOTE,
    Profile,
    get_profile,
    load_profiles,
    with_overrides,
)

# DESIGN.md "Precision profiles (the seed's fleet)": group -> (weights, KV cache)
SEED = {
    "b200-nvfp4": ("nvfp4", "fp8_e4m3"),
    "b300-nvfp4": ("nvfp4", "fp8_e4m3"),
    "h100-fp8": ("fp8_e4m3", "fp8_e4m3"),
    "h200-fp8": ("fp8_e4m3", "fp8_e4m3"),
    "h100-bf16": ("bf16", "fp8_e4m3"),
    "h200-bf16": ("bf16", "fp8_e4m3"),
    "a100-bf16": ("bf16", "fp8_e4m3"),
    "rtxpro6000-bf16": ("bf16", "fp8_e4m3"),
    "b200-bf16": ("bf16", "bf16"),
}


def test_catalogue_has_the_seed_fleet_and_references() -> None:
    profiles = load_profiles()
    builtin = {n for n, p in profiles.items() if p.engine == "builtin"}
    stress = {"stress-b200-nvfp4", "stress-b300-mxfp4", "stress-h100-fp8"}
    w8a8 = {"h100-fp8-w8a8", "h100-fp8-scaled"}  # FP8 W8A8, emulated and real (torch._scaled_mm)
    assert builtin == set(SEED) | {"fp32", "bf16", "fp16"} | stress | w8a8
    assert [profiles[n].fp8_gemm for n in sorted(w8a8)] == ["scaled_mm", "emulated"]
    for name in stress:  # the study's stress fleet: same GPUs and prices, harsher numerics
        p = profiles[name]
        assert p.activation_format != "none" and p.quantize_lm_head and p.price_per_hour > 0
        assert p.relative_throughput == pytest.approx(p.tokens_per_second / 2500)
    vllm = {n for n, p in profiles.items() if p.engine == "vllm"}
    assert {"cpu-vllm-fp32", "cpu-vllm-bf16"} <= vllm  # vllm/profiles.toml ships too
    for name, (weights, kv) in SEED.items():
        p = profiles[name]
        assert (p.name, p.weight_format, p.kv_format) == (name, weights, kv)
        assert p.compute_dtype == "bfloat16" and p.activation_format == "none"
        assert not p.quantize_lm_head and p.price_per_hour > 0
        assert p.price_note == DEFAULT_PRICE_NOTE
        # the documented throughput model: relative to 2500 tok/s of h100-bf16
        assert p.relative_throughput == pytest.approx(p.tokens_per_second / 2500)
    fp32 = profiles["fp32"]
    assert (fp32.weight_format, fp32.kv_format, fp32.compute_dtype) == ("none", "none", "float32")
    assert not fp32.quantizes and profiles["h100-fp8"].quantizes
    assert profiles["bf16"].compute_dtype == "bfloat16"


def test_faster_formats_are_modelled_faster_on_the_same_gpu() -> None:
    p = load_profiles()
    assert p["b200-nvfp4"].tokens_per_second > p["b200-bf16"].tokens_per_second
    assert p["h100-fp8"].tokens_per_second > p["h100-bf16"].tokens_per_second


def test_cost_per_million_tokens_by_hand() -> None:
    p = get_profile("h100-fp8")
    expected = p.price_per_hour / (p.tokens_per_second * 3600.0) * 1e6
    assert p.cost_per_million_tokens == pytest.approx(expected, rel=1e-12)
    assert with_overrides(
        p, price_per_hour=3.6, tokens_per_second=1000
    ).cost_per_million_tokens == (pytest.approx(1.0))


def test_user_toml_file_overrides_fields_and_adds_profiles(tmp_path: Path) -> None:
    f = tmp_path / "fleet.toml"
    f.write_text(
        "[profiles.h100-fp8]\nprice_per_hour = 2.10\n\n"
        '[profiles.l40s-fp8]\naccelerator = "L40S"\nweight_format = "fp8_e4m3_tensor"\n'
        'kv_format = "fp8_e4m3"\nprice_per_hour = 1.2\nrelative_throughput = 0.6\n'
        "tokens_per_second = 1500\n"
    )
    base, merged = load_profiles(), load_profiles(f)
    assert merged["h100-fp8"].price_per_hour == 2.10
    assert merged["h100-fp8"].model_dump(exclude={"price_per_hour"}) == base["h100-fp8"].model_dump(
        exclude={"price_per_hour"}
    )
    assert merged["l40s-fp8"].weight_format == "fp8_e4m3_tensor"
    assert set(merged) == set(base) | {"l40s-fp8"}
    assert get_profile("l40s-fp8", extra=str(f)).accelerator == "L40S"


def test_user_toml_text_is_accepted() -> None:
    p = load_profiles('[profiles.fp32]\ncompute_dtype = "bfloat16"\n')["fp32"]
    assert p.compute_dtype == "bfloat16"


@pytest.mark.parametrize(
    "toml,match",
    [
        ('[profiles.new]\naccelerator = "X"\n', "profile 'new' is invalid.*price_per_hour"),
        ('[profiles.h100-fp8]\nweight_format = "fp5"\n', "weight_format.*'fp5'.*nvfp4"),
        ('[profiles.h100-fp8]\nkv_format = "fp8_e4m3_block128"\n', "kv_format.*weight-only"),
        ('[profiles.h100-fp8]\ncompute_dtype = "int8"\n', "compute_dtype"),
        ("[profiles.h100-fp8]\nprice_per_hour = -1\n", "price_per_hour"),
        ("[profiles.h100-fp8]\nrelative_throughput = 0\n", "relative_throughput"),
        ("[profiles.h100-fp8]\ncolour = 3\n", "colour"),
        ('[profiles.h100-fp8]\nname = "other"\n', "has name = 'other'"),
        ("[fleet]\nx = 1\n", r"expected only \[profiles.NAME\].*fleet"),
        ("[profiles.h100-fp8\n", "cannot parse"),
    ],
)
def test_bad_user_toml_is_rejected_naming_the_field(toml: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_profiles(toml)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_profiles(tmp_path / "nope.toml")


def test_get_profile_lists_known_names() -> None:
    with pytest.raises(ValueError, match="unknown profile 'h800-fp8'.*b200-nvfp4.*fp32"):
        get_profile("h800-fp8")


def test_with_overrides_validates_and_leaves_the_original() -> None:
    p = get_profile("b200-nvfp4")
    cpu = with_overrides(p, compute_dtype="float32")
    assert cpu.compute_dtype == "float32" and p.compute_dtype == "bfloat16"
    assert cpu.model_dump(exclude={"compute_dtype"}) == p.model_dump(exclude={"compute_dtype"})
    with pytest.raises(ValueError, match="compute_dtype"):
        with_overrides(p, compute_dtype="fp8")
    with pytest.raises(ValueError, match="colour"):
        with_overrides(p, colour="red")
    with pytest.raises(ValidationError):
        p.weight_format = "bf16"  # type: ignore[misc]  # profiles are frozen


def test_every_field_is_documented() -> None:
    for name, field in Profile.model_fields.items():
        assert field.description, name
