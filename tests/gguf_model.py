"""A tiny Llama written as a GGUF file the way llama.cpp writes one, for the conversion tests.

    src, path = write_tiny_gguf(tmp_path)   # (the HF source model, the .gguf file)

The file carries what a real one does: llama metadata, a byte-level BPE
vocabulary (GPT-2's byte alphabet, a few merges, ChatML control tokens), a
ChatML chat template with tools, and the Q/K projections row-permuted as
llama.cpp's ``convert_hf_to_gguf.py`` permutes them (the loader undoes it).
Tensors are stored F32, or F16 with ``dtype="f16"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

CHATML = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "1 2", "a n", "e r"]
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_alphabet() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [bytes_to_unicode()[b] for b in range(256)]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order for Q/K (rotary pairs interleaved per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(folder: Path, dtype: str = "f32", seed: int = 0) -> tuple[Any, Path]:
    import gguf
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = CONTROL + _byte_alphabet() + ["".join(m.split()) for m in MERGES]
    types = [3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL))
    heads, kv_heads, hidden = 4, 2, 64
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    src = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a missing norm weight shows in the logits
        for name, p in src.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)

    path = folder / f"tiny-llama.{dtype.upper()}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(2)
    w.add_feed_forward_length(96)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(CHATML)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                 "post_attention_layernorm": "ffn_norm"}
    for name, t in src.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output.weight
        a = t.float().numpy()
        if name in names:
            gname = names[name]
        else:
            i, rest = name.split(".")[2], ".".join(name.split(".")[3:-1])
            gname = f"blk.{i}.{per_layer[rest]}.weight"
            if rest == "self_attn.q_proj":
                a = _permute(a, heads)
            elif rest == "self_attn.k_proj":
                a = _permute(a, kv_heads)
        # norms stay F32 in every llama.cpp file; matrices take the file's type
        w.add_tensor(gname, a.astype(np.float16) if dtype == "f16" and a.ndim == 2 else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return src, path
