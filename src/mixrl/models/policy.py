"""The bundled small policy: a tiny Qwen3 warm-started on the bundled tasks.

    model, tok = load_policy("bundled")          # the copy shipped in the package
    model, tok = load_policy("/path/to/hf_dir")  # any local HF causal-LM directory

The bundled policy ships inside the package (``mixrl/models/bundled/``:
safetensors, config, tokenizer with its chat template, and ``recipe.json``
with the recipe and the digest of the weights it built), so nothing is
trained on first use. ``mixrl pretrain`` rebuilds it from the recipe.

Another seed, or a recipe that no longer matches the shipped copy, is built by
``mixrl pretrain --seed N`` (``mixrl.lab.pretrain.ensure_bundled``) into a cache: ``$MIXRL_HOME/policy-<hash>``
(default ``~/.cache/mixrl``) where the hash covers the whole recipe, under a
file lock (concurrent workers wait instead of training twice); the directory
appears atomically (written aside, then renamed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixrl.models.loading import resolve_model
from mixrl.models.shipped import BUNDLED


def qwen3_config(
    vocab_size: int,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    max_positions: int = 512,
    pad_id: int | None = None,
    eos_id: int | None = None,
) -> Any:
    """A ``transformers.Qwen3Config`` with tied embeddings (small vocab: the head is cheap)."""
    from transformers import Qwen3Config

    if hidden % heads:
        raise ValueError(f"qwen3_config: hidden={hidden} is not a multiple of heads={heads}")
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
    )


def tiny_config(vocab_size: int, **overrides: Any) -> Any:
    """A Qwen3 config for tests: 1 layer, hidden 32 (overridable)."""
    kw: dict[str, Any] = dict(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, max_positions=256)
    kw.update(overrides)
    return qwen3_config(vocab_size, **kw)


def resolve(path_or_bundled: str | Path) -> Path:
    """``"bundled"`` -> the bundled policy's directory; a local HF directory; or a hub id
    found in the local HF cache (``mixrl.models.loading.resolve_model``; raises ``ConfigError``)."""

    return resolve_model(path_or_bundled)


def attn_implementation_for(device: Any, precision: str = "fp32", flash_available: bool | None = None) -> str:
    """The attention kernel a trainer on ``device`` computing in ``precision`` uses.

    CUDA with 16-bit compute: ``flash_attention_2`` when the ``flash_attn`` package is
    installed (varlen: packed micro-batches are one row, sequences cut by position ids,
    see ``mixrl.train.packing``); otherwise, and in FP32 (flash kernels take 16-bit
    inputs only), SDPA with a block-diagonal mask. CPU: SDPA.
    """
    import torch

    if torch.device(device).type != "cuda" or precision not in ("bf16", "fp16"):
        return "sdpa"
    if flash_available is None:
        from transformers.utils import is_flash_attn_2_available

        flash_available = bool(is_flash_attn_2_available())
    return "flash_attention_2" if flash_available else "sdpa"


def load_policy(path_or_bundled: str | Path = BUNDLED, dtype: Any = None, device: Any = None,
                precision: str = "fp32") -> tuple[Any, Any]:
    """(model, tokenizer) from ``"bundled"`` or any local HF causal-LM directory.

    The model is in eval mode, FP32 unless ``dtype`` says otherwise, on the CPU; with
    ``device`` its attention kernel is the one for that device and ``precision``
    (``attn_implementation_for``; the caller moves it).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = resolve(path_or_bundled)
    kw: dict[str, Any] = {}
    if device is not None:
        kw["attn_implementation"] = attn_implementation_for(device, precision)
    model = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype or torch.float32, **kw)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(p))
    return model, tok
