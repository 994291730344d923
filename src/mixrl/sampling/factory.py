"""``make_engine``: one entry point from (checkpoint, profile, group) to an ``Engine``.

``profile.engine`` picks the implementation: ``"builtin"`` -> ``BuiltinEngine``
(torch, always available); ``"vllm"`` -> ``VLLMEngine`` from
``mixrl.sampling.vllm.engine``, imported only then, since vLLM is an optional
dependency. Both take the same constructor arguments.

The built-in engine runs any ``AutoModelForCausalLM``: ``forward="auto"`` (default)
takes the hand-fused fast path where it applies (Qwen3, Llama, Mistral, Qwen2) and the generic HF path
otherwise; ``builtin_forward(model_path)`` says which it would pick, and
``make_engine(path, "fp32", group, forward="generic")`` forces one. An evaluator
that needs an engine for any model uses ``make_engine(path, "fp32", group)``.
A model the chosen engine cannot run is refused before loading
(``support.check_architecture``), naming the engines that can.
"""

from __future__ import annotations

from typing import Any

from mixrl.sampling.base import Engine
from mixrl.sampling.builtin.fast import applies


def make_engine(model_path: str, profile: Any, group: str, **kw: Any) -> Engine:
    """Build the engine a profile names. ``profile`` is a ``Profile`` or a profile name;
    ``kw`` (seed, max_batch, max_context, num_threads, ...) go to the engine unchanged."""
    if isinstance(profile, str):
        from mixrl.sampling.profiles import get_profile

        profile = get_profile(profile)
    kind = getattr(profile, "engine", None)
    if kind in ("builtin", "vllm"):
        from mixrl.sampling.support import check_model

        check_model(model_path, (kind,))
    if kind == "builtin":
        from mixrl.sampling.builtin.engine import BuiltinEngine

        return BuiltinEngine(model_path, profile, group, **kw)
    if kind == "vllm":
        try:
            from mixrl.sampling.vllm.engine import VLLMEngine
        except ImportError as e:  # vllm (or its wrapper) missing: say how to get it
            raise RuntimeError(
                f"profile {getattr(profile, 'name', '?')!r} has engine='vllm' but it cannot be "
                f"imported ({e}); install the 'vllm' extra (scripts/install_vllm.sh on CPU)"
            ) from e
        return VLLMEngine(model_path, profile, group, **kw)
    raise ValueError(f"Profile.engine must be 'builtin' or 'vllm', got {kind!r}")


def builtin_forward(model_path: str) -> str:
    """``"fast"`` when the fast path applies to the model at ``model_path``, else ``"generic"``."""
    from transformers import AutoConfig


    return "fast" if applies(AutoConfig.from_pretrained(model_path)) is None else "generic"
