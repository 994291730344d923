"""Precision / accelerator profiles: what numbers one sampler group computes with.

A profile names the formats an engine applies when it loads the trainer's
weights (``weight_format``), writes its KV cache (``kv_format``) and, optionally,
feeds activations to its matmuls (``activation_format``), the dtype its matmuls
run in, and what one GPU of that kind costs and delivers. The catalogue lives
in ``profiles.toml`` next to this file; a user TOML with the same
``[profiles.NAME]`` layout merges over it:

    [profiles.h100-fp8]        # known name: override only these fields
    price_per_hour = 2.10

    [profiles.l40s-fp8]        # new name: a complete profile
    accelerator = "L40S"
    weight_format = "fp8_e4m3"
    ...

    profiles = load_profiles("my_fleet.toml")
    p = get_profile("b200-nvfp4")
    cpu = with_overrides(p, compute_dtype="float32")   # quantized weights, FP32 matmuls

Format names are those of ``mixrl.numerics.FORMATS``.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mixrl.numerics.formats import ROW_FORMATS, get_format

DEFAULT_PRICE_NOTE = "default: approximate public on-demand list price (USD per GPU-hour); edit it"


class Profile(BaseModel):
    """One sampler group's precision, engine, accelerator, price and throughput."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        pattern=r"^[a-z0-9][a-z0-9._-]*$",
        max_length=64,
        description="profile name, also the default sampler-group name (lowercase, no spaces)",
    )
    accelerator: str = Field(
        min_length=1, max_length=64, description="accelerator this profile models, e.g. 'H100 SXM'"
    )
    engine: Literal["builtin", "vllm"] = Field(
        "builtin", description="inference engine: the built-in torch engine or vLLM"
    )
    weight_format: str = Field(
        "none", description="format the weights are quantized to on load (numerics.FORMATS)"
    )
    kv_format: str = Field(
        "none", description="format of KV-cache entries, per token and head (numerics.ROW_FORMATS)"
    )
    activation_format: str = Field(
        "none", description="dynamic per-token format of Linear inputs; 'none' keeps them"
    )
    kv_static_scale: float | None = Field(
        None, gt=0, le=1e6,
        description="one static FP32 scale for every KV-cache entry (FP8 kv_format, built-in "
        "engine), calibrated once as serving stacks do (numerics.kv_static); None = dynamic "
        "per-token scales",
    )
    compute_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="dtype the matmuls and attention run in"
    )
    quantize_lm_head: bool = Field(
        False, description="also quantize lm_head (real FP4 deployments often keep it BF16)"
    )
    fp8_gemm: Literal["emulated", "scaled_mm"] = Field(
        "emulated",
        description="built-in engine, FP8 W8A8 (weight and activation fp8_e4m3): 'emulated' multiplies "
        "the fake-quantized operands in the compute dtype; 'scaled_mm' keeps them in E4M3 and multiplies "
        "them with torch._scaled_mm (row-wise scales, bf16 out), the real FP8 GEMM of a GPU",
    )
    price_per_hour: float = Field(
        ge=0, le=1000, description="USD per GPU-hour, used by the cost model"
    )
    price_note: str = Field(
        DEFAULT_PRICE_NOTE, max_length=300, description="where the price comes from"
    )
    relative_throughput: float = Field(
        gt=0,
        le=1000,
        description="generated tokens/s relative to the h100-bf16 reference (router capacity)",
    )
    tokens_per_second: float = Field(
        gt=0, le=1e7, description="modelled decode tokens/s of one GPU (cost model)"
    )
    max_batch_tokens: int | None = Field(
        None, ge=2, le=1 << 30,
        description="built-in engine: token budget of one decoded batch (rows x context), bounding "
        "its KV cache whatever the number of sessions; None = max_batch rows only",
    )
    kv_retain_bytes: int = Field(
        64 << 20, ge=0, le=1 << 40,
        description="built-in engine: bytes of sessions' KV kept between their requests (least "
        "recently used dropped first), so a next turn prefills only its new tokens; 0 = none",
    )
    kv_reuse_across_versions: bool = Field(
        False,
        description="built-in engine: reuse a session's kept KV after a weights update (else it is "
        "dropped); its tokens are counted per result as reused_stale_tokens, a mismatch it adds",
    )

    @field_validator("weight_format")
    @classmethod
    def _weight_format(cls, v: str) -> str:
        get_format(v, what="Profile.weight_format")
        return v

    @field_validator("kv_format", "activation_format")
    @classmethod
    def _row_format(cls, v: str, info: Any) -> str:
        get_format(v, what=f"Profile.{info.field_name}", allowed=ROW_FORMATS)
        return v

    @model_validator(mode="after")
    def _static_kv(self) -> Profile:
        if self.kv_static_scale is not None:
            from mixrl.numerics.kv_static import STATIC_KV_FORMATS

            if self.kv_format not in STATIC_KV_FORMATS:
                raise ValueError(f"kv_static_scale needs kv_format in {sorted(STATIC_KV_FORMATS)}, "
                                 f"got kv_format={self.kv_format!r}")
            if self.engine != "builtin":
                raise ValueError("kv_static_scale is emulated by the built-in engine only "
                                 f"(engine={self.engine!r})")
        return self

    @model_validator(mode="after")
    def _real_fp8(self) -> Profile:
        if self.fp8_gemm == "scaled_mm":
            need = {"engine": "builtin", "weight_format": "fp8_e4m3", "activation_format": "fp8_e4m3",
                    "compute_dtype": "bfloat16", "quantize_lm_head": False}
            bad = [f"{k}={getattr(self, k)!r}" for k, v in need.items() if getattr(self, k) != v]
            if bad:
                raise ValueError("fp8_gemm='scaled_mm' needs " + ", ".join(f"{k}={v!r}" for k, v in need.items())
                                 + f"; got {', '.join(bad)}")
        return self

    @property
    def quantizes(self) -> bool:
        """True when any format changes the numbers (not a pure reference profile)."""
        return any(
            f != "none" for f in (self.weight_format, self.kv_format, self.activation_format)
        )

    @property
    def cost_per_million_tokens(self) -> float:
        """USD per 1e6 generated tokens at the modelled throughput."""
        return self.price_per_hour / (self.tokens_per_second * 3600) * 1e6


def _explain(e: ValidationError) -> str:
    """One line per bad field: 'field: message (got value)'."""
    parts = []
    for err in e.errors():
        field = ".".join(str(x) for x in err["loc"]) or "profile"
        got = "" if err["type"] == "missing" else f" (got {err['input']!r})"
        parts.append(f"{field}: {err['msg']}{got}")
    return "; ".join(parts)


def _read_toml(source: str | Path) -> tuple[dict[str, Any], str]:
    """A Path, a str naming a file (or ending in .toml) is read; other strs are TOML text."""
    if isinstance(source, Path) or Path(source).suffix == ".toml" or Path(source).is_file():
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"profiles file {str(path)!r} does not exist")
        text, where = path.read_text(), str(path)
    else:
        text, where = source, "<profiles TOML text>"
    try:
        return tomllib.loads(text), where
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"cannot parse {where}: {e}") from e


def _tables(doc: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    unknown = [k for k in doc if k != "profiles"]
    if unknown or not isinstance(doc.get("profiles", {}), dict):
        raise ValueError(f"{where}: expected only [profiles.NAME] tables, found keys {unknown}")
    tables = doc.get("profiles", {})
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ValueError(f"{where}: profiles.{name} must be a table, got {table!r}")
        if table.get("name", name) != name:
            raise ValueError(f"{where}: profiles.{name} has name = {table['name']!r}")
    return tables


def load_profiles(extra_toml: str | Path | None = None) -> dict[str, Profile]:
    """The catalogue, with ``extra_toml`` (a file or TOML text) merged over it."""
    merged: dict[str, dict[str, Any]] = {}
    # The shipped catalogue: the built-in engine's profiles and the vLLM ones.
    for pkg, fname in (("mixrl.sampling", "profiles.toml"), ("mixrl.sampling.vllm", "profiles.toml")):
        text = resources.files(pkg).joinpath(fname).read_text()
        merged.update(_tables(tomllib.loads(text), f"{pkg.replace('.', '/')}/{fname}"))
    if extra_toml is not None:
        for name, table in _tables(*_read_toml(extra_toml)).items():
            merged[name] = {**merged.get(name, {}), **table}
    out: dict[str, Profile] = {}
    for name, table in merged.items():
        try:
            out[name] = Profile.model_validate({**table, "name": name})
        except ValidationError as e:
            raise ValueError(f"profile {name!r} is invalid: {_explain(e)}") from e
    return out


def get_profile(name: str, extra: str | Path | None = None) -> Profile:
    """One profile by name; a ValueError listing the known names otherwise."""
    profiles = load_profiles(extra)
    if name not in profiles:
        raise ValueError(f"unknown profile {name!r}; known profiles: {', '.join(profiles)}")
    return profiles[name]


def with_overrides(profile: Profile, **changes: Any) -> Profile:
    """A validated copy with some fields changed, e.g. ``compute_dtype="float32"`` for
    CPU runs (BF16 matmuls are several times slower than FP32 on CPUs without
    native BF16), keeping the profile's quantized weights and KV cache."""
    try:
        return Profile.model_validate({**profile.model_dump(), **changes})
    except ValidationError as e:
        raise ValueError(f"invalid override of profile {profile.name!r}: {_explain(e)}") from e


__all__ = ["Profile", "load_profiles", "get_profile", "with_overrides", "DEFAULT_PRICE_NOTE"]
