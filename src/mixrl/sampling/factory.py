"""``make_engine``: one entry point from (checkpoint, profile, group) to an ``Engine``.

``profile.engine`` picks the implementation: ``"builtin"`` -> ``BuiltinEngine``
(torch, always available); ``"vllm"`` -> ``VLLMEngine`` from
``mixrl.sampling.vllm.engine``, imported only then, since vLLM is an optional
dependency. Both take the same constructor arguments.
"""

from __future__ import annotations

from typing import Any

from mixrl.sampling.base import Engine


def make_engine(model_path: str, profile: Any, group: str, **kw: Any) -> Engine:
    """Build the engine a profile names. ``profile`` is a ``Profile`` or a profile name;
    ``kw`` (seed, max_batch, max_context, num_threads, ...) go to the engine unchanged."""
    if isinstance(profile, str):
        from mixrl.sampling.profiles import get_profile

        profile = get_profile(profile)
    kind = getattr(profile, "engine", None)
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
