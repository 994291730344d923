"""Continuous batching: requests that join a running batch between decode steps get the
same tokens as alone (log q within FP32 kernel rounding, and equal to HF's full forward),
fail alone, never mix weights versions, and BatchingSampler admits them mid-batch."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.sampling.base import ReplicaFailure
from mixrl.sampling.batching import BatchingSampler
from mixrl.sampling.builtin.engine import BuiltinEngine
from mixrl.sampling.profiles import get_profile

torch.set_num_threads(1)
VOCAB = 96
TOL = 1e-5  # FP32: batch composition changes kernel rounding only


def _scaled(model, path) -> str:
    with torch.no_grad():  # larger than the init so that distributions are not near-uniform
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    return _scaled(Qwen3ForCausalLM(cfg), tmp_path_factory.mktemp("dense"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
    return _scaled(Qwen3MoeForCausalLM(cfg), tmp_path_factory.mktemp("moe"))


def _req(n_prompt: int, n_new: int, seed: int, vocab: int = VOCAB, **kw) -> GenerationRequest:
    g = torch.Generator().manual_seed(1000 + seed)
    prompt = torch.randint(0, vocab, (n_prompt,), generator=g).tolist()
    return GenerationRequest(prompt, SamplingParams(max_new_tokens=n_new, seed=seed, **kw), f"r{seed}")


def _drain(run, out: dict) -> None:
    while run.rows:
        out.update(run.step())


def _same(got, alone) -> None:
    assert got.token_ids == alone.token_ids
    assert got.cand_offsets == alone.cand_offsets and got.cand_ids == alone.cand_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=TOL, rtol=0)
    torch.testing.assert_close(torch.tensor(got.cand_logprobs), torch.tensor(alone.cand_logprobs), atol=TOL, rtol=0)
    assert got.routed_experts == alone.routed_experts


def _hf_logprobs(path: str, prompt: list[int], out: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0].double()
    lp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(out)], -1)
    return lp.gather(1, torch.tensor(out)[:, None]).squeeze(1)


@pytest.mark.parametrize("forward", ["fast", "generic"])
def test_rows_joining_mid_batch_match_alone_and_hf(dense, forward):
    e = BuiltinEngine(dense, get_profile("fp32"), "g", stop_on_eos=False, forward=forward)
    first = {"a": _req(3, 12, 1), "b": _req(5, 12, 2)}
    late = {"c": _req(11, 8, 3),  # longer than the 8 columns written when it joins: the batch shifts
            "d": _req(2, 5, 4, top_p=0.9), "h": _req(4, 6, 5, record="head:3")}  # fmt: skip
    run, out = e.stream(), {}
    assert run.add(list(first.items())) == [] and run.fill() == 2
    for _ in range(3):
        out.update(run.step())
    assert run.add(list(late.items())) == [] and run.fill() == 3 and run.cohorts == 2
    _drain(run, out)
    assert run.idle and sorted(out) == ["a", "b", "c", "d", "h"]
    assert out["c"].timings["batch_size"] == 5 and out["c"].timings["joined"] == 3  # it joined a running batch
    for k, r in {**first, **late}.items():
        _same(out[k], e.generate_batch([r])[0])
    c = out["c"]  # exact behaviour log-probs: FP32 identity with the trainer's full forward
    ref = _hf_logprobs(dense, late["c"].prompt_ids, c.token_ids)
    torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), ref, atol=TOL, rtol=0)


def test_moe_rows_joining_record_their_routed_experts(moe):
    e = BuiltinEngine(moe, get_profile("fp32"), "g", stop_on_eos=False)
    assert e.path_name == "generic"
    reqs = {"a": _req(4, 10, 1, vocab=64), "b": _req(9, 6, 2, vocab=64), "c": _req(2, 4, 3, vocab=64)}
    run, out = e.stream(), {}
    run.add([("a", reqs["a"])])
    run.fill()
    out.update(run.step())
    out.update(run.step())
    run.add([("b", reqs["b"]), ("c", reqs["c"])])
    run.fill()
    _drain(run, out)
    for k, r in reqs.items():
        alone = e.generate_batch([r])[0]
        assert out[k].routed_experts is not None and len(out[k].routed_experts) == len(out[k].token_ids)
        _same(out[k], alone)


def test_bad_requests_fail_alone_and_a_new_version_never_joins(dense):
    e = BuiltinEngine(dense, get_profile("fp32"), "g", stop_on_eos=False)
    a, b = _req(3, 10, 1), _req(6, 4, 2)
    run, out = e.stream(), {}
    run.add([("a", a)])
    run.fill()
    out.update(run.step())
    failed = dict(run.add([("empty", GenerationRequest([], SamplingParams())), ("oov", GenerationRequest([VOCAB], SamplingParams())),
                           ("b", b)]))  # fmt: skip
    assert failed["empty"].finish_reason == "error" and failed["oov"].finish_reason == "error"
    run.fill(max_rows=1)  # full: b waits for a row to leave
    assert len(run.rows) == 1 and len(run.pending) == 1
    from transformers import AutoModelForCausalLM

    sd = {k: v * 1.3 for k, v in AutoModelForCausalLM.from_pretrained(dense).state_dict().items()}
    e.load_weights(sd, 7)
    with pytest.raises(RuntimeError, match="version 0"):
        run.add([("late", _req(3, 3, 9))])
    _drain(run, out)  # the running row finishes on the version it started with
    run.fill()
    _drain(run, out)
    assert out["a"].version == out["b"].version == 0
    old = BuiltinEngine(dense, get_profile("fp32"), "g", stop_on_eos=False)
    _same(out["a"], old.generate_batch([a])[0])
    _same(out["b"], old.generate_batch([b])[0])
    assert e.generate_batch([a])[0].version == 7


def _slow(e: BuiltinEngine) -> BuiltinEngine:
    """Each decode step takes 5 ms longer (a bigger model): time for requests to arrive mid-batch."""
    import time

    logits = e.path.logits

    def slow(w, hidden):
        time.sleep(0.005)
        return logits(w, hidden)

    e.path.logits = slow
    return e


def test_sampler_admits_requests_while_a_batch_decodes(dense):
    e = _slow(BuiltinEngine(dense, get_profile("fp32"), "g", stop_on_eos=False))
    long, short = _req(3, 60, 1), [_req(4 + i, 3, 10 + i) for i in range(3)]

    async def go():
        s = BatchingSampler(e, max_batch=8, max_wait_ms=1)
        first = asyncio.create_task(s.generate(long))
        while s.batches == 0:  # the long request is decoding
            await asyncio.sleep(0.001)
        done = await asyncio.gather(*(s.generate(r) for r in short))
        running = not first.done()
        res = await first
        await s.close()
        return s, res, done, running

    s, res, done, running = asyncio.run(go())
    assert running  # the short requests finished while the long one was still decoding
    # the three short requests joined the long one's batch (together, or split if the worker took
    # the inbox between two submissions: thread timing, not behaviour)
    assert 2 <= s.batches <= 4 and all(2 <= r.timings["batch_size"] <= 4 for r in done)
    assert all(1 <= r.timings["sampler_batch"] <= 3 for r in done)
    for got, r in zip([res, *done], [long, *short], strict=True):
        _same(got, e.generate_batch([r])[0])


def test_sampler_weights_wait_for_the_running_rows_then_apply(dense):
    from transformers import AutoModelForCausalLM

    e = _slow(BuiltinEngine(dense, get_profile("fp32"), "g", stop_on_eos=False))
    sd = {k: v * 1.3 for k, v in AutoModelForCausalLM.from_pretrained(dense).state_dict().items()}
    long, before, after = _req(3, 40, 1), _req(5, 4, 2), _req(5, 4, 2)

    async def go():
        s = BatchingSampler(e, max_batch=8, max_wait_ms=1)
        t_long = asyncio.create_task(s.generate(long))
        while s.batches == 0:
            await asyncio.sleep(0.001)
        t_before = asyncio.create_task(s.generate(before))  # joins the running batch
        await asyncio.sleep(0)
        t_load = asyncio.create_task(s.load_weights(sd, 5))
        await asyncio.sleep(0)
        t_after = asyncio.create_task(s.generate(after))  # sent after the load: the new version
        out = await asyncio.gather(t_long, t_before, t_after)
        await t_load
        await s.close()
        return out

    r_long, r_before, r_after = asyncio.run(go())
    assert (r_long.version, r_before.version, r_after.version) == (0, 0, 5)
    old = BuiltinEngine(dense, get_profile("fp32"), "g", stop_on_eos=False)
    _same(r_long, old.generate_batch([long])[0])
    _same(r_before, old.generate_batch([before])[0])
    _same(r_after, e.generate_batch([after])[0])
    assert r_after.token_ids != r_before.token_ids or r_after.logprobs != r_before.logprobs


def test_sampler_engine_failure_mid_batch_fails_every_call(dense):
    e = _slow(BuiltinEngine(dense, get_profile("fp32"), "g", stop_on_eos=False))

    async def go():
        s = BatchingSampler(e, max_batch=8, max_wait_ms=1)
        t_long = asyncio.create_task(s.generate(_req(3, 40, 1)))
        while s.batches == 0:
            await asyncio.sleep(0.001)
        e.path.begin = None  # the next prefill (a row joining) raises inside the worker
        res = await asyncio.gather(t_long, s.generate(_req(4, 3, 2)), return_exceptions=True)
        with pytest.raises(ReplicaFailure):
            await s.generate(_req(4, 3, 3))
        return res

    res = asyncio.run(go())
    assert all(isinstance(r, ReplicaFailure) for r in res) and isinstance(res[0].__cause__, TypeError)


def test_threadsafe_join_reaches_the_sink_from_the_engine_thread(dense):
    import threading

    from transformers import AutoModelForCausalLM

    e = _slow(BuiltinEngine(dense, get_profile("fp32"), "g", stop_on_eos=False))
    sd = {k: v * 1.3 for k, v in AutoModelForCausalLM.from_pretrained(dense).state_dict().items()}
    long, joined, late = _req(3, 40, 1), _req(5, 4, 2), _req(5, 4, 3)
    got: dict = {}
    where: set = set()

    def sink(items):
        where.add(threading.current_thread().name)
        got.update(items)

    async def go():
        s = BatchingSampler(e, max_batch=8, max_wait_ms=1)
        idle = s.join_threadsafe(joined, "j", sink)  # no batch runs yet: refused, nothing queued
        t_long = asyncio.create_task(s.generate(long))
        while s.batches == 0:
            await asyncio.sleep(0.001)
        ok = await asyncio.to_thread(s.join_threadsafe, joined, "j", sink)  # from another thread
        while "j" not in got:
            await asyncio.sleep(0.001)
        t_load = asyncio.create_task(s.load_weights(sd, 7))
        await asyncio.sleep(0)  # the weights item is submitted: the batch admits no more
        late_ok = s.join_threadsafe(late, "late", sink)
        r_long = await t_long
        await t_load
        await s.close()
        return idle, ok, late_ok, r_long

    idle, ok, late_ok, r_long = asyncio.run(go())
    assert (idle, ok, late_ok) == (False, True, False) and set(got) == {"j"}
    assert threading.current_thread().name not in where  # delivered from the engine's thread
    old = BuiltinEngine(dense, get_profile("fp32"), "g", stop_on_eos=False)
    _same(got["j"], old.generate_batch([joined])[0])
    _same(r_long, old.generate_batch([long])[0])
    assert got["j"].version == 0 and got["j"].timings["queue_s"] >= 0
