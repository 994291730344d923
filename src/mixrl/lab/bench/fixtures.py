"""The benchmarks' own models: a reference shape, and random models on the bundled tokenizer."""

from __future__ import annotations

from typing import Any

# The random model's shape when no model is given (the sampler bench's and this workload's).
REFERENCE: dict[str, Any] = dict(vocab_size=384, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip


def random_model(spec: str, into: str) -> str:
    """``random:HIDDENxLAYERS``: a randomly initialised Qwen3 on the bundled tokenizer, saved in ``into``."""
    import torch
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import qwen3_config
    from mixrl.models.tokenizer import save_tokenizer

    hidden, layers = shape(spec)
    tok = save_tokenizer(into)
    torch.manual_seed(0)
    cfg = qwen3_config(len(tok), layers=layers, hidden=hidden, heads=hidden // 32, kv_heads=1,
                       intermediate=3 * hidden, max_positions=1024, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(into)
    return into


def shape(spec: str) -> tuple[int, int]:
    """(hidden, layers) of ``random:HIDDENxLAYERS``; ValueError naming the flag otherwise."""
    try:
        hidden, layers = (int(x) for x in spec.split(":", 1)[1].lower().split("x"))
    except ValueError:
        raise ValueError(f"--model/--long-model {spec!r}: expected random:HIDDENxLAYERS, e.g. random:256x4") from None
    if hidden < 32 or hidden % 32 or not 1 <= layers <= 64:
        raise ValueError(f"--model/--long-model {spec!r}: HIDDEN must be a multiple of 32, LAYERS in [1, 64]")
    return hidden, layers
