"""BatchingSampler: concurrent calls become batches, weights change only between
batches, and a failing engine fails every pending call with ReplicaFailure."""

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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=64)  # fmt: skip
    path = tmp_path_factory.mktemp("m")
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture
def engine(model_dir):
    return BuiltinEngine(model_dir, get_profile("fp32"), "g", stop_on_eos=False)


def _req(i: int, n: int = 5) -> GenerationRequest:
    return GenerationRequest([1 + i % 7, 2, 3], SamplingParams(max_new_tokens=n, seed=i), f"r{i}")


def test_concurrent_requests_are_batched_and_match_the_engine(engine, model_dir):
    async def go():
        s = BatchingSampler(engine, max_batch=4, max_wait_ms=50)
        out = await asyncio.gather(*[s.generate(_req(i)) for i in range(10)])
        await s.close()
        return s, out

    s, out = asyncio.run(go())
    assert s.batches == 3  # 4 + 4 + 2
    assert sorted(r.timings["sampler_batch"] for r in out) == [2.0] * 2 + [4.0] * 8
    direct = BuiltinEngine(model_dir, get_profile("fp32"), "g", stop_on_eos=False).generate_batch(
        [_req(i) for i in range(10)]
    )
    assert [r.token_ids for r in out] == [r.token_ids for r in direct]  # per-request seeds
    assert all(r.timings["queue_s"] >= 0 for r in out)


def test_weights_apply_between_batches_in_submission_order(engine, model_dir):
    new_sd = {k: v * 1.3 for k, v in engine_state(model_dir).items()}

    async def go():
        s = BatchingSampler(engine, max_batch=2, max_wait_ms=20)
        before = [asyncio.create_task(s.generate(_req(i, 6))) for i in range(3)]
        await asyncio.sleep(0)  # the three are queued before the update
        load = asyncio.create_task(s.load_weights(new_sd, 5))
        await asyncio.sleep(0)
        after = [asyncio.create_task(s.generate(_req(i, 6))) for i in range(3)]
        await load
        assert s.version == 5
        res = await asyncio.gather(*before), await asyncio.gather(*after)
        await s.close()
        return res

    before, after = asyncio.run(go())
    assert [r.version for r in before] == [0, 0, 0] and [r.version for r in after] == [5, 5, 5]
    old_e = BuiltinEngine(model_dir, get_profile("fp32"), "g", stop_on_eos=False)
    new_e = BuiltinEngine(model_dir, get_profile("fp32"), "g", stop_on_eos=False)
    new_e.load_weights(new_sd, 5)
    reqs = [_req(i, 6) for i in range(3)]
    # every token of a result comes from one version: identical to that version run alone
    for got, ref in [(before, old_e.generate_batch(reqs)), (after, new_e.generate_batch(reqs))]:
        for a, b in zip(got, ref, strict=True):
            assert a.token_ids == b.token_ids
            # batch composition changes float rounding only (1e-5 is far below the 1.3x change)
            torch.testing.assert_close(torch.tensor(a.cand_logprobs), torch.tensor(b.cand_logprobs), atol=1e-5, rtol=0)
    assert before[0].token_ids != after[0].token_ids


def engine_state(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


class _Gone:
    """Weights that fail whatever reads them (None would mean: rebuild the checkpoint's, lazily)."""

    def __getattr__(self, name):
        raise RuntimeError("this replica's weights are gone")


def test_engine_exception_fails_every_pending_call(engine):
    async def go():
        s = BatchingSampler(engine, max_batch=2, max_wait_ms=1)
        ok = await s.generate(_req(0))
        engine.weights = _Gone()  # the replica breaks: generate_batch raises inside the worker
        calls = [asyncio.create_task(s.generate(_req(i))) for i in range(5)]
        res = await asyncio.gather(*calls, return_exceptions=True)
        with pytest.raises(ReplicaFailure):
            await s.generate(_req(9))
        return ok, res

    ok, res = asyncio.run(go())
    assert ok.finish_reason == "length"
    assert len(res) == 5 and all(isinstance(r, ReplicaFailure) for r in res)
    # the broken replica's own error is the cause: a batch opened before the break sees that its
    # weights are gone (RuntimeError), one opened after it trips over them (AttributeError)
    assert isinstance(res[0].__cause__, RuntimeError | AttributeError) and "sampler 'g' failed" in str(res[0])


def test_failed_weight_load_is_a_replica_failure(engine):
    async def go():
        s = BatchingSampler(engine)
        with pytest.raises(ReplicaFailure, match=r"state_dict has no .model\.layers\.0\..*expected HF parameter names"):
            await s.load_weights({"model.embed_tokens.weight": torch.zeros(64, 32)}, 1)
        with pytest.raises(ReplicaFailure):
            await s.generate(_req(0))

    asyncio.run(go())
    assert engine.version == 0  # the old weights stay whole


def test_bad_request_fails_alone_and_cancelled_call_does_not_stall(engine):
    async def go():
        s = BatchingSampler(engine, max_batch=8, max_wait_ms=30)
        gone = asyncio.create_task(s.generate(_req(1)))
        await asyncio.sleep(0)
        gone.cancel()
        bad = s.generate(GenerationRequest([], SamplingParams(max_new_tokens=3)))
        good = s.generate(_req(2))
        out = await asyncio.gather(bad, good)
        await s.close()
        return out

    bad, good = asyncio.run(go())
    assert bad.finish_reason == "error" and good.finish_reason == "length"


def test_invalid_arguments(engine):
    with pytest.raises(ValueError, match="max_batch"):
        BatchingSampler(engine, max_batch=0)
    with pytest.raises(ValueError, match="max_wait_ms"):
        BatchingSampler(engine, max_wait_ms=-1)


def test_idle_window_gathers_a_trickle_and_closes_after_a_quiet_gap(engine):
    async def go():
        s = BatchingSampler(engine, max_batch=16, max_wait_ms=5000, idle_ms=150)
        trickle = []
        for i in range(5):  # 20 ms apart: each within idle_ms of the last, all past a 5 ms window
            trickle.append(asyncio.create_task(s.generate(_req(i))))
            await asyncio.sleep(0.02)
        t0 = asyncio.get_running_loop().time()
        first = await asyncio.gather(*trickle)
        waited = asyncio.get_running_loop().time() - t0
        lone = await s.generate(_req(9))
        await s.close()
        return s, first, lone, waited

    s, first, lone, waited = asyncio.run(go())
    assert [r.timings["sampler_batch"] for r in first] == [5.0] * 5
    assert lone.timings["sampler_batch"] == 1.0 and s.batches == 2
    assert waited < 4.0  # closed by the quiet gap, not by max_wait_ms


def test_invalid_idle_window(engine):
    with pytest.raises(ValueError, match="idle_ms"):
        BatchingSampler(engine, idle_ms=-1)


class _Slow:
    """The real engine, as if its batches took ``delay`` seconds longer (a bigger model)."""

    def __init__(self, engine, delay: float) -> None:
        self.engine, self.delay, self.group = engine, delay, engine.group

    @property
    def version(self) -> int:
        return self.engine.version

    def generate_batch(self, requests):
        import time

        time.sleep(self.delay)
        return self.engine.generate_batch(requests)


def test_quiet_gap_grows_with_the_engines_batch_time(engine):
    async def go(delay: float):
        s = BatchingSampler(_Slow(engine, delay), max_batch=16, max_wait_ms=5000, idle_ms=10)
        await s.generate(_req(0))  # one batch: its run time sets the gap
        s.engine.delay = 0.0
        await s.generate(_req(1))  # a short batch after it does not shrink the gap
        trickle = []
        for i in range(4):  # 40 ms apart
            trickle.append(asyncio.create_task(s.generate(_req(i))))
            await asyncio.sleep(0.04)
        out = await asyncio.gather(*trickle)
        await s.close()
        return [r.timings["sampler_batch"] for r in out]

    assert asyncio.run(go(1.5)) == [4.0] * 4  # gap 150 ms: the trickle joins one batch
    assert max(asyncio.run(go(0.0))) < 4.0  # gap 10 ms: it is split
