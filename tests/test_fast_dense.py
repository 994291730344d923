"""The fast path on the dense decoders without q/k head norms: Llama, Mistral, Qwen2.

Tiny random models (2 layers, hidden 64, GQA 4/2 heads of head_dim 16, vocab 96), each
with what sets it apart from Qwen3: Llama with tied embeddings and biases on all four
attention projections (``attention_bias``), Qwen2 with biases on q, k and v only, Mistral
without any. References are HF's own full-sequence forward of the same checkpoint in
float64; the engine computes in FP32, so the two differ by FP32 rounding only.
"""

from __future__ import annotations

import pytest
import torch

from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.sampling.builtin import decoder_forward as df
from mixrl.sampling.builtin import fast
from mixrl.sampling.builtin.engine import BuiltinEngine
from mixrl.sampling.profiles import get_profile, with_overrides

torch.set_num_threads(1)

TOL = 1e-5  # nats: engine FP32 vs the float64 forward
VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64)  # fmt: skip
ARCHS = {
    "llama": ("LlamaConfig", {"attention_bias": True, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {"sliding_window": None, "tie_word_embeddings": False}),
}


def _config(arch: str, **over):  # type: ignore[no-untyped-def]
    import transformers

    cls, extra = ARCHS[arch]
    return getattr(transformers, cls)(**{**COMMON, **extra, **over})


@pytest.fixture(scope="module", params=list(ARCHS))
def model(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_config(request.param))
    with torch.no_grad():  # sharper than the init, so that distributions are not near-uniform
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif name.endswith("bias"):  # the init's zero biases would test nothing
                p.copy_(torch.randn_like(p) * 0.5)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(str(path))
    return request.param, str(path)


def _hf64(path: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


PROMPTS = [[5, 9, 14], [3, 7, 11, 2, 8, 30], [40, 41, 42, 43]]  # ragged: left padding is exercised


def _run(engine: BuiltinEngine, n: int = 10) -> list:  # type: ignore[type-arg]
    ps = [SamplingParams(max_new_tokens=n, record="none", seed=i) for i in range(len(PROMPTS))]
    return engine.generate_batch([GenerationRequest(p, s) for p, s in zip(PROMPTS, ps, strict=True)])


def _errs(ref, results) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """|log q - log p_ref| per generated token; p_ref by one float64 forward per sequence."""
    errs = []
    for p, r in zip(PROMPTS, results, strict=True):
        with torch.no_grad():
            logp = ref(torch.tensor([p + r.token_ids])).logits[0].log_softmax(-1)
        want = logp[len(p) - 1 : len(p) - 1 + len(r.token_ids)].gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        errs.append((want - torch.tensor(r.logprobs, dtype=torch.float64)).abs())
    return torch.cat(errs)


def test_fast_path_is_taken_and_fp32_logprobs_equal_the_float64_forward(model):
    arch, path = model
    eng = BuiltinEngine(path, get_profile("fp32"), "g", stop_on_eos=False)
    assert eng.path_name == f"{arch}-fast"
    res = _run(eng)
    assert all(len(r.token_ids) == 10 for r in res)
    assert float(_errs(_hf64(path), res).max()) <= TOL, arch
    # one request at a time: the same tokens (seeded) and log-probs as in the ragged batch
    alone = [_run_one(eng, i) for i in range(len(PROMPTS))]
    for a, b in zip(alone, res, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= TOL


def _run_one(eng: BuiltinEngine, i: int):  # type: ignore[no-untyped-def]
    p = SamplingParams(max_new_tokens=10, record="none", seed=i)
    return eng.generate_batch([GenerationRequest(PROMPTS[i], p)])[0]


def test_quantized_weights_equal_the_float64_forward_of_the_same_quantized_weights(model):
    from mixrl.numerics import quantize_weight

    arch, path = model
    prof = with_overrides(get_profile("h100-fp8"), kv_format="none", compute_dtype="float32")
    res = _run(BuiltinEngine(path, prof, "g", stop_on_eos=False))
    ref, exact = _hf64(path), _hf64(path)
    head = ref.get_output_embeddings()
    with torch.no_grad():  # the same fake quantization of every Linear weight (in fp32) but lm_head's
        for mod in ref.modules():
            if isinstance(mod, torch.nn.Linear) and mod is not head:
                mod.weight.copy_(quantize_weight(mod.weight.float(), "fp8_e4m3").double())
    assert float(_errs(ref, res).max()) <= TOL, arch
    assert float(_errs(exact, res).max()) > 100 * TOL, arch  # quantization did change the numbers


def test_load_folds_the_attention_scale_into_q_only_and_keeps_biases(model):
    from transformers import AutoConfig, AutoModelForCausalLM

    from mixrl.sampling.builtin.precision import from_profile

    arch, path = model
    cfg = AutoConfig.from_pretrained(path)
    sd = AutoModelForCausalLM.from_pretrained(path).state_dict()
    shape = df.Shape.from_config(cfg)
    assert not shape.qk_norm and shape.qkv_bias == (arch != "mistral") and shape.o_bias == (arch == "llama")
    w = df.build_weights(sd, shape, from_profile(get_profile("fp32")), 16)
    a = "model.layers.1.self_attn."
    s = shape.head_dim**-0.5
    want = torch.cat([sd[a + "q_proj.weight"] * s, sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]])
    assert w.layers[1].qk_norm is None and torch.equal(w.layers[1].qkv._wt, want.t())
    if shape.qkv_bias:
        bias = torch.cat([sd[a + "q_proj.bias"] * s, sd[a + "k_proj.bias"], sd[a + "v_proj.bias"]])
        assert torch.equal(w.layers[1].qkv.bias, bias)
    assert (w.layers[1].o.bias is not None) == shape.o_bias


@pytest.mark.parametrize(("arch", "over", "field"), [
    ("mistral", {"sliding_window": 32}, "config.sliding_window"),
    ("llama", {"mlp_bias": True}, "config.mlp_bias"),
    ("llama", {"hidden_act": "gelu"}, "config.hidden_act"),
])  # fmt: skip
def test_what_the_fast_path_cannot_run_goes_to_the_generic_path_naming_the_field(arch, over, field, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = _config(arch, **over)
    why = fast.applies(cfg)
    assert why is not None and field in why
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path))
    assert BuiltinEngine(str(tmp_path), get_profile("fp32"), "g").path_name == "generic"
    with pytest.raises(ValueError, match=field):
        BuiltinEngine(str(tmp_path), get_profile("fp32"), "g", forward="fast")
