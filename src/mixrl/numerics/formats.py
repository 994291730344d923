"""The catalogue of number formats: one name per (element type, scale layout).

Every format is *fake quantization*: a tensor is quantized to the format and
immediately dequantized back to its own dtype, so any torch matmul sees exactly
the values a kernel in that format would see. Names:

| name | element | scales |
|---|---|---|
| ``none`` | unchanged | – |
| ``bf16``, ``fp16`` | IEEE cast | – |
| ``fp8_e4m3``, ``fp8_e5m2`` | FP8 | FP32 per row: per output channel of a weight, per token (and head) of KV / activations |
| ``fp8_e4m3_tensor``, ``fp8_e5m2_tensor`` | FP8 | one FP32 scale per tensor (weights only) |
| ``fp8_e4m3_channel``, ``fp8_e5m2_channel`` | FP8 | FP32 per output channel (weights only; same as the base name there) |
| ``fp8_e4m3_block128``, ``fp8_e5m2_block128`` | FP8 | FP32 per 128x128 tile (weights only, DeepSeek-V3 style) |
| ``mxfp8`` | FP8 E4M3 | E8M0 (power of two) per 32 along the last dim (OCP MX v1.0) |
| ``mxfp4`` | FP4 E2M1 | E8M0 per 32 along the last dim (OCP MX v1.0) |
| ``nvfp4`` | FP4 E2M1 | FP8 E4M3 per 16 along the last dim, times one FP32 outer scale |

To add a format: add a ``FormatSpec`` here and its branch in ``quant.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Scaling = Literal["none", "cast", "row", "tensor", "block128", "mx", "nv"]


@dataclass(frozen=True)
class FormatSpec:
    name: str
    scaling: Scaling  # how scales are laid out (see module table)
    element: str  # element type: "float8_e4m3fn", "float8_e5m2", "e2m1", "bfloat16", ...
    block: int  # elements per scale along the last dim (0 = not block-scaled)
    weight_only: bool  # tensor/channel/tile layouts make no sense for a KV entry or a token
    bits: float  # storage bits per element, scales included (for reports)
    description: str


# (name suffix, scaling, block, weight_only, where the FP32 scales sit)
_FP8_LAYOUTS: list[tuple[str, Scaling, int, bool, str]] = [
    ("", "row", 0, False, "per output channel / per token"),
    ("_tensor", "tensor", 0, True, "one per tensor"),
    ("_channel", "row", 0, True, "per output channel"),
    ("_block128", "block128", 128, True, "per 128x128 tile"),
]


def _fp8(elem: str, short: str) -> list[FormatSpec]:
    return [
        FormatSpec(f"fp8_{short}{suffix}", scaling, elem, block, weight_only, 8.0,
                   f"FP8 {short.upper()}, FP32 scales {where}")
        for suffix, scaling, block, weight_only, where in _FP8_LAYOUTS
    ]  # fmt: skip


def _spec(
    name: str, scaling: Scaling, element: str, block: int, bits: float, desc: str
) -> FormatSpec:
    return FormatSpec(name, scaling, element, block, False, bits, desc)


_ALL: list[FormatSpec] = [
    _spec("none", "none", "", 0, 32.0, "no quantization (keep the input)"),
    _spec("bf16", "cast", "bfloat16", 0, 16.0, "bfloat16 cast"),
    _spec("fp16", "cast", "float16", 0, 16.0, "float16 cast (overflow gives inf, as IEEE)"),
    *_fp8("float8_e4m3fn", "e4m3"),
    *_fp8("float8_e5m2", "e5m2"),
    _spec("mxfp8", "mx", "float8_e4m3fn", 32, 8.25, "MXFP8: E4M3, E8M0 scale per 32"),
    _spec("mxfp4", "mx", "e2m1", 32, 4.25, "MXFP4: E2M1, E8M0 scale per 32"),
    _spec("nvfp4", "nv", "e2m1", 16, 4.5, "NVFP4: E2M1, E4M3 scale per 16 x FP32 outer scale"),
]

FORMATS: dict[str, FormatSpec] = {f.name: f for f in _ALL}
# Formats that can be applied per token (KV cache entries, activations).
ROW_FORMATS: tuple[str, ...] = tuple(f.name for f in _ALL if not f.weight_only)


def get_format(
    name: str, *, what: str = "format", allowed: tuple[str, ...] | None = None
) -> FormatSpec:
    """Look ``name`` up; a clear ValueError listing the known names otherwise."""
    known = allowed if allowed is not None else tuple(FORMATS)
    if name not in known:
        if name in FORMATS:
            raise ValueError(
                f"{what} {name!r} is a weight-only scale layout; use one of: {', '.join(known)}"
            )
        raise ValueError(f"unknown {what} {name!r}; known formats: {', '.join(known)}")
    return FORMATS[name]
