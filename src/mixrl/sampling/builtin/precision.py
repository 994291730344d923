"""What a precision profile means to the built-in engine: four hooks and a dtype.

A profile (``mixrl.sampling.profiles.Profile``) names formats; this module
turns them into callables once, so the forward pass never branches on names:

- ``weight(w)``      fake-quantizes one Linear weight on load (``numerics.quantize_weight``);
- ``kv(x)``          fake-quantizes keys/values as they are written to the cache,
                     ``x`` shaped ``[..., head_dim]`` (``numerics.quantize_kv``);
- ``act(x)``         fake-quantizes the input of a Linear, ``x`` shaped ``[..., in]``
                     (``numerics.quantize_activation``), or ``None`` when off;
- ``dtype``          the compute dtype; the cache is stored in it after ``kv``;
- ``scaled_mm``      FP8 W8A8 on real E4M3 operands (``linear_fp8``): then ``weight`` and
                     ``act`` are identities, the layers quantize their own operands.

Identity formats ("fp32"/"float32"/"none"/None) skip ``mixrl.numerics`` entirely,
so the FP32 engine works without it; every other name goes to ``numerics``, which
raises on a name it does not know (the error names the format).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_IDENTITY = {None, "", "none", "fp32", "float32"}

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}

Hook = Callable[[torch.Tensor], torch.Tensor]


def compute_dtype(name: Any) -> torch.dtype:
    """``Profile.compute_dtype`` (a name or a ``torch.dtype``) -> ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"Profile.compute_dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[key]


def _is_identity(fmt: Any) -> bool:
    return fmt is None or str(fmt).lower() in _IDENTITY


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype
    weight: Hook  # Linear weights, on load
    kv: Hook | None  # keys/values on cache write; None = stored as computed
    act: Hook | None  # Linear inputs; None = off
    quantize_lm_head: bool
    describe: str  # one line for logs and bench JSON
    scaled_mm: bool = False  # Linear layers are linear_fp8.ScaledLinear (Profile.fp8_gemm)


def from_profile(profile: Any) -> Precision:
    """Resolve a profile's formats into hooks (imports ``mixrl.numerics`` only when needed)."""
    wf = getattr(profile, "weight_format", None)
    kf = getattr(profile, "kv_format", None)
    af = getattr(profile, "activation_format", None)
    dtype = compute_dtype(getattr(profile, "compute_dtype", "float32"))

    def identity(w: torch.Tensor) -> torch.Tensor:
        return w

    weight: Hook = identity
    kv: Hook | None = None
    act: Hook | None = None
    scaled_mm = getattr(profile, "fp8_gemm", "emulated") == "scaled_mm"
    label = f"weights={wf} kv={kf}{'' if getattr(profile, 'kv_static_scale', None) is None else '@static'} act={af}"
    if scaled_mm:  # the layers hold E4M3 operands themselves (Profile checks the formats)
        wf, af, label = "none", "none", label + " gemm=scaled_mm"
    if not (_is_identity(wf) and _is_identity(kf) and _is_identity(af)):
        from mixrl import numerics  # lazily: the FP32 engine does not need it

        if not _is_identity(wf):
            weight = lambda w: numerics.quantize_weight(w, str(wf))  # noqa: E731
        if not _is_identity(kf):
            from mixrl.numerics.kv_static import kv_hook  # static scale: one per cache

            kv = kv_hook(str(kf), getattr(profile, "kv_static_scale", None))
        if not _is_identity(af):
            act = lambda x: numerics.quantize_activation(x, str(af))  # noqa: E731
    return Precision(
        dtype=dtype,
        weight=weight,
        kv=kv,
        act=act,
        quantize_lm_head=bool(getattr(profile, "quantize_lm_head", False)),
        scaled_mm=scaled_mm,
        describe=f"{label} compute={dtype} lm_head_q={getattr(profile, 'quantize_lm_head', False)}",
    )
