"""The built-in engine's token budget: decoded chunks (and their KV caches) fit
``max_batch_tokens`` however many requests arrive, and the tokens do not change."""

from __future__ import annotations

import pytest
import torch

from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.sampling.factory import make_engine
from mixrl.sampling.profiles import get_profile, with_overrides

torch.set_num_threads(1)
VOCAB = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny")
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def requests(n: int) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()
        out.append(GenerationRequest(request_id=f"r{i}", prompt_ids=prompt,
                                     params=SamplingParams(max_new_tokens=3 + i % 6, seed=100 + i, record="none")))
    return out


def test_chunks_fit_the_budget_and_tokens_do_not_change(model_dir):
    budget = 90
    free = make_engine(model_dir, "fp32", "g", max_batch=64)
    bounded = make_engine(model_dir, with_overrides(get_profile("fp32"), max_batch_tokens=budget), "g", max_batch=64)
    assert bounded.max_batch_tokens == budget and free.max_batch_tokens is None
    allocated: list[tuple[int, int]] = []  # (rows, cache columns) of every decoded chunk
    begin = bounded.path.begin

    def spy(w, ids, start, length, **reuse):
        rows = reuse.get("rows")  # prefix sharing: rows copied from fewer prefilled ones
        allocated.append((int(ids.shape[0] if rows is None else len(rows)), int(length)))
        return begin(w, ids, start, length, **reuse)

    bounded.path.begin = spy
    reqs = requests(24)
    a, b = free.generate_batch(reqs), bounded.generate_batch(reqs)
    assert len(allocated) > 1 and all(rows * cols <= budget for rows, cols in allocated)
    assert sum(rows for rows, _ in allocated) == len(reqs)
    for x, y in zip(a, b, strict=True):  # per-request seeds: the same tokens in any batch
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-5)


def test_a_request_longer_than_the_budget_runs_alone(model_dir):
    eng = make_engine(model_dir, "fp32", "g", max_batch_tokens=10)
    out = eng.generate_batch(requests(3))
    assert [len(r.token_ids) > 0 for r in out] == [True] * 3
    assert all(r.timings["batch_size"] == 1.0 for r in out)


def test_budget_is_validated():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        with_overrides(get_profile("fp32"), max_batch_tokens=1)
