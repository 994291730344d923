"""Byte bounds of the endpoint's stores (``serve.bounds``), recounted from scratch in integers, and
the size checks that refuse a chat request's tools, names and tool-call arguments unencoded."""

from __future__ import annotations

import asyncio
import random

import pytest

from mixrl.serve.bounds import ENTRY_BYTES, ITEM_BYTES

MSG = [{"role": "user", "content": "2+3?"}]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from mixrl.models.chat import ChatFormat
    from mixrl.models.tokenizer import save_tokenizer

    return ChatFormat(save_tokenizer(tmp_path_factory.mktemp("tok")))


def _count_traj(t) -> int:
    """A trajectory recounted by hand: every list item of every list field, no formula shared."""
    items = 0
    for name in ("tokens", "loss_mask", "sampler_logprobs", "versions", "groups", "cand_offsets", "cand_ids",
                 "cand_logprobs"):
        for _ in getattr(t, name):
            items += 1
    items += len(t.timings) + len(t.info)
    return ENTRY_BYTES + items * ITEM_BYTES


def _count_norm(m: tuple) -> int:
    role, text, calls, call_id = m
    return ENTRY_BYTES + len(role or "") + len(text) + len(call_id) + sum(
        ENTRY_BYTES + len(str(n)) + len(a) for n, a in calls)


def _count_store(store) -> int:
    total = 0
    for st in store.sessions.values():
        total += ENTRY_BYTES + len(st.tools_key) + sum(_count_norm(m) for m in st.prefix)
        total += sum(_count_traj(f.traj) + _count_norm(f.reply) for f in st.forks)
        total += sum(_count_traj(t) for t in st.finished)
    return total


def test_byte_lru_evicts_the_least_recently_used_and_keeps_its_count() -> None:
    from mixrl.serve.bounds import ByteLRU

    lru, rng, shadow = ByteLRU(10_000, max_items=50), random.Random(0), {}
    for i in range(2000):
        key = rng.randrange(200)
        if rng.random() < 0.3:
            lru.get(key)
        size = rng.randrange(1, 1600)
        kept = lru.put(key, i, size)
        assert kept == (size <= 1250)  # an eighth of the bound at most
        assert lru.bytes == sum(lru.sizes()) <= 10_000 and len(lru) <= 50
        shadow[key] = i
    for key, (value, _) in lru._d.items():
        assert shadow[key] == value  # what is kept is the latest value
    assert lru.evicted > 0


def test_frame_cache_is_bounded_in_bytes(chat) -> None:
    from mixrl.serve.conversation import Frames, frame_bytes, render_ids

    frames = Frames(chat, max_bytes=64 << 10)
    for i in range(300):  # 300 shapes: each a name of its own
        msgs = [{"role": "user", "name": f"u{i}" * 20, "content": f"hi {i}"}]
        assert render_ids(chat, msgs, None, frames) == render_ids(chat, msgs, None)  # the same ids as uncached
        cache, texts = frames._cache, frames._texts
        recount = sum(frame_bytes(k, f) for k, (f, _) in cache._d.items())
        recount_texts = sum(ENTRY_BYTES + len(k) + ITEM_BYTES * len(ids) for k, (ids, _) in texts._d.items())
        assert cache.bytes == recount <= 32 << 10 and texts.bytes == recount_texts <= 32 << 10
    assert frames._cache.evicted > 0 and frames.bytes <= 64 << 10


def _fake_core(chat, tokens: int = 40, cands: int = 8, **kw):
    """A ``ServeCore`` whose sampler answers at once: ``tokens`` ids, ``cands`` candidates each."""
    from mixrl.records.generation import GenerationResult
    from mixrl.serve.core import ServeCore

    async def generate(session, request):
        n = request.params.max_new_tokens if tokens is None else min(tokens, request.params.max_new_tokens)
        ids = [100 + (i % 50) for i in range(n)]
        return GenerationResult(token_ids=ids, logprobs=[-1.0] * n, cand_offsets=[i * cands for i in range(n + 1)],
                                cand_ids=[7] * (n * cands), cand_logprobs=[-2.0] * (n * cands), cand_kind="head",
                                version=0, group="g", finish_reason="length")

    return ServeCore(chat, generate, model="m", max_total_tokens=4000, **kw)


def test_named_sessions_are_bounded_in_bytes_and_evict_the_least_recently_used(chat) -> None:
    core = _fake_core(chat, session_bytes=400_000, session_max_bytes=200_000)
    store = core.sessions

    async def main() -> None:
        for i in range(60):
            msgs = [{"role": "user", "content": f"question {i}"}]
            out = await core.chat_completion({"messages": msgs, "max_tokens": 40}, f"s{i}")
            reply = out["choices"][0]["message"]
            await core.chat_completion({"messages": [*msgs, reply, {"role": "user", "content": "and?"}]}, f"s{i}")
            assert store.bytes == _count_store(store) <= 400_000
        assert store.evicted > 0 and "s59" in store.sessions and "s0" not in store.sessions

    asyncio.run(main())


def test_rewrites_of_one_session_drop_its_earliest_segments(chat) -> None:
    core = _fake_core(chat, session_bytes=10_000_000, session_max_bytes=120_000)
    store = core.sessions

    async def main() -> None:
        for i in range(200):  # each a different first question: a rewrite, a new segment
            await core.chat_completion({"messages": [{"role": "user", "content": f"edit {i}"}]}, "agent")
            st = store.sessions["agent"]
            assert store.bytes == _count_store(store) and st.nbytes <= 120_000
        st = store.sessions["agent"]
        assert store.history_rewrites == 199 and st.dropped > 150 and len(st.finished) + st.dropped == 199
        assert store.finish("agent")[1] == 199 and store.bytes == 0

    asyncio.run(main())


def test_a_session_whose_one_record_passes_its_bound_goes(chat) -> None:
    core = _fake_core(chat, tokens=400, cands=16, session_max_bytes=100_000)

    async def main() -> None:
        out = await core.chat_completion({"messages": MSG, "max_tokens": 400}, "big")
        assert out["choices"][0]["message"]["role"] == "assistant"  # answered, then not kept
        assert "big" not in core.sessions.sessions and core.sessions.bytes == 0 and core.sessions.evicted == 1

    asyncio.run(main())


@pytest.mark.parametrize("where", ["tools", "name", "arguments", "tool_call_id"])
def test_tools_names_and_arguments_are_counted_before_encoding(chat, where: str) -> None:
    from mixrl.serve.core import ApiError

    core = _fake_core(chat)
    big = "x" * (core.max_total_tokens * core.token_chars + 1)
    msgs: list[dict] = [{"role": "user", "content": "hi"}]
    tools = None
    if where == "tools":
        tools = [{"type": "function", "function": {"name": "f", "description": big}}]
    elif where == "name":
        msgs[0]["name"] = big
    else:
        call = {"id": big if where == "tool_call_id" else "c0", "type": "function",
                "function": {"name": "f", "arguments": big if where == "arguments" else "{}"}}
        msgs += [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "c0", "content": "1"}]

    def never(*a, **k):
        raise AssertionError("rendered or encoded")

    core.sessions.prompt = never  # type: ignore[method-assign]
    for session in (None, "named"):
        with pytest.raises(ApiError) as e:
            asyncio.run(core.chat_completion({"messages": msgs, "tools": tools}, session))
        assert (e.value.status, e.value.code) == (400, "context_length_exceeded")
        assert e.value.param == ("tools" if where == "tools" else "messages")
    assert core.sessions.sessions == {} and core.sessions.frames.bytes == 0


def test_malformed_tool_calls_and_names_are_400_not_500(chat) -> None:
    from mixrl.serve.core import ApiError

    core = _fake_core(chat)
    for bad in ({"role": "assistant", "content": "", "tool_calls": [{"function": "f"}]},
                {"role": "assistant", "content": "", "tool_calls": "f"},
                {"role": "user", "content": "hi", "name": 5}):
        with pytest.raises(ApiError) as e:
            asyncio.run(core.chat_completion({"messages": [MSG[0], bad]}, None))
        assert e.value.status == 400 and e.value.param == "messages"
