"""Real FP8 GEMMs against the built-in engine's emulation of them (``mixrl.lab.gpu.check``).

The built-in engine emulates an FP8 W8A8 linear layer (``weight_format`` and
``activation_format`` ``fp8_e4m3``: one FP32 scale per output channel of the weight and per
token of the activation) by rounding both operands onto the E4M3 grid and multiplying the
rounded values in float32. A GPU multiplies the same E4M3 values on its tensor cores
(``torch._scaled_mm`` with row-wise FP32 scales and a bf16 output, as vLLM's FP8 kernels do).
Both see bit-identical operands and scales (``operands`` is checked against
``quantize_activation`` / ``quantize_weight``), so what differs is the tensor core's
accumulation and the bf16 output rounding: exactly what emulation on a CPU cannot show.

On the same sequences, sampled once from the unquantized float32 model, three forwards:
``ref`` (float32, no quantization), ``emulated`` (float32 product), ``emulated_bf16`` (its
product rounded to bf16, the profiles' compute dtype) and ``real`` (every linear layer but the
LM head quantized; norms, attention and the LM head in float32). Per generated token: exact
KL(ref ‖ x) over the vocabulary, and the share of sampled tokens whose ratio
p_x(token) / p_ref(token) lies outside [0.2, 5], for each x, plus
KL(emulated_bf16 ‖ real): the part of real FP8's mismatch that emulation misses. On a CPU,
``_scaled_mm`` accumulates in float32 and real ≈ emulated_bf16: the tests check the
arithmetic there; the figures come from a GPU.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from mixrl.numerics.fp8 import finite_amax
from mixrl.numerics.quant import quantize_activation, quantize_weight

E4M3 = torch.float8_e4m3fn
LOW, HIGH = math.log(0.2), math.log(5.0)


def operands(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``x [R, K]`` -> (E4M3 values, FP32 scale per row ``[R, 1]``), the same scale
    and rounding as ``numerics.fp8.cast_scaled``: ``q.float() * s`` is its fake-quantized x."""
    fmax = torch.finfo(E4M3).max
    amax = finite_amax(x, dim=-1)
    s = torch.where(amax > 0, amax / fmax, torch.ones_like(amax)).clamp_min(torch.finfo(torch.float32).tiny)
    return (x / s).clamp(-fmax, fmax).to(E4M3), s


def real_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T + b`` with E4M3 operands on the tensor cores (bf16 out), returned as float32."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()
    pad = -x2.shape[0] % 16  # row counts of FP8 GEMMs are multiples of 16
    xq, sx = operands(F.pad(x2, (0, 0, 0, pad)))
    wq, sw = operands(w.float())
    y = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16)[: x2.shape[0]].float()
    if b is not None:
        y = y + b.float()
    return y.reshape(*shape[:-1], w.shape[0])


def emulated_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The built-in engine's FP8 W8A8: fake-quantized operands multiplied in float32."""
    return F.linear(quantize_activation(x.float(), "fp8_e4m3"), quantize_weight(w.float(), "fp8_e4m3"),
                    None if b is None else b.float())


def emulated_bf16_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``emulated_linear`` with its product rounded to bf16 (the tensor core's output type)."""
    y = F.linear(quantize_activation(x.float(), "fp8_e4m3"), quantize_weight(w.float(), "fp8_e4m3"))
    y = y.to(torch.bfloat16).float()
    return y if b is None else y + b.float()


KINDS = {"emulated": emulated_linear, "emulated_bf16": emulated_bf16_linear, "real": real_linear}


@contextlib.contextmanager
def linear_as(model: torch.nn.Module, kind: str) -> Iterator[None]:
    """Every ``nn.Linear`` but the LM head computes as ``kind`` ("ref" or one of ``KINDS``)."""
    fn = KINDS.get(kind)
    head = model.get_output_embeddings()
    mods = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    if fn is not None:
        for m in mods:
            m.forward = lambda x, m=m: fn(x, m.weight, m.bias)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for m in mods:
            m.__dict__.pop("forward", None)


def token_stats(ref: torch.Tensor, other: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
    """Mean exact KL(ref ‖ other) per position and the share of ``tokens`` whose ratio
    p_other / p_ref lies outside [0.2, 5]. ref, other: log-probs ``[N, V]``; tokens ``[N]``."""
    lp, lq = ref.double(), other.double()
    kl = (lp.exp() * (lp - lq)).sum(-1)
    lr = (lq - lp).gather(-1, tokens[:, None]).squeeze(-1)
    return {"kl": float(kl.mean()), "oob": float(((lr < LOW) | (lr > HIGH)).double().mean())}


def measure(model: Any, prompts: torch.Tensor, new_tokens: int, seed: int = 0) -> dict[str, Any]:
    """Sample ``new_tokens`` per prompt from the float32 model, then compare ref / emulated /
    real log-probs at the sampled positions."""
    model = model.float().eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        seqs = model.generate(prompts, do_sample=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=0, top_k=0, top_p=1.0)
        logp = {}
        for kind in ("ref", *KINDS):
            with linear_as(model, kind):
                logits = model(seqs).logits[:, prompts.shape[1] - 1: -1].float()
            logp[kind] = torch.log_softmax(logits, -1).reshape(-1, logits.shape[-1])
    tokens = seqs[:, prompts.shape[1]:].reshape(-1)
    out: dict[str, Any] = {"tokens": int(tokens.numel())}
    for kind in KINDS:
        st = token_stats(logp["ref"], logp[kind], tokens)
        out[f"kl_ref_{kind}"], out[f"oob_{kind}"] = st["kl"], st["oob"]
    out["kl_emulated_bf16_real"] = token_stats(logp["emulated_bf16"], logp["real"], tokens)["kl"]
    emu = out["kl_ref_emulated_bf16"]
    out["real_over_emulated_kl"] = out["kl_ref_real"] / emu if emu > 0 else float("nan")
    return out


def mid_llama(vocab: int = 8192, seed: int = 0) -> Any:
    """A random-init Llama of about 160M parameters (hidden 1024, 12 layers), weights N(0, 0.05)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                      num_attention_heads=16, num_key_value_heads=8, initializer_range=0.05,
                      max_position_embeddings=512, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def check_fp8_gemm(model_path: str, device: str, prompts: int = 32, new_tokens: int = 48) -> dict[str, Any]:
    """``measure`` on the given model and on ``mid_llama``, on ``device``."""
    from mixrl.models.policy import load_policy

    out: dict[str, Any] = {"device": device, "models": {}}
    small = load_policy(model_path, device=device, precision="fp32")[0].to(device)
    models = {"policy": small} if device == "cpu" else {"policy": small, "mid_llama": mid_llama().to(device)}
    for name, m in models.items():
        vocab = int(m.config.vocab_size)
        g = torch.Generator().manual_seed(1)
        p = torch.randint(3, vocab, (prompts, 8), generator=g).to(device)
        out["models"][name] = measure(m, p, new_tokens)
    out["ok"] = all(math.isfinite(r["kl_ref_real"]) and r["tokens"] > 0 for r in out["models"].values())
    return out
