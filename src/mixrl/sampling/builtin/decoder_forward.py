"""Incremental forward with a KV cache for dense decoders: the built-in engine's own kernels.

Math of ``transformers``' Qwen3 (arXiv 2505.09388), Llama, Mistral and Qwen2: pre-norm
decoder layers, RMSNorm, grouped-query attention, SwiGLU MLP, tied or untied ``lm_head``.
They differ in three things only (``ARCHITECTURES``): Qwen3 normalizes each q and k head
(RMSNorm) before RoPE; Qwen2 has biases on q, k and v; Llama and Qwen3 on all four
projections when ``config.attention_bias``. The *kernels* are ours on purpose:
fused qkv and gate/up matmuls on weights laid out once for their GEMM
(``linear.py``), both residual adds in the GEMMs' accumulators, the attention
scale folded into the q-norm weights (Qwen3) or into the q rows of the qkv weight
and bias (the others), a preallocated
cache written in place one step at a time, RoPE from a precomputed table, so
that a sampler differs from the trainer's full-sequence HF forward the way a
real inference engine does.

Weights are fake-quantized once on load (``Precision.weight``) per HF Linear —
q, k, v, o, gate, up, down separately, so per-tensor scales are the same as
quantizing an HF model in place — and only then scaled (q) and fused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mixrl.sampling.builtin.kv_cache import KVCache
from mixrl.sampling.builtin.linear import PackedLinear, SwiGLU
from mixrl.sampling.builtin.linear_fp8 import ScaledLinear, ScaledSwiGLU
from mixrl.sampling.builtin.precision import Precision

# model_type -> (HF modeling module and class prefix, q/k head norms, q/k/v biases, o bias); a bias
# entry None reads ``config.attention_bias``
ARCHITECTURES: dict[str, tuple[str, str, bool, bool | None, bool | None]] = {
    "qwen3": ("qwen3", "Qwen3", True, None, None),
    "llama": ("llama", "Llama", False, None, None),
    "mistral": ("mistral", "Mistral", False, False, False),
    "qwen2": ("qwen2", "Qwen2", False, True, False),
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)


@dataclass(frozen=True)
class Shape:
    """The architecture numbers read from an HF config."""

    vocab: int
    hidden: int
    layers: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    tied: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    qkv_bias: bool  # q, k and v projections carry biases
    o_bias: bool  # the o projection carries a bias
    max_positions: int
    inv_freq: torch.Tensor  # [head_dim // 2] float32
    rope_scale: float  # "attention_scaling" of non-default RoPE types (1.0 by default)

    @staticmethod
    def from_config(cfg: Any) -> Shape:
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.model_type must be one of {SUPPORTED_MODEL_TYPES} for the built-in engine, "
                f"got {cfg.model_type!r}"
            )
        module, prefix, qk_norm, qkv_bias, o_bias = ARCHITECTURES[cfg.model_type]
        if cfg.hidden_act != "silu":
            raise ValueError(f"config.hidden_act must be 'silu', got {cfg.hidden_act!r}")
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            raise ValueError("config.layer_types has sliding_attention layers: not supported")
        if getattr(cfg, "sliding_window", None) is not None and cfg.model_type == "mistral":
            raise ValueError("config.sliding_window is set: sliding-window attention is not supported")
        if getattr(cfg, "mlp_bias", False):
            raise ValueError("config.mlp_bias is true: MLP biases are not supported")
        rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type == "dynamic":
            raise ValueError("config.rope_parameters.rope_type 'dynamic' is not supported")
        import importlib

        modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        rope = getattr(modeling, f"{prefix}RotaryEmbedding")(cfg)  # HF's inv_freq, every RoPE type it knows
        bias = bool(getattr(cfg, "attention_bias", False))
        heads = cfg.num_attention_heads
        return Shape(
            vocab=cfg.vocab_size,
            hidden=cfg.hidden_size,
            layers=cfg.num_hidden_layers,
            heads=heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            intermediate=cfg.intermediate_size,
            eps=cfg.rms_norm_eps,
            tied=bool(cfg.tie_word_embeddings),
            qk_norm=qk_norm,
            qkv_bias=bias if qkv_bias is None else qkv_bias,
            o_bias=bias if o_bias is None else o_bias,
            max_positions=cfg.max_position_embeddings,
            inv_freq=rope.inv_freq.detach().float().clone(),
            rope_scale=float(rope.attention_scaling),
        )


@dataclass
class Layer:
    ln1: torch.Tensor  # [H]
    ln2: torch.Tensor  # [H]
    # [Hq + Hkv, D]: q_norm * D^-0.5 per query head, then k_norm per kv head; None: no head norms
    qk_norm: torch.Tensor | None
    # PackedLinear, or linear_fp8.ScaledLinear / ScaledSwiGLU for real FP8 (Precision.scaled_mm)
    qkv: Any  # [(Hq + 2 Hkv) D, H] (+ bias, Shape.qkv_bias); q rows * D^-0.5 without head norms
    o: Any  # [H, Hq D] (+ bias, Shape.o_bias)
    mlp: Any  # SwiGLU: gate and up [I, H]
    down: Any  # [H, I]


@dataclass
class Weights:
    embed: torch.Tensor  # [V, H]; tied FP32 (head not quantized): a view of lm_head's [H, V] copy
    layers: list[Layer]
    norm: torch.Tensor  # [H]
    lm_head: PackedLinear  # [V, H]
    cos: torch.Tensor  # [rope_len, D] compute dtype
    sin: torch.Tensor  # [rope_len, D] with the first half negated (see _rope)


def strip_wrapper_prefixes(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Strip wrapper prefixes (torch.compile, DDP) so trainer state dicts load as HF names."""
    return {k: state_dict[key] for k, key in hf_names(state_dict).items()}


def hf_names(state_dict: Mapping[str, Any]) -> dict[str, str]:
    """HF name -> the state dict's own key (wrapper prefixes stripped), reading no value: a
    mapping that computes its values on access (a quantizing view) is read one tensor at a time."""
    out = {}
    for key in state_dict:
        k = key
        for p in ("_orig_mod.", "module."):
            k = k.replace(p, "")
        out[k] = key
    return out


def rope_tables(shape: Shape, rope_len: int, dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) for positions [0, rope_len): fp32 exactly as HF computes them (pos * inv_freq),
    then cast like HF does; ``sin`` with its first half negated (see ``_rope``). They depend on
    the architecture only, so a path computes them once, not per weights load."""
    pos = torch.arange(rope_len, dtype=torch.float32)
    freqs = pos[:, None] * shape.inv_freq[None, :]  # [P, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
    return ((emb.cos() * shape.rope_scale).to(dt),
            (torch.cat([-freqs.sin(), freqs.sin()], dim=-1) * shape.rope_scale).to(dt))


def build_weights(
    state_dict: Mapping[str, Any], shape: Shape, prec: Precision, rope_len: int, batch_hint: int = 64,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None, device: torch.device | str = "cpu",
) -> Weights:
    """HF-named state dict -> quantized, fused, compute-dtype tensors (RoPE table for
    positions [0, rope_len), or ``rope`` = ``rope_tables(...)`` computed before). Raises
    KeyError naming a missing parameter.

    Every tensor of the result owns its memory (the trainer may update its tensors in place
    while this version serves; a mapped version is read-only), in as few copies as the layout
    allows: each is copied once, by the op that puts it in its final layout (fused GEMM weights:
    one ``cat`` of the parts' transposed views; norm weights: one cast-copy). On another
    ``device`` each source tensor is copied there first (the layers then use its plain GEMMs)."""
    sd = hf_names(state_dict)  # each value read once, when its layer is built
    dt = prec.dtype

    def get(name: str) -> torch.Tensor:  # the source tensor in fp32, possibly not a copy
        if name not in sd:
            raise KeyError(f"state_dict has no {name!r} (expected HF parameter names)")
        t = state_dict[sd[name]].detach().to(device)
        return t if t.dtype == torch.float32 else t.float()

    def own(name: str) -> torch.Tensor:  # a copy in the compute dtype
        return get(name).to(dt, copy=True)

    def lin(name: str) -> torch.Tensor:  # a Linear weight: quantize in fp32, then cast (the fused ops copy)
        return get(name) if prec.scaled_mm else prec.weight(get(name)).to(dt)  # real FP8: the layer quantizes

    # the attention scale rides on q (RoPE is linear): on its head norm's weight, or without
    # head norms on q's weight and bias (after quantizing); no pass over the scores
    scale = shape.head_dim**-0.5
    q_scale = 1.0 if shape.qk_norm else scale
    # real FP8 (Profile.fp8_gemm): E4M3 layers quantize the fp32 weights themselves, bf16 out
    Lin, Glu, arg = (ScaledLinear, ScaledSwiGLU, dt) if prec.scaled_mm else (PackedLinear, SwiGLU, batch_hint)
    layers = []
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        b_qkv = b_o = qk_norm = None
        if shape.qkv_bias:
            b_qkv = torch.cat([get(a + "q_proj.bias") * q_scale] + [get(a + f"{n}_proj.bias") for n in "kv"]).to(dt)
        if shape.o_bias:
            b_o = own(a + "o_proj.bias")
        if shape.qk_norm:
            qk_norm = torch.cat([
                (get(a + "q_norm.weight") * scale).expand(shape.heads, -1),
                get(a + "k_norm.weight").expand(shape.kv_heads, -1),
            ]).to(dt)  # fmt: skip
        q = prec.weight(get(a + "q_proj.weight"))
        q = q if q_scale == 1.0 else q * q_scale
        qkv = [q if prec.scaled_mm else q.to(dt), lin(a + "k_proj.weight"), lin(a + "v_proj.weight")]
        layers.append(
            Layer(
                ln1=own(p + "input_layernorm.weight"),
                ln2=own(p + "post_attention_layernorm.weight"),
                qk_norm=qk_norm,
                qkv=Lin.fused(qkv, b_qkv, arg),
                o=Lin.fused([lin(a + "o_proj.weight")], b_o, arg),
                mlp=Glu(lin(p + "mlp.gate_proj.weight"), lin(p + "mlp.up_proj.weight"), arg),
                down=Lin.fused([lin(p + "mlp.down_proj.weight")], None, arg),
            )
        )
    embed = get("model.embed_tokens.weight")
    head = embed if shape.tied or "lm_head.weight" not in sd else get("lm_head.weight")
    if not shape.tied and "lm_head.weight" not in sd:
        raise KeyError("state_dict has no 'lm_head.weight' and config.tie_word_embeddings is False")
    head = prec.weight(head) if prec.quantize_lm_head else head
    cos, sin = rope if rope is not None else rope_tables(shape, rope_len, dt)
    cos, sin = cos.to(device), sin.to(device)
    lm = PackedLinear.fused([head.to(dt)], None, batch_hint)
    wt = lm.transposed()
    if head is embed and wt is not None and wt.dtype == dt:
        # tied and not quantized: the head's [H, V] copy serves the lookup too, as its [V, H] view
        # (a gather copies the same values: the same embeddings; one copy of the table, not two)
        table = wt.t()
    else:
        table = embed.to(dt, copy=True).contiguous()
    return Weights(embed=table, layers=layers, norm=own("model.norm.weight"), lm_head=lm, cos=cos, sin=sin)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen3RMSNorm over the last dim: normalize in fp32, round to the input dtype,
    then scale by ``w`` ([D], or [heads, D] for per-head norms of a [..., heads, D] input)."""
    if x.dtype == torch.float32:
        if w.dim() == 1:
            return F.rms_norm(x, w.shape, w, eps)  # fused kernel, same math in fp32
        return F.rms_norm(x, x.shape[-1:], None, eps) * w
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` with rotate_half(x) = cat(-x2, x1).

    ``sin`` carries the sign: cat(x2, x1) * cat(-s, s) == cat(-x2, x1) * cat(s, s)
    exactly (negation is exact), one op less. x [B, T, h, D]; cos/sin [B, T, 1, D].
    """
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([x2, x1], dim=-1) * sin


def _act(x: torch.Tensor, prec: Precision) -> torch.Tensor:
    """A Linear's input in the profile's activation format (identity when off)."""
    return x if prec.act is None else prec.act(x)


def decode_attention(
    q: torch.Tensor,  # [B, 1, Hq, D] one query per row, already scaled by D^-0.5
    k: torch.Tensor,  # [B, Hkv, S, D] cached keys (a prefix view of the cache)
    v: torch.Tensor,  # [B, Hkv, S, D]
    bias: torch.Tensor | None,  # [B, 1, 1, S] additive: 0 or -inf (left padding); None = no padding
) -> torch.Tensor:
    """One-query attention with GQA as a grouped matmul: query head ``h`` uses kv head
    ``h // G`` (HF's ``repeat_kv`` order), so viewing q as [B, Hkv, G, D] avoids
    materializing repeated keys. Scores in the compute dtype, softmax in fp32, as
    HF's eager path. (SDPA on the same grouped view measured no faster at decode
    shapes, 2521 vs 2616 CPU tokens/s on the reference bench: both read the cache once.)"""
    B, _, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = q.view(B, Hkv, Hq // Hkv, D)  # [B, Hkv, G, D]
    s = torch.matmul(qg, k.transpose(-1, -2))  # [B, Hkv, G, S]
    if bias is not None:
        s.add_(bias)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(p, v).view(B, 1, Hq * D)  # [B, Hkv, G, D] -> [B, 1, Hq D]


def forward(
    w: Weights,
    shape: Shape,
    prec: Precision,
    cache: KVCache,
    ids: torch.Tensor,  # [B, T] token ids written at cache columns [col0, col0 + T)
    pos: torch.Tensor,  # [B, T] RoPE positions
    col0: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Run T new tokens per row through the model; return the last column's hidden state [B, H].

    ``mask``: for T > 1 a bool [B, 1, T, col0 + T] (True = may attend); for T == 1 an
    additive [B, 1, 1, col0 + 1] bias in the compute dtype, or None when no row is padded.
    """
    B, T = ids.shape
    Hq, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    x = F.embedding(ids, w.embed)  # [B, T, H]
    cos = w.cos[pos].unsqueeze(2)  # [B, T, 1, D]
    sin = w.sin[pos].unsqueeze(2)
    end = col0 + T
    for li, L in enumerate(w.layers):
        h = rms_norm(x, L.ln1, shape.eps)
        qkv = L.qkv(_act(h, prec))  # [B, T, (Hq + 2 Hkv) D]
        heads = qkv.view(B, T, Hq + 2 * Hkv, D)
        # q and k heads (normed with per-head weights, Qwen3) rotated together, v untouched
        qk = heads[:, :, : Hq + Hkv]
        qk = _rope(qk if L.qk_norm is None else rms_norm(qk, L.qk_norm, shape.eps), cos, sin)
        q, k, v = qk[:, :, :Hq], qk[:, :, Hq:], heads[:, :, Hq + Hkv :]  # [B, T, h, D]
        keys, vals = cache.write(li, col0, k.transpose(1, 2), v.transpose(1, 2))
        if T == 1:  # decode: grouped heads share their kv head, no repeat (see decode_attention)
            a = decode_attention(q, keys[:, :, :end], vals[:, :, :end], mask)  # [B, 1, Hq D]
        else:
            a = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys[:, :, :end], vals[:, :, :end],
                attn_mask=mask, enable_gqa=Hq != Hkv, scale=1.0,  # q carries the scale
            ).transpose(1, 2).reshape(B, T, Hq * D)  # [B, T, Hq D]
        x = L.o.plus(_act(a, prec), x)  # x + o(a)
        h = _act(rms_norm(x, L.ln2, shape.eps), prec)
        x = L.down.plus(_act(L.mlp(h), prec), x)  # x + down(silu(gate(h)) * up(h))
    return rms_norm(x[:, -1], w.norm, shape.eps)  # [B, H]


def lm_head(w: Weights, prec: Precision, hidden: torch.Tensor) -> torch.Tensor:
    """[B, H] -> fp32 logits [B, V] (activation hook only when lm_head is quantized too)."""
    if prec.act is not None and prec.quantize_lm_head:
        hidden = prec.act(hidden)
    return w.lm_head(hidden).float()
