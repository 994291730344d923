"""Which engines can run a model's architecture, checked before anything starts.

- ``builtin``: any decoder ``transformers`` builds with ``AutoModelForCausalLM``
  (the config's class is in ``MODEL_FOR_CAUSAL_LM_MAPPING``) and that is not an
  encoder-decoder; Qwen3, Llama, Mistral and Qwen2 take the fast path, the rest the generic one.
- ``vllm``: ``config.architectures[0]`` is one of vLLM's text-generation models
  (its registry; importing vLLM happens only when a vLLM group asks).

``check_architecture`` raises ``UnsupportedArchitectureError`` (a ``ValueError``)
with one line naming the architecture, the engine that cannot run it and the
engines that can.
"""

from __future__ import annotations

from typing import Any

from mixrl.config import ConfigError

ENGINES = ("builtin", "vllm")


class UnsupportedArchitectureError(ValueError):
    pass


def _arch(cfg: Any) -> str:
    archs = getattr(cfg, "architectures", None) or []
    return archs[0] if archs else type(cfg).__name__.removesuffix("Config") + " (no config.architectures)"


def builtin_reason(cfg: Any) -> str | None:
    """None when the built-in engine can run ``cfg``, else why not."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if getattr(cfg, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if type(cfg) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return f"AutoModelForCausalLM has no class for model_type {getattr(cfg, 'model_type', '?')!r}"
    return None


def vllm_reason(cfg: Any) -> str | None:
    """None when vLLM lists the architecture as a text-generation model, else why not."""
    try:
        from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS
    except ImportError as e:
        return f"vllm is not importable ({e})"
    archs = getattr(cfg, "architectures", None) or []
    if not archs:
        return "config.architectures is empty"
    if archs[0] not in _TEXT_GENERATION_MODELS:
        return "not one of vLLM's text-generation models"
    return None


REASONS = {"builtin": builtin_reason, "vllm": vllm_reason}


def check_architecture(cfg: Any, engines: set[str] | list[str] | tuple[str, ...]) -> None:
    """Raise for the first engine in ``engines`` that cannot run ``cfg``."""
    for eng in engines:
        why = REASONS[eng](cfg)
        if why is None:
            continue
        can = [e for e in ENGINES if e != eng and REASONS[e](cfg) is None]
        raise UnsupportedArchitectureError(
            f"model architecture {_arch(cfg)} (model_type {getattr(cfg, 'model_type', '?')!r}) cannot run on "
            f"engine {eng!r}: {why}; engines that can run it: {', '.join(can) or 'none'}"
        )


def check_builtin(cfg: Any) -> None:
    check_architecture(cfg, ("builtin",))


def check_model(model_path: str, engines: set[str] | list[str] | tuple[str, ...]) -> None:
    """``check_architecture`` on the config at ``model_path`` (what a run calls at start-up)."""
    from transformers import AutoConfig

    check_architecture(AutoConfig.from_pretrained(model_path), engines)


def check_fleet(model_path: str, profiles: Any, routing_replay: bool = False) -> None:
    """At run start-up: every group's engine can run the model, else ``ConfigError`` naming
    the group, the architecture and the engines that can (``profiles``: group -> Profile).
    With ``routing_replay`` on a MoE model, every group must record routing: a vLLM group
    where vLLM cannot return routed experts is refused, saying why."""
    from transformers import AutoConfig


    cfg = AutoConfig.from_pretrained(model_path)
    moe = bool(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None))
    for group, prof in profiles.items():
        where = f"fleet.groups[{group!r}].profile: {getattr(prof, 'name', prof)!r}"
        engine = getattr(prof, "engine", "builtin")
        try:
            check_architecture(cfg, (engine,))
        except UnsupportedArchitectureError as e:
            raise ConfigError(f"{where}: {e}") from None
        if routing_replay and moe and engine == "vllm":
            from mixrl.sampling.vllm.formats import detect_platform
            from mixrl.sampling.vllm.outputs import routing_problem

            why = routing_problem(detect_platform().kind)
            if why:
                raise ConfigError(f"loss.routing_replay=true: {where} cannot record MoE routing: {why}; "
                                  "use built-in groups or loss.routing_replay=false")  # fmt: skip
