"""Checkpoints and trainer weights for a vLLM engine: model sizes, name checks, dtypes,
versioned directories.

A vLLM engine takes new weights in one of two ways (``VLLMEngine.load_weights``):

- in its own process: an iterator of ``(HF name, tensor)`` handed to vLLM's
  in-place ``reload_weights`` (``prepared``);
- in a separate engine process: a directory ``ROOT/v{version}`` holding
  ``model.safetensors`` and the checkpoint's ``config.json``, which the engine
  reloads from (``write_version_dir``). A version directory appears whole or
  not at all: it is written aside (``ROOT/.v{version}.tmp-*``), flushed, then
  renamed, so an engine never reads a half-written version. Versions are
  immutable: writing an existing version again returns the existing directory.

Example: ``write_version_dir("/tmp/w", 3, sd, "/models/policy")`` -> ``/tmp/w/v3``;
``prune_versions("/tmp/w", keep=2)`` then leaves the two newest ``v*``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

_CONFIG_FILES = ("config.json", "generation_config.json")


def model_shape(model_path: str) -> dict[str, Any]:
    """The sizes the engine needs from an HF directory's config.json."""
    cfg_file = Path(model_path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"model_path {model_path!r} is not an HF model directory (no config.json)"
        )
    cfg = json.loads(cfg_file.read_text())
    heads = cfg["num_attention_heads"]
    return {
        "vocab": int(cfg["vocab_size"]),
        "layers": int(cfg["num_hidden_layers"]),
        "kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        "max_positions": int(cfg.get("max_position_embeddings", 2048)),
        "tied": bool(cfg.get("tie_word_embeddings", False)),
    }


def eos_ids(model_path: str) -> frozenset[int]:
    """EOS ids from generation_config.json, else config.json (as the built-in engine)."""
    for name in ("generation_config.json", "config.json"):
        f = Path(model_path) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return frozenset([eos] if isinstance(eos, int) else eos)
    return frozenset()


def checkpoint_names(model_path: str | Path) -> frozenset[str]:
    """Tensor names stored in an HF directory's safetensors files (headers only)."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {str(model_path)!r}")
    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names.update(st.keys())
    return frozenset(names)


def read_checkpoint(model_path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory's safetensors files."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def check_names(state_dict: Mapping[str, Any], expected: frozenset[str], tied: bool) -> None:
    """Raise ValueError when ``state_dict`` misses a checkpoint tensor or has an unknown one.

    vLLM only warns about weights it did not load; a partial update would mix two
    versions in one model, so it is refused here. ``lm_head.weight`` is accepted
    (and ignored by vLLM) when the embeddings are tied; rotary caches are ignored.
    """
    names = {n for n in state_dict if "rotary_emb.inv_freq" not in n}
    missing = sorted(expected - names)
    unknown = sorted(names - expected - ({"lm_head.weight"} if tied else set()))
    if missing or unknown:
        raise ValueError(
            f"state_dict does not match the engine's checkpoint: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unknown {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
        )


def prepared(
    state_dict: Mapping[str, Any], dtype: torch.dtype, round_to: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` on CPU in the engine dtype; floating tensors first rounded to
    ``round_to`` when the profile stores weights narrower than it computes (bf16
    weights, fp32 matmuls). vLLM quantizes further (fp8, int8) inside its loader."""
    for name, t in state_dict.items():
        x = t.detach().to("cpu")
        if x.is_floating_point():
            if round_to is not None:
                x = x.to(round_to)
            x = x.to(dtype)
        yield name, x


def write_version_dir(
    root: str | Path, version: int, state_dict: Mapping[str, Any], config_from: str | Path
) -> Path:
    """Write ``root/v{version}`` (safetensors + config) atomically and return it."""
    from safetensors.torch import save_file

    root = Path(root)
    final = root / f"v{version}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".v{version}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        seen: set[int] = set()
        tensors: dict[str, torch.Tensor] = {}
        for name, t in state_dict.items():
            x = t.detach().to("cpu").contiguous()
            if x.data_ptr() in seen:  # tied tensors share storage; safetensors refuses that
                x = x.clone()
            seen.add(x.data_ptr())
            tensors[name] = x
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name in _CONFIG_FILES:
            if (Path(config_from) / name).is_file():
                shutil.copy2(Path(config_from) / name, tmp / name)
        (tmp / "mixrl_version.json").write_text(json.dumps({"version": version}))
        for f in tmp.iterdir():  # flush before the rename makes the version visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        try:
            os.rename(tmp, final)
        except OSError:  # another writer published the same immutable version first
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def prune_versions(root: str | Path, keep: int = 2) -> None:
    """Delete all but the ``keep`` newest ``root/v*`` directories."""
    dirs = sorted(
        (p for p in Path(root).glob("v*") if p.is_dir() and p.name[1:].isdigit()),
        key=lambda p: int(p.name[1:]),
    )
    for p in dirs[: max(0, len(dirs) - keep)]:
        shutil.rmtree(p, ignore_errors=True)


def is_moe(model_path: str) -> bool:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return bool(cfg.get("num_experts") or cfg.get("num_local_experts"))


# transformers keeps a MoE layer's experts as two stacked tensors (``experts.gate_up_proj``
# [E, 2I, H]: gate rows then up rows; ``experts.down_proj`` [E, H, I]); checkpoints, and
# vLLM's loader, name one matrix per expert. Per-expert names for each stacked tensor:
_EXPERT_NAMES = (
    ("gate_proj", "up_proj", "down_proj"),
    ("w1", "w3", "w2"),
)  # Qwen/DeepSeek, Mixtral


def per_expert(state_dict: Mapping[str, Any], expected: frozenset[str]) -> Mapping[str, Any]:
    """The trainer's stacked expert tensors split into the checkpoint's per-expert names
    (``expected``); every other tensor as it is. Without stacked experts: ``state_dict``."""
    stacked = [n for n in state_dict if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    if not stacked:
        return state_dict
    out = {n: t for n, t in state_dict.items() if n not in stacked}
    for name in stacked:
        prefix, kind = name.rsplit(".", 1)
        t = state_dict[name]
        gate, up, down = next(
            (g for g in _EXPERT_NAMES if f"{prefix}.0.{g[0]}.weight" in expected), _EXPERT_NAMES[0]
        )
        for e in range(t.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{e}.{down}.weight"] = t[e]
            else:
                g, u = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.{gate}.weight"], out[f"{prefix}.{e}.{up}.weight"] = g, u
    return out


def dense_layer_methods(llm: Any) -> dict[str, list[str]]:
    """What vLLM applied to the model's dense linear layers, read back from the loaded
    model (not the option passed in): their quantization method classes and weight dtypes
    (MoE experts and the embeddings are not linear layers here)."""
    return llm.apply_model(_dense_methods)[0]


def _dense_methods(model: Any) -> dict[str, list[str]]:
    from vllm.model_executor.layers.linear import LinearBase

    found = [m for name, m in model.named_modules() if isinstance(m, LinearBase) and "lm_head" not in name]
    return {"methods": sorted({type(m.quant_method).__name__ for m in found}),
            "weight_dtypes": sorted({str(m.weight.dtype) for m in found if hasattr(m, "weight")}),
            "layers": [str(len(found))]}


def refresh_tied(model: Any) -> list[str]:
    """After an in-place reload: redo the kernel preparation of layers whose weight is another
    layer's (a tied ``lm_head``), which vLLM's layer-wise reload never processes, since no
    checkpoint tensor names them. vLLM's CPU GEMMs pack each weight once (oneDNN / AMX
    layouts, ``layer.cpu_linear``): without this the tied head keeps multiplying by the packed
    copy of the *old* embedding, and every logit is computed with stale weights while the
    embedding lookup is new. Returns the refreshed layers' names."""
    owner: dict[int, str] = {}
    done: list[str] = []
    for name, module in model.named_modules():
        w = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if w is None:
            continue
        if id(w) not in owner:
            owner[id(w)] = name
            continue
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        if not type(method).__name__.startswith("Unquantized"):
            raise RuntimeError(f"{name} shares its weight with {owner[id(w)]} under {type(method).__name__}: "
                               "an in-place reload cannot refresh a quantized tied layer")
        method.process_weights_after_loading(module)
        done.append(name)
    return done


class StaleGraphBuffers(RuntimeError):
    """A weight reload replaced tensors that captured CUDA graphs still point at."""


def buffer_pointers(model: Any) -> dict[str, int]:
    """Where every parameter and buffer of ``model`` lives (``data_ptr``), by name."""
    out = {f"param:{n}": int(p.data_ptr()) for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": int(b.data_ptr()) for n, b in model.named_buffers()})
    return out


@contextlib.contextmanager
def graph_guard(llm: Any, active: bool) -> Iterator[None]:
    """Around a weight reload while CUDA graphs are captured (``active``).

    A graph replays the kernels it captured on the *addresses* it captured: a reload
    must copy into the existing tensors. One that allocated a new tensor (a
    quantization method re-creating its weight, a resized buffer) leaves the graph
    reading the old one, so decoding would silently use stale weights. Every
    parameter's and buffer's address is compared before and after; any change raises
    ``StaleGraphBuffers`` (the caller's version does not advance).
    """
    if not active:
        yield
        return
    before = llm.apply_model(buffer_pointers)[0]
    yield
    after = llm.apply_model(buffer_pointers)[0]
    stale = sorted(k for k, ptr in before.items() if after.get(k) != ptr)
    if stale:
        raise StaleGraphBuffers(f"the reload reallocated {len(stale)} tensor(s) the CUDA graphs captured "
                                f"(first: {stale[0]}); the graphs would replay stale weights")
