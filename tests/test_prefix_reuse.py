"""KV reuse in the built-in engine (``sampling/builtin/prefix_cache``): a group's shared prompt
prefilled once, a session's KV kept between turns. Reuse on and off give the same tokens and
log q within FP32 rounding, on both paths and every KV format; the reused turn's log q matches
HF's float64 full forward; the accounting is exact; the store keeps its byte budget (LRU) and
its version rule; the fleet sums the counts per group; the endpoint passes the session on.

Models: tiny random Qwen3s (2 layers, hidden 64, GQA 4/2 heads, vocab 96).
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from tolerance import assert_close

from mixrl.numerics.formats import ROW_FORMATS
from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.sampling.builtin.engine import BuiltinEngine
from mixrl.sampling.builtin.prefix_cache import Entry, PrefixStore, common_prefix
from mixrl.sampling.profiles import get_profile, with_overrides

torch.set_num_threads(1)
VOCAB = 96
FP32 = 1e-5  # max |log q engine - log q float64 reference| (nats), as tests/test_engine.py


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)  # fmt: skip
    m = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # larger than the init so that distributions are not near-uniform
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    path = tmp_path_factory.mktemp("prefix") / "m"
    m.save_pretrained(path)
    return str(path)


def _engine(path: str, kv: str = "none", forward: str = "fast", reuse: bool = True, **kw) -> BuiltinEngine:
    prof = with_overrides(get_profile("fp32"), kv_format=kv, **kw.pop("profile", {}))
    return BuiltinEngine(path, prof, "g", seed=3, stop_on_eos=False, forward=forward, prefix_reuse=reuse, **kw)


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _req(prompt: list[int], seed: int, session: str = "", n: int = 6, **kw) -> GenerationRequest:
    return GenerationRequest(list(prompt), SamplingParams(max_new_tokens=n, seed=seed, **kw), session=session)


def _same(a, b) -> None:
    """Same tokens; log q equal within FP32 rounding (the project's float32 tolerance)."""
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert_close(x.logprobs, y.logprobs, kind="f32")
        assert_close(x.cand_logprobs, y.cand_logprobs, kind="f32")


def _stream(e: BuiltinEngine, reqs: list[GenerationRequest]) -> list:
    """``reqs`` join a running batch (continuous batching) two steps after a longer request."""
    run, out = e.stream(), {}
    run.add([(0, _req(_ids(9, 99), 1, n=14))])
    run.fill()
    run.step(), run.step()
    run.add([(i + 1, r) for i, r in enumerate(reqs)])
    run.fill()
    while run.rows:
        out.update(run.step())
    return [out[k] for k in sorted(out)][1:]


def _turns(e: BuiltinEngine) -> list[list]:
    """Three turns of five sessions: four share a prompt (a group), turns 2 and 3 extend each
    session's conversation (turn 3 joins a running batch); the same requests for any engine."""
    prompt, other = _ids(12, 1), _ids(7, 2)
    sessions = [f"s{i}" for i in range(5)]
    r1 = [_req(prompt, 100 + i, s) for i, s in enumerate(sessions[:4])] + [_req(other, 7, sessions[4], top_p=0.9)]
    a = e.generate_batch(r1)
    r2 = [_req(r.prompt_ids + x.token_ids + [5, 6, 7], 200 + i, r.session) for i, (r, x) in enumerate(zip(r1, a, strict=True))]
    b = e.generate_batch(r2)
    r3 = [_req(r.prompt_ids + x.token_ids + [9], 300 + i, r.session) for i, (r, x) in enumerate(zip(r2, b, strict=True))]
    return [a, b, _stream(e, r3)]


# ------------------------------------------------------------------ the pieces


def test_common_prefix_matches_brute_force():
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(12))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(6))]
        want = 0
        while want < min(len(a), len(b)) and a[want] == b[want]:
            want += 1
        assert common_prefix(a, b) == want == common_prefix(b, a)


def _entry(n: int, version: int = 0) -> Entry:
    return Entry(list(range(n)), torch.zeros(4, 2, n, 8), version)  # 4 * 2 * 8 * 4 bytes = 256 per token


def test_store_lru_budget_and_versions():
    store = PrefixStore(budget=256 * 10)
    assert store.put("a", _entry(4)) == 0 and store.put("b", _entry(4)) == 0
    assert store.take("a", list(range(6)), 0)[1] == 4  # covers 4 tokens; "a" leaves the store
    assert store.put("a", _entry(5)) == 0  # now the most recently used
    assert store.put("c", _entry(3)) == 1  # 4 + 5 + 3 > 10 tokens: "b", the least recent, goes
    assert list(store.entries) == ["a", "c"] and store.bytes == 256 * 8 and store.evictions == 1
    assert store.put("big", _entry(11)) == 0 and "big" not in store.entries  # larger than the budget
    assert store.peak == max(256 * 9, 256 * 8)
    assert store.take("c", [0, 1, 2], 0)[1] == 2  # at most all but the prompt's last token
    assert store.take("zz", [0, 1], 0) is None
    store.put("c", _entry(3))
    store.drop_older(1)  # a weights load: everything older goes
    assert not store.entries and store.bytes == 0 and store.invalidated == 2
    lax = PrefixStore(budget=1 << 20, across_versions=True)
    lax.put("a", _entry(4, version=0))
    lax.drop_older(2)
    entry, n = lax.take("a", list(range(9)), 2)
    assert n == 4 and entry.version == 0
    with pytest.raises(ValueError, match="kv_retain_bytes"):
        PrefixStore(-1)


# ------------------------------------------------------------------ the engine


@pytest.mark.parametrize("forward", ["fast", "generic"])
@pytest.mark.parametrize("kv", ROW_FORMATS)
def test_reuse_gives_the_tokens_and_logprobs_of_separate_prefills(model, forward, kv):
    on, off = _engine(model, kv, forward), _engine(model, kv, forward, reuse=False)
    got, want = _turns(on), _turns(off)
    for a, b in zip(got, want, strict=True):
        _same(a, b)
    t1, t2, t3 = ([r.timings for r in turn] for turn in got)
    # turn 1: the group's 12-token prompt prefilled once, copied to its three siblings
    assert [t["prefill_tokens"] for t in t1] == [12, 0, 0, 0, 7]
    assert [t["reused_tokens"] for t in t1] == [0, 12, 12, 12, 0]
    # turn 2: prompt + 6 generated (the last never fed) kept; 3 new tokens + the last generated
    assert [t["prefill_tokens"] for t in t2] == [4] * 5
    assert [t["reused_tokens"] for t in t2] == [17, 17, 17, 17, 12]
    # turn 3, joining a running batch: 1 new token + the last generated one
    assert [t["prefill_tokens"] for t in t3] == [2] * 5
    assert [t["reused_tokens"] for t in t3] == [26, 26, 26, 26, 21]
    for g_turn, w_turn in zip(got, want, strict=True):  # reuse off: every prompt token computed
        for x, y in zip(g_turn, w_turn, strict=True):
            assert y.timings["reused_tokens"] == 0
            assert y.timings["prefill_tokens"] == x.timings["prefill_tokens"] + x.timings["reused_tokens"]
    assert on.kv_store.bytes <= on.kv_store.budget and on.kv_store.peak > 0


def test_reused_turn_matches_float64_full_forward(model):
    """The second turn's log q, computed over a reused prefix, against HF's float64 forward
    of the whole conversation (temperature 0.8, top-k 20: the sampling formula in float64)."""
    from transformers import AutoModelForCausalLM

    e = _engine(model)
    first = _req(_ids(10, 5), 1, "s", temperature=0.8, top_k=20)
    a = e.generate_batch([first])[0]
    second = _req(first.prompt_ids + a.token_ids + [3, 4], 2, "s", n=8, temperature=0.8, top_k=20)
    b = e.generate_batch([second])[0]
    assert b.timings["reused_tokens"] == 15 and b.timings["prefill_tokens"] == 3
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([second.prompt_ids + b.token_ids])).logits[0]
    P = len(second.prompt_ids)
    for j, tok in enumerate(b.token_ids):
        z = logits[P - 1 + j] / 0.8
        keep = z.topk(20).indices
        ref = z[tok] - torch.logsumexp(z[keep], 0)
        assert tok in keep.tolist()
        assert abs(b.logprobs[j] - float(ref)) < FP32


def test_weights_version_drops_kept_kv_unless_the_profile_opts_in(model):
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(model).state_dict()
    sd1 = {k: v * 1.01 for k, v in sd.items()}
    for across in (False, True):
        e = _engine(model, profile={"kv_reuse_across_versions": across})
        first = _req(_ids(10, 6), 1, "s")
        a = e.generate_batch([first])[0]
        e.load_weights(sd1, 1)
        b = e.generate_batch([_req(first.prompt_ids + a.token_ids + [3], 2, "s")])[0]
        if across:  # reused, and the mismatch it adds is recorded with the result
            assert b.timings["reused_tokens"] == 15 and b.timings["reused_stale_tokens"] == 15
            assert b.timings["reused_stale_versions"] == 1
        else:
            assert b.timings["reused_tokens"] == 0 and "reused_stale_tokens" not in b.timings
            assert e.kv_store.invalidated == 1


def test_budget_bounds_the_kept_kv_and_evictions_are_counted(model):
    # one kept session here: 2 layers x (K, V) x 2 heads x 16 dims x 4 bytes = 512 bytes per token
    e = _engine(model, kv_retain_bytes=512 * 40)
    results = e.generate_batch([_req(_ids(12, 10 + i), i, f"s{i}") for i in range(6)])  # 17 tokens each
    evicted = sum(r.timings["kv_evictions"] for r in results)
    assert evicted == e.kv_store.evictions == 4 and len(e.kv_store.entries) == 2
    assert e.kv_store.peak <= e.kv_store.budget
    off = _engine(model, kv_retain_bytes=0)
    assert off.kv_store is None and off.prefix_reuse  # sharing within a cohort still on


def test_fleet_sums_the_counts_per_group(model):
    from transformers import AutoModelForCausalLM

    from mixrl.config import build_config
    from mixrl.fleet.fleet import Fleet, GroupSpec
    from mixrl.runtime.backends.embedded import EmbeddedBackend
    from mixrl.weights.store import WeightStore, copy_state_dict

    async def main() -> dict[str, float]:
        cfg = build_config({"fleet": {"groups": [{"name": "a", "profile": "fp32", "replicas": 1}]}})
        backend = EmbeddedBackend(cfg, model, None)
        fleet = Fleet([GroupSpec("a", 1.0, 1, 0, 1)], backend.make_sampler, WeightStore(), seed=0)
        fleet.publish(0, copy_state_dict(AutoModelForCausalLM.from_pretrained(model).state_dict()))
        await fleet.start()
        try:
            first = _req(_ids(10, 7), 1)  # no session of its own: the fleet's session key is used
            a = await fleet.generate("s", first)
            await fleet.generate("s", _req(first.prompt_ids + a.token_ids + [3], 2))
            return fleet.metrics()
        finally:
            await fleet.close()

    m = asyncio.run(main())
    assert m["sampler/prefill_tokens/a"] == 10 + 2 and m["sampler/reused_tokens/a"] == 15
    assert m["sampler/kv_evictions/a"] == 0


def test_endpoint_session_reuses_its_recorded_prefix(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mixrl.models.chat import ChatFormat
    from mixrl.models.policy import tiny_config
    from mixrl.models.tokenizer import save_tokenizer
    from mixrl.sampling.batching import BatchingSampler
    from mixrl.sampling.factory import make_engine
    from mixrl.serve.core import ServeCore

    path = tmp_path / "tiny"  # the bundled tokenizer and its chat template, a tiny random policy
    tok = save_tokenizer(path)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(len(tok), layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64,
                                                 max_positions=1024, pad_id=tok.pad_token_id,
                                                 eos_id=tok.eos_token_id)).save_pretrained(path)
    sampler = BatchingSampler(make_engine(str(path), "fp32", "fp32", seed=0, max_batch=8), max_batch=8)
    seen = []

    async def generate(session, request):
        res = await sampler.generate(request)
        seen.append((request, res))
        return res

    core = ServeCore(ChatFormat(AutoTokenizer.from_pretrained(str(path))), generate, model="tiny", max_total_tokens=400)

    async def main() -> None:
        msgs = [{"role": "user", "content": "2+3?"}]
        out = await core.chat_completion({"messages": msgs, "max_tokens": 6, "seed": 1}, "conv")
        msgs += [out["choices"][0]["message"], {"role": "user", "content": "and 4+4?"}]
        await core.chat_completion({"messages": msgs, "max_tokens": 6, "seed": 2}, "conv")
        await sampler.close()

    asyncio.run(main())
    (r1, a), (r2, b) = seen
    assert r1.session == r2.session == "conv"
    kept = len(r1.prompt_ids) + len(a.token_ids) - 1
    assert r2.prompt_ids[:kept] == (r1.prompt_ids + a.token_ids)[:kept]
    assert b.timings["reused_tokens"] == kept  # the extending request prefills only the rest
    assert b.timings["prefill_tokens"] == len(r2.prompt_ids) - kept


def _hf_model(path, cls: str, **extra) -> str:
    import transformers

    cfg = getattr(transformers, cls)(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                     max_position_embeddings=256, tie_word_embeddings=False, **extra)  # fmt: skip
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    m.save_pretrained(path)
    return str(path)


def test_moe_routing_is_copied_with_the_shared_rows(tmp_path):
    path = _hf_model(tmp_path, "Qwen3MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    on, off = _engine(path, forward="generic"), _engine(path, forward="generic", reuse=False)
    assert on.prefix_reuse
    got, want = _turns(on), _turns(off)
    for a, b in zip(got, want, strict=True):
        _same(a, b)
        for x, y in zip(a, b, strict=True):  # the first token's experts come from the shared prefill
            assert x.routed_experts is not None and x.routed_experts == y.routed_experts
    assert got[0][1].timings["reused_tokens"] == 12 and got[1][0].timings["reused_tokens"] == 17


def test_sliding_window_models_do_not_reuse(tmp_path):
    path = _hf_model(tmp_path, "MistralConfig", sliding_window=8)
    e = _engine(path, forward="generic")
    assert not e.prefix_reuse and e.kv_store is None  # a sliding layer counts its own columns
    res = e.generate_batch([_req(_ids(12, 1), 1, "s")] * 2)
    assert [r.timings["reused_tokens"] for r in res] == [0, 0]
