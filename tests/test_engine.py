"""The built-in engine: log q against full-forward recomputation, the support of q,
seeding, ragged batches, stops, bad input and non-finite logits.

Models are tiny random Qwen3s saved with ``save_pretrained`` (2 layers, hidden 64,
GQA 4/2 heads, vocab 96). References are HF's own full-sequence forward.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.sampling.builtin.engine import BuiltinEngine, request_seed
from mixrl.sampling.builtin.sample import draw, sampling_logprobs
from mixrl.sampling.factory import make_engine
from mixrl.sampling.profiles import get_profile, with_overrides

torch.set_num_threads(1)

# max |log q engine - log q reference| per comparison (nats)
TOL = {
    "fp32": 1e-5,  # engine FP32 vs HF FP32 full forward: kernel rounding only
    "fp8w_fp32": 1e-5,  # FP8 weights, FP32 compute vs HF with the same fake-quantized weights
    "bf16": 0.1,  # BF16 compute vs HF in BF16 (same quantized weights): different kernels in BF16
    "math": 1e-6,  # sampling math in fp32 vs float64 brute force
}
VOCAB = 96


def _save(path, *, tied: bool, eos: int | None = None, seed: int = 0) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=tied, eos_token_id=eos, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # larger than the init so that distributions are not near-uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("untied"), tied=False, eos=7)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("tied"), tied=True, seed=1)


def _hf(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _ref_logits(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """HF full forward over prompt + output: float64 logits [len(out), V] predicting out."""
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(out)]


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _ref_support(z: torch.Tensor, top_k: int, top_p: float) -> tuple[list[int], float]:
    """float64 brute force: (support ids ascending, gap of top_p to the nearest cut point)."""
    order = sorted(range(len(z)), key=lambda i: -float(z[i]))
    k = top_k or len(z)
    kept = order[:k]
    p = torch.softmax(z[kept], 0).tolist()
    out, mass, gap = [], 0.0, math.inf
    for i, pi in zip(kept, p, strict=True):
        if out and mass >= top_p:
            break
        out.append(i)
        mass += pi
        if top_p < 1:
            gap = min(gap, abs(mass - top_p))
    return sorted(out), gap


def _cands(res, j):
    a, b = res.cand_offsets[j], res.cand_offsets[j + 1]
    return res.cand_ids[a:b], res.cand_logprobs[a:b]


# ------------------------------------------------------------------ sampling math


def test_sampling_logprobs_against_float64_brute_force():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g) * 3
    temp = torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0, 0.5])
    top_k = torch.tensor([0, 0, 5, 3, 10, 1])
    top_p = torch.tensor([1.0, 0.8, 1.0, 0.5, 0.9, 0.3])
    logq, keep = sampling_logprobs(logits, temp, top_k, top_p)
    for b in range(6):
        z = logits[b].double() / float(temp[b])
        support, _ = _ref_support(z, int(top_k[b]), float(top_p[b]))
        got = keep[b].nonzero().squeeze(1).tolist() if keep is not None else list(range(40))
        assert got == support, f"row {b}"
        ref = torch.full((40,), -math.inf, dtype=torch.float64)
        ref[support] = z[support] - torch.logsumexp(z[support], 0)
        assert torch.equal(torch.isinf(logq[b]), torch.isinf(ref))
        torch.testing.assert_close(logq[b][support].double(), ref[support], atol=TOL["math"], rtol=0)
    assert sampling_logprobs(logits, temp, torch.zeros(6, dtype=torch.long), torch.ones(6))[1] is None


def test_top_p_one_with_top_k_keeps_exactly_k():
    # mass-before rounding must never cut tokens when top_p == 1
    logits = torch.tensor([[10.0, 9.0] + [-30.0] * 8])
    _, keep = sampling_logprobs(logits, torch.ones(1), torch.tensor([6]), torch.ones(1))
    assert int(keep.sum()) == 6


def test_draw_is_inverse_cdf_and_never_picks_zero_probability():
    logq = torch.log(torch.tensor([[0.5, 0.0, 0.5], [0.0, 1.0, 0.0]]))
    for u, want in [(0.0, [0, 1]), (0.25, [0, 1]), (0.5, [2, 1]), (0.999999, [2, 1])]:
        assert draw(logq, torch.full((2,), u, dtype=torch.float64)).tolist() == want


# --------------------------------------------------------------- against HF


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_fp32_logprobs_equal_hf_full_forward(which, request):
    path = request.getfixturevalue(which)
    engine = BuiltinEngine(path, get_profile("fp32"), "g", seed=3, stop_on_eos=False)
    hf = _hf(path)
    prompts = _prompts([1, 5, 9, 3])
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    results = engine.generate_batch([GenerationRequest(p, params) for p in prompts])
    worst = 0.0
    for p, r in zip(prompts, results, strict=True):
        assert r.finish_reason == "length" and len(r.token_ids) == 12 and r.cand_kind == "support"
        ref = torch.log_softmax(_ref_logits(hf, p, r.token_ids), -1)  # [12, V]
        for j, t in enumerate(r.token_ids):
            ids, lps = _cands(r, j)
            assert ids == list(range(VOCAB))  # top_p = 1, top_k = 0: the whole vocabulary
            worst = max(worst, (torch.tensor(lps, dtype=torch.float64) - ref[j]).abs().max().item())
            worst = max(worst, abs(r.logprobs[j] - ref[j, t].item()))
            assert lps[t] == r.logprobs[j]
    assert worst < TOL["fp32"], worst


def test_support_of_top_k_top_p_matches_reference_and_sums_to_one(untied):
    engine = BuiltinEngine(untied, get_profile("fp32"), "g", seed=5, stop_on_eos=False)
    hf = _hf(untied)
    cases = [(0.8, 0, 1.0), (1.0, 7, 1.0), (1.0, 12, 0.7), (0.6, 0, 0.5)]
    reqs = [
        GenerationRequest(p, SamplingParams(temperature=t, top_k=k, top_p=tp, max_new_tokens=10))
        for p, (t, k, tp) in zip(_prompts([4, 6, 2, 8], seed=1), cases, strict=True)
    ]
    checked = 0
    for req, r in zip(reqs, engine.generate_batch(reqs), strict=True):
        z = _ref_logits(hf, req.prompt_ids, r.token_ids) / req.params.temperature
        for j, t in enumerate(r.token_ids):
            ids, lps = _cands(r, j)
            assert t in ids
            assert abs(sum(math.exp(v) for v in lps) - 1.0) < 1e-5
            ref_ids, gap = _ref_support(z[j], req.params.top_k, req.params.top_p)
            if gap > 1e-5:  # a cut within rounding of top_p may go either way
                assert ids == ref_ids
                checked += 1
            ref = z[j][ids] - torch.logsumexp(z[j][ids], 0)
            torch.testing.assert_close(torch.tensor(lps, dtype=torch.float64), ref, atol=TOL["fp32"], rtol=0)
    assert checked >= 30


def test_head_k_records_most_likely_tokens(untied):
    engine = BuiltinEngine(untied, get_profile("fp32"), "g", stop_on_eos=False)
    full, head = engine.generate_batch(
        [GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=6, seed=11, record=rec)) for rec in ("support", "head:4")]
    )
    assert head.cand_kind == "head" and head.token_ids == full.token_ids
    for j in range(6):
        ids, lps = _cands(full, j)
        best = sorted(range(len(ids)), key=lambda i: -lps[i])[:4]
        assert _cands(head, j) == ([ids[i] for i in best], [lps[i] for i in best])
    # head:K never lists tokens outside the support (here top_k = 2 < K)
    (r,) = engine.generate_batch([GenerationRequest([1, 2], SamplingParams(max_new_tokens=3, top_k=2, record="head:5"))])
    assert r.cand_offsets == [0, 2, 4, 6] and all(math.isfinite(v) for v in r.cand_logprobs)
    (n,) = engine.generate_batch([GenerationRequest([1, 2], SamplingParams(max_new_tokens=3, record="none"))])
    assert n.cand_kind == "none" and n.cand_offsets == [0, 0, 0, 0] and n.cand_ids == []


def test_quantized_weights_match_hf_with_the_same_fake_quantization(untied):
    from mixrl.numerics import quantize_weight

    prof = with_overrides(get_profile("h100-fp8"), kv_format="none", compute_dtype="float32")
    engine = BuiltinEngine(untied, prof, "h100-fp8", stop_on_eos=False)
    hf = _hf(untied)
    with torch.no_grad():  # the same fake quantization on every Linear but lm_head
        for name, mod in hf.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                mod.weight.copy_(quantize_weight(mod.weight, "fp8_e4m3"))
    exact = _hf(untied)
    prompts = _prompts([3, 7], seed=2)
    results = engine.generate_batch([GenerationRequest(p, SamplingParams(max_new_tokens=8)) for p in prompts])
    worst, moved = 0.0, 0.0
    for p, r in zip(prompts, results, strict=True):
        ref = torch.log_softmax(_ref_logits(hf, p, r.token_ids), -1)
        unq = torch.log_softmax(_ref_logits(exact, p, r.token_ids), -1)
        got = torch.tensor([_cands(r, j)[1] for j in range(8)], dtype=torch.float64)
        worst = max(worst, (got - ref).abs().max().item())
        moved = max(moved, (got - unq).abs().max().item())
    assert worst < TOL["fp8w_fp32"], worst
    assert moved > 100 * TOL["fp8w_fp32"], moved  # quantization did change the numbers


def test_activation_quantization_matches_hf_with_input_hooks(untied):
    from mixrl.numerics import quantize_activation

    prof = with_overrides(get_profile("fp32"), activation_format="fp8_e4m3")
    engine = BuiltinEngine(untied, prof, "act", stop_on_eos=False)
    hf = _hf(untied)
    for name, mod in hf.named_modules():  # the same per-token FP8 on every Linear input but lm_head's
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            mod.register_forward_pre_hook(lambda m, args: (quantize_activation(args[0], "fp8_e4m3"),))
    p = _prompts([6], seed=9)[0]
    (r,) = engine.generate_batch([GenerationRequest(p, SamplingParams(max_new_tokens=6))])
    ref = torch.log_softmax(_ref_logits(hf, p, r.token_ids), -1)
    exact = torch.log_softmax(_ref_logits(_hf(untied), p, r.token_ids), -1)
    got = torch.tensor([_cands(r, j)[1] for j in range(6)], dtype=torch.float64)
    assert (got - ref).abs().max().item() < TOL["fp8w_fp32"]
    assert (got - exact).abs().max().item() > 100 * TOL["fp8w_fp32"]


def test_fp8_kv_cache_matches_hf_with_quantized_keys_and_values(untied):
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from mixrl.numerics import quantize_kv

    def fp8_kv_attention(module, query, key, value, *args, **kwargs):  # key/value [B, Hkv, T, D]
        q = lambda x: quantize_kv(x, "fp8_e4m3")  # noqa: E731
        return sdpa_attention_forward(module, query, q(key), q(value), *args, **kwargs)

    AttentionInterface.register("mixrl_test_fp8_kv", fp8_kv_attention)
    hf = AutoModelForCausalLM.from_pretrained(untied, attn_implementation="mixrl_test_fp8_kv").eval()
    prof = with_overrides(get_profile("fp32"), kv_format="fp8_e4m3")
    engine = BuiltinEngine(untied, prof, "kv", stop_on_eos=False)
    p = _prompts([5], seed=10)[0]
    (r,) = engine.generate_batch([GenerationRequest(p, SamplingParams(max_new_tokens=6))])
    ref = torch.log_softmax(_ref_logits(hf, p, r.token_ids), -1)
    exact = torch.log_softmax(_ref_logits(_hf(untied), p, r.token_ids), -1)
    got = torch.tensor([_cands(r, j)[1] for j in range(6)], dtype=torch.float64)
    assert (got - ref).abs().max().item() < TOL["fp8w_fp32"]
    assert (got - exact).abs().max().item() > 100 * TOL["fp8w_fp32"]


def test_bf16_profile_is_close_to_hf_bf16_and_fp8_kv_changes_it(untied):
    hf = _hf(untied, torch.bfloat16)
    prompts = _prompts([5, 2], seed=3)
    params = SamplingParams(max_new_tokens=8, seed=4)
    b16 = BuiltinEngine(untied, get_profile("bf16"), "bf16", stop_on_eos=False)
    kv8 = BuiltinEngine(untied, get_profile("h100-bf16"), "h100-bf16", stop_on_eos=False)
    rb = b16.generate_batch([GenerationRequest(p, params) for p in prompts])
    rk = kv8.generate_batch([GenerationRequest(p, params) for p in prompts])
    worst, kv_moved = 0.0, 0.0
    for p, a, k in zip(prompts, rb, rk, strict=True):
        assert all(math.isfinite(v) for v in a.cand_logprobs)
        ref = torch.log_softmax(_ref_logits(hf, p, a.token_ids), -1)
        got = torch.tensor([_cands(a, j)[1] for j in range(8)], dtype=torch.float64)
        worst = max(worst, (got - ref).abs().max().item())
        n = next((j for j, (x, y) in enumerate(zip(a.token_ids, k.token_ids, strict=True)) if x != y), 8)
        if n:
            kv_moved = max(kv_moved, max(abs(x - y) for x, y in zip(a.cand_logprobs[: n * VOCAB], k.cand_logprobs[: n * VOCAB], strict=True)))
    assert worst < TOL["bf16"], worst
    assert kv_moved > 0  # FP8 KV is not a no-op


# ------------------------------------------------------------ batching, seeds


def test_same_seed_same_tokens_and_per_request_seed_is_batch_independent(untied):
    prompts = _prompts([2, 6, 4], seed=5)
    reqs = [GenerationRequest(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    a = BuiltinEngine(untied, get_profile("fp32"), "g", seed=9).generate_batch(reqs)
    b = BuiltinEngine(untied, get_profile("fp32"), "g", seed=9).generate_batch(reqs)
    c = BuiltinEngine(untied, get_profile("fp32"), "g", seed=10).generate_batch(reqs)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.logprobs for r in a] == [r.logprobs for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]
    assert request_seed(9, 0) != request_seed(9, 1) != request_seed(10, 0)
    own = GenerationRequest(prompts[1], SamplingParams(max_new_tokens=10, seed=77))
    e = BuiltinEngine(untied, get_profile("fp32"), "g", seed=1)
    alone = e.generate_batch([own])[0]
    mixed = e.generate_batch([reqs[0], own, reqs[2]])[1]
    assert alone.token_ids == mixed.token_ids


def test_ragged_batch_equals_one_at_a_time(tied):
    prompts = _prompts([1, 11, 4, 7, 2], seed=6)
    reqs = [
        GenerationRequest(p, SamplingParams(max_new_tokens=9, seed=100 + i, top_p=0.9 if i % 2 else 1.0))
        for i, p in enumerate(prompts)
    ]
    engine = BuiltinEngine(tied, get_profile("fp32"), "g", stop_on_eos=False)
    batch = engine.generate_batch(reqs)
    small = BuiltinEngine(tied, get_profile("fp32"), "g", max_batch=2, stop_on_eos=False).generate_batch(reqs)
    for i, r in enumerate(reqs):
        (one,) = engine.generate_batch([r])
        for other in (batch[i], small[i]):
            assert other.token_ids == one.token_ids
            assert other.cand_ids == one.cand_ids
            torch.testing.assert_close(torch.tensor(other.cand_logprobs), torch.tensor(one.cand_logprobs), atol=TOL["fp32"], rtol=0)


def test_support_buffer_and_step_by_step_listing_agree(untied, monkeypatch):
    import mixrl.sampling.builtin.running as running_mod

    reqs = [
        GenerationRequest(p, SamplingParams(max_new_tokens=7, seed=i, top_p=0.8 if i == 1 else 1.0,
                                            stop_ids=(3,) if i == 2 else ()))
        for i, p in enumerate(_prompts([3, 5, 2], seed=8))
    ]  # fmt: skip
    engine = BuiltinEngine(untied, get_profile("fp32"), "g", stop_on_eos=False)
    buffered = engine.generate_batch(reqs)
    monkeypatch.setattr(running_mod, "SUPPORT_BUFFER_BYTES", 0)
    listed = engine.generate_batch(reqs)
    for a, b in zip(buffered, listed, strict=True):
        assert (a.token_ids, a.cand_offsets, a.cand_ids) == (b.token_ids, b.cand_offsets, b.cand_ids)
        assert a.cand_logprobs == b.cand_logprobs


# ------------------------------------------------------------- stops and limits


def test_stop_ids_eos_and_lengths(untied):
    engine = BuiltinEngine(untied, get_profile("fp32"), "g", stop_on_eos=False)
    assert BuiltinEngine(untied, get_profile("fp32"), "g").eos_ids == {7}
    assert engine.eos_ids == frozenset()
    greedy = SamplingParams(top_k=1, max_new_tokens=10)
    (free,) = engine.generate_batch([GenerationRequest([3, 4], greedy)])
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    (r,) = engine.generate_batch([GenerationRequest([3, 4], SamplingParams(top_k=1, max_new_tokens=10, stop_ids=(stop,)))])
    assert r.finish_reason == "stop" and r.token_ids == free.token_ids[: first + 1]
    assert len(r.cand_offsets) == len(r.token_ids) + 1
    assert free.finish_reason == "length" and all(lp == 0.0 for lp in free.logprobs)  # top-1 is certain


def test_context_overflow_and_bad_prompts_fail_alone(untied):
    engine = BuiltinEngine(untied, get_profile("fp32"), "g", max_context=20, stop_on_eos=False)
    reqs = [
        GenerationRequest(list(range(1, 16)), SamplingParams(max_new_tokens=10), "near"),
        GenerationRequest(list(range(20)), SamplingParams(max_new_tokens=4), "full"),
        GenerationRequest(list(range(30)), SamplingParams(max_new_tokens=4), "over"),
        GenerationRequest([], SamplingParams(max_new_tokens=4), "empty"),
        GenerationRequest([1, VOCAB], SamplingParams(max_new_tokens=4), "oov"),
        GenerationRequest([1, 2], SamplingParams(max_new_tokens=4), "ok"),
    ]
    near, full, over, empty, oov, ok = engine.generate_batch(reqs)
    assert near.finish_reason == "length" and len(near.token_ids) == 5  # prompt + output = 20
    for r in (full, over):
        assert r.finish_reason == "context_exceeded" and r.token_ids == [] and "max_context is 20" in r.error
    assert empty.finish_reason == "error" and "empty" in empty.error
    assert oov.finish_reason == "error" and str(VOCAB) in oov.error
    assert ok.finish_reason == "length" and len(ok.token_ids) == 4
    with pytest.raises(ValueError, match="max_context"):
        BuiltinEngine(untied, get_profile("fp32"), "g", max_context=65)


def test_nonfinite_logits_end_one_request_as_numerical_error(untied):
    engine = BuiltinEngine(untied, get_profile("fp32"), "g", stop_on_eos=False)
    sd = {k: v.clone() for k, v in _hf(untied).state_dict().items()}
    sd["model.embed_tokens.weight"][50] = float("inf")  # token 50 poisons only its own row
    engine.load_weights(sd, version=3)
    bad, good = engine.generate_batch(
        [GenerationRequest([1, 50, 2], SamplingParams(max_new_tokens=5)), GenerationRequest([1, 2], SamplingParams(max_new_tokens=5))]
    )
    assert bad.finish_reason == "numerical_error" and bad.num_nonfinite == VOCAB and bad.token_ids == []
    assert "non-finite" in bad.error and bad.cand_offsets == [0]
    assert good.finish_reason == "length" and all(math.isfinite(v) for v in good.logprobs + good.cand_logprobs)
    assert good.version == bad.version == 3
    (hot,) = engine.generate_batch([GenerationRequest([1, 2], SamplingParams(max_new_tokens=5, temperature=1e-45))])
    assert hot.finish_reason == "numerical_error" and hot.num_nonfinite > 0  # logits / T overflow
    sd["lm_head.weight"][9] = float("inf")  # one infinite logit in every row
    engine.load_weights(sd, version=4)
    out = engine.generate_batch([GenerationRequest([1, 2], SamplingParams(max_new_tokens=5))])
    assert out[0].finish_reason == "numerical_error" and out[0].num_nonfinite == 1


# ------------------------------------------------------------ weights, factory


def test_load_weights_versions_prefixes_and_missing_names(untied):
    engine = BuiltinEngine(untied, get_profile("fp32"), "g", stop_on_eos=False)
    req = GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=4, seed=1))
    (before,) = engine.generate_batch([req])
    assert before.version == 0
    sd = {f"_orig_mod.{k}": v * 1.5 for k, v in _hf(untied).state_dict().items()}
    engine.load_weights(sd, version=12)
    (after,) = engine.generate_batch([req])
    assert after.version == engine.version == 12 and after.cand_logprobs != before.cand_logprobs
    for v in sd.values():  # the trainer steps in place: the served version must not move
        v.mul_(0.5)
    (again,) = engine.generate_batch([req])
    assert again.cand_logprobs == after.cand_logprobs
    del sd["_orig_mod.model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(KeyError, match="model.layers.1.mlp.down_proj.weight"):
        engine.load_weights(sd, version=13)
    assert engine.version == 12
    with pytest.raises(ValueError, match="version"):
        engine.load_weights(sd, version=-1)


def test_make_engine(untied):
    e = make_engine(untied, "fp32", "fp32", seed=2, max_batch=8)
    assert isinstance(e, BuiltinEngine) and e.group == "fp32" and e.max_batch == 8
    with pytest.raises(ValueError, match="Profile.engine"):
        make_engine(untied, SimpleNamespace(name="x", engine="tpu"), "x")
    vllm = with_overrides(get_profile("fp32"), engine="vllm")
    try:
        import mixrl.sampling.vllm.engine  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="vllm"):
            make_engine(untied, vllm, "x")
