"""The FP8 GEMM comparison's arithmetic (``mixrl.lab.gpu.fp8``) against references.

On a CPU ``torch._scaled_mm`` accumulates in float32, so a real FP8 GEMM must equal the
emulated one with its product rounded to bf16; the operands must be the built-in engine's.
"""

from __future__ import annotations

import math

import torch

from mixrl.lab.gpu import fp8 as g
from mixrl.numerics.quant import quantize_activation, quantize_weight


def test_operands_are_the_engines_fake_quantized_values() -> None:
    torch.manual_seed(0)
    x = torch.randn(40, 64) * torch.logspace(-3, 2, 64)  # outlier channels
    x[3] = 0.0  # an all-zero row keeps scale 1
    q, s = g.operands(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (40, 1)
    assert torch.equal(q.float() * s, quantize_activation(x, "fp8_e4m3"))
    w = torch.randn(48, 64)
    qw, sw = g.operands(w)
    assert torch.equal(qw.float() * sw, quantize_weight(w, "fp8_e4m3"))


def test_real_gemm_on_cpu_equals_emulation_rounded_to_bf16() -> None:
    torch.manual_seed(1)
    x, w, b = torch.randn(2, 7, 64), torch.randn(32, 64), torch.randn(32)
    real = g.real_linear(x, w, b)
    assert real.shape == (2, 7, 32)
    assert torch.equal(real, g.emulated_bf16_linear(x, w, b))
    # and both are the float64 product of the quantized operands, up to bf16's rounding
    ref = quantize_activation(x, "fp8_e4m3").double() @ quantize_weight(w, "fp8_e4m3").double().T
    assert torch.allclose(g.real_linear(x, w, None).double(), ref, rtol=2**-8, atol=0)
    assert not torch.equal(g.emulated_linear(x, w, b), real)  # the float32 product is not rounded


def test_token_stats_match_a_float64_brute_force() -> None:
    torch.manual_seed(2)
    p = torch.log_softmax(torch.randn(30, 11) * 3, -1)
    q = torch.log_softmax(p + torch.randn(30, 11), -1)
    tok = torch.randint(0, 11, (30,))
    got = g.token_stats(p, q, tok)
    p, q, tok = p.double().tolist(), q.double().tolist(), tok.tolist()
    kl = sum(sum(math.exp(p[i][v]) * (p[i][v] - q[i][v]) for v in range(11)) for i in range(30)) / 30
    oob = sum(not 0.2 <= math.exp(q[i][tok[i]] - p[i][tok[i]]) <= 5 for i in range(30)) / 30
    assert abs(got["kl"] - kl) < 1e-12 and got["oob"] == oob and 0 < oob < 1


def test_linear_swap_is_undone_and_the_lm_head_stays_unquantized() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1)).eval()
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        before = m(ids).logits
        with g.linear_as(m, "real"):
            during = m(ids).logits
            assert "forward" not in m.lm_head.__dict__
        after = m(ids).logits
    assert torch.equal(before, after) and not torch.equal(before, during)


def test_the_check_runs_on_the_bundled_policy_on_cpu() -> None:
    row = g.check_fp8_gemm("bundled", "cpu", prompts=4, new_tokens=8)
    r = row["models"]["policy"]
    assert row["ok"] and r["tokens"] == 32 and r["kl_emulated_bf16_real"] == 0.0
    assert r["kl_ref_emulated"] > 0 and r["real_over_emulated_kl"] == 1.0
