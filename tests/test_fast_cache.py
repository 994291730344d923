"""The generic path's growing KV cache: the same keys/values as HF's DynamicCache through
prefill, decode steps, buffer growth, row selection and replaced tensors; and the generic
engine's log-probs unchanged by it (against a run on HF's own DynamicLayer)."""

import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM
from transformers.cache_utils import DynamicLayer

from mixrl.sampling.builtin import hf_cache
from mixrl.sampling.builtin.hf_cache import GrowingLayer, QuantizedKVCache


def _kv(b, t, g):
    return torch.randn(b, 2, t, 8, generator=g), torch.randn(b, 2, t, 8, generator=g)


def test_growing_layer_matches_dynamic_cache():
    g = torch.Generator().manual_seed(0)
    ours, ref = QuantizedKVCache(None), DynamicCache()
    for t in [5] + [1] * 150:  # prefill, then past two buffer growths
        k, v = _kv(3, t, g)
        a, b = ours.update(k, v, 0), ref.update(k, v, 0)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert type(ours.layers[0]) is GrowingLayer
    assert ours.layers[0]._bk.shape[2] > ours.get_seq_length()  # spare columns: written in place
    ptr = ours.layers[0]._bk.data_ptr()
    idx = torch.tensor([2, 0])
    ours.keep_rows(idx), ref.batch_select_indices(idx)
    k, v = _kv(2, 1, g)
    a, b = ours.update(k, v, 0), ref.update(k, v, 0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert ours.layers[0]._bk.data_ptr() == ptr  # rows compacted in place, no new buffer
    # keys replaced from outside (the generic path's trim): the next write starts a new buffer
    for c in (ours, ref):
        c.layers[0].keys, c.layers[0].values = c.layers[0].keys[:, :, 4:], c.layers[0].values[:, :, 4:]
    k, v = _kv(2, 1, g)
    a, b = ours.update(k, v, 0), ref.update(k, v, 0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert ours.get_seq_length() == ref.get_seq_length() == 153


def test_generic_engine_logprobs_unchanged(tmp_path, monkeypatch):
    from mixrl.records.generation import GenerationRequest, SamplingParams
    from mixrl.sampling.builtin.engine import BuiltinEngine
    from mixrl.sampling.profiles import get_profile

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)  # fmt: skip
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    # rows of different lengths: padding, rows finishing early (row selection), growth past 64 columns
    reqs = [GenerationRequest(list(range(1, 2 + 3 * i)), SamplingParams(max_new_tokens=20 + 25 * i, seed=i))
            for i in range(4)]  # fmt: skip

    def run():
        e = BuiltinEngine(str(tmp_path), get_profile("fp32"), "g", forward="generic", stop_on_eos=False, max_batch=4)
        return e.generate_batch(reqs)

    ours = run()
    monkeypatch.setattr(hf_cache, "GrowingLayer", DynamicLayer)  # HF's concatenating layer
    monkeypatch.setattr(QuantizedKVCache, "__init__", lambda self, q, config=None, capacity=0: (
        DynamicCache.__init__(self, config=config), setattr(self, "quantize", q))[0])  # fmt: skip
    ref = run()
    for a, b in zip(ours, ref, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-5


def test_fast_path_reuses_kv_storage(tmp_path):
    from mixrl.records.generation import GenerationRequest, SamplingParams
    from mixrl.sampling.builtin.engine import BuiltinEngine
    from mixrl.sampling.profiles import get_profile

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)  # fmt: skip
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    e = BuiltinEngine(str(tmp_path), get_profile("fp32"), "g", stop_on_eos=False, max_batch=4)
    assert e.path_name == "qwen3-fast"
    reqs = [GenerationRequest(list(range(1, 2 + 3 * i)), SamplingParams(max_new_tokens=10 + 7 * i, seed=i))
            for i in range(4)]  # fmt: skip
    first = e.generate_batch(reqs)
    pool = e.path._pool
    assert pool.idle is not None  # the dropped batch's storage is kept
    with torch.inference_mode():
        pool.idle.fill_(float("nan"))  # whatever it held must not reach the next batch
    ptr = pool.idle.data_ptr()
    again = e.generate_batch(reqs)
    assert pool.idle is not None and pool.idle.data_ptr() == ptr  # reused, then returned
    for a, b in zip(first, again, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    longer = [GenerationRequest(list(range(1, 30)), SamplingParams(max_new_tokens=60, seed=9))] * 4
    assert all(len(r.token_ids) == 60 for r in e.generate_batch(longer))
    assert pool.idle.numel() > 0 and pool.idle.data_ptr() != ptr  # too small: a larger one replaced it
