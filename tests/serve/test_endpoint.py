"""The OpenAI-compatible endpoint, driven by the official ``openai`` client.

The app runs in-process behind httpx's ASGI transport on a tiny random Qwen3
with the bundled tokenizer (its own chat template) and the built-in FP32
engine. Checks: recorded tokens equal the template's own rendering of the
whole conversation (no re-tokenization drift), behaviour log-probs equal the
trainer's FP32 forward, history rewrites start a new segment, errors are
OpenAI-shaped.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest
import torch

torch.set_num_threads(1)
openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate arithmetic",
                                            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                                           "required": ["expr"]}}}]


def _core(path: Path, **kw):
    from transformers import AutoTokenizer

    from mixrl.models.chat import ChatFormat
    from mixrl.sampling.batching import BatchingSampler
    from mixrl.sampling.factory import make_engine
    from mixrl.serve.core import ServeCore

    tok = AutoTokenizer.from_pretrained(str(path))
    sampler = BatchingSampler(make_engine(str(path), "fp32", "fp32", seed=0, max_batch=8), max_batch=8)

    async def generate(session, request):
        return await sampler.generate(request)

    return ServeCore(ChatFormat(tok), generate, model="tiny", max_total_tokens=400, **kw), tok


def _whole(chat, messages, traj) -> list[int]:
    """The template's rendering of ``messages`` in one piece: replies as their generated ids."""
    from mixrl.models.untrusted import encode_untrusted
    from mixrl.serve.conversation import SENTINEL, template_messages

    runs, cur = [], []
    for tok, m in zip(traj.tokens, traj.loss_mask, strict=True):
        if m:
            cur.append(tok)
        elif cur:
            runs.append(cur)
            cur = []
    runs += [cur] if cur else []
    runs = [r[:-1] if r[-1] in chat.stop_ids else r for r in runs]
    contents: list[str] = []
    text = chat.tokenizer.apply_chat_template(template_messages(messages, contents), tools=TOOLS,
                                              add_generation_prompt=False, tokenize=False)
    out, reply = [], 0
    for i, content in enumerate(contents):
        before, text = text.split(SENTINEL.format(i))
        out += chat.encode(before)
        role = [m for m in messages if m.get("content")][i]["role"]
        out += runs[reply] if role == "assistant" else encode_untrusted(chat.tokenizer, content)
        reply += role == "assistant"
    return out + chat.encode(text)


def _client(core, api_key: str | None = None, key: str = "k"):
    from mixrl.serve.app import make_app

    app = make_app(core, api_key=api_key)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(api_key=key, base_url="http://test/v1", http_client=http, max_retries=0), http


def test_multi_turn_record_is_the_template_rendering_and_fp32_logprobs(tiny: Path) -> None:
    from transformers import AutoModelForCausalLM


    core, tok = _core(tiny)
    client, _ = _client(core)

    async def episode():
        msgs = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "2+3? <|end|>"}]
        for turn in range(3):
            r = await client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=12,
                                                     extra_headers={"X-Session-ID": "s1"}, logprobs=True,
                                                     top_logprobs=3)
            m = r.choices[0].message
            msgs.append(m.model_dump(exclude_none=True))
            msgs.append({"role": "tool", "tool_call_id": "x", "content": f"result {turn} <|user|>"})
        return msgs

    msgs = asyncio.run(episode())[:-1]  # everything sent, and the last reply
    traj, earlier = core.sessions.finish("s1")
    assert earlier == 0 and core.sessions.history_rewrites == 0
    traj.validate()
    assert traj.turns == 3 and sum(traj.loss_mask) > 0
    # No drift: the record (pieces encoded request by request) equals the template's rendering of
    # the whole conversation at once, with each reply standing for exactly the ids generated.
    assert traj.tokens in (_whole(core.chat, msgs, traj), _whole(core.chat, msgs, traj)[:-1])
    # the "<|user|>" / "<|end|>" written inside contents stay text: one user turn id, the template's
    user_id = tok.convert_tokens_to_ids("<|user|>")
    assert [t for t, m in zip(traj.tokens, traj.loss_mask, strict=True) if m == 0].count(user_id) == 1
    # behaviour log-probs equal the FP32 forward of the trainer's model on the recorded tokens
    model = AutoModelForCausalLM.from_pretrained(str(tiny), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([traj.tokens])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    for t, (m, q) in enumerate(zip(traj.loss_mask, traj.sampler_logprobs, strict=True)):
        if m:
            assert abs(lp[t - 1, traj.tokens[t]].item() - q) < 1e-5


def test_history_rewrite_starts_a_new_segment(tiny: Path) -> None:
    core, _ = _core(tiny)
    client, _ = _client(core)

    async def run():
        msgs = [{"role": "user", "content": "hello"}]
        r = await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, user="s2")
        extended = msgs + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        await client.chat.completions.create(model="tiny", messages=extended, max_tokens=5, user="s2")
        assert core.sessions.history_rewrites == 0
        edited = msgs + [{"role": "assistant", "content": "something I never said"},
                         {"role": "user", "content": "more"}]
        await client.chat.completions.create(model="tiny", messages=edited, max_tokens=5, user="s2")

    asyncio.run(run())
    assert core.sessions.history_rewrites == 1
    traj, earlier = core.sessions.finish("s2")
    assert earlier == 1 and traj.info["segment"] == 1
    assert sum(traj.loss_mask) >= 1  # only the newest reply is generated in the new segment


def test_greedy_n_stop_and_completions(tiny: Path) -> None:
    core, tok = _core(tiny)
    client, _ = _client(core)

    async def run():
        msgs = [{"role": "user", "content": "hi"}]
        r = await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, n=3, temperature=0,
                                                 logprobs=True)
        texts = {c.message.content for c in r.choices}
        assert len(texts) == 1  # greedy: every choice the same
        assert all(t.logprob == 0.0 for t in r.choices[0].logprobs.content)
        r2 = await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, seed=1)
        full = r2.choices[0].message.content
        if len(full) > 3:
            r3 = await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, seed=1,
                                                      stop=[full[2:4]])
            assert r3.choices[0].message.content == full[: full.index(full[2:4])]
            assert r3.choices[0].finish_reason == "stop"
        c = await client.completions.create(model="tiny", prompt="12+", max_tokens=4)
        assert c.usage.completion_tokens <= 4 and c.object == "text_completion"
        ids = tok.encode("12+", add_special_tokens=False)
        c2 = await client.completions.create(model="tiny", prompt=ids, max_tokens=4)
        assert c2.usage.prompt_tokens == len(ids)

    asyncio.run(run())


def test_errors_are_openai_shaped_and_auth(tiny: Path) -> None:
    core, _ = _core(tiny)
    client, http = _client(core, api_key="secret", key="wrong")

    async def run():
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
        good, http2 = _client(core, api_key="secret", key="secret")
        for bad, param in (({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
                           ({"messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
                           ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
                           ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream")):
            resp = await http2.post("/v1/chat/completions", json={"model": "tiny", **bad},
                                    headers={"Authorization": "Bearer secret"})
            assert resp.status_code == 400, (bad, resp.text)
            err = resp.json()["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
        resp = await http2.post("/v1/chat/completions", content=b"{not json", headers={"Authorization": "Bearer secret"})
        assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
        resp = await http2.get("/v1/nothing", headers={"Authorization": "Bearer secret"})
        assert resp.status_code == 404 and "error" in resp.json()
        resp = await http2.get("/v1/chat/completions", headers={"Authorization": "Bearer secret"})
        assert resp.status_code == 405 and resp.json()["error"]["message"]
        resp = await http2.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                                headers={"Authorization": "Bearer secret", "X-Session-ID": ""})
        assert resp.status_code == 200  # an empty header: the session of the body's user field (none)
        models = await good.models.list()
        assert [m.id for m in models.data] == ["tiny"]

    asyncio.run(run())
    assert json.dumps(core.counts)


def test_internal_error_is_an_openai_500_with_the_traceback_logged(tiny: Path, caplog) -> None:
    from mixrl.serve.app import make_app

    core, _ = _core(tiny)

    async def broken(session, request):
        raise RuntimeError("engine exploded")

    core.generate = broken
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=make_app(core)), base_url="http://test")

    async def run():
        return await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})

    with caplog.at_level("ERROR", logger="mixrl.serve"):
        resp = asyncio.run(run())
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"
    assert "engine exploded" in caplog.text  # the traceback is in the log, not in the answer
    assert "engine exploded" not in resp.text


def test_auto_record_is_the_head_at_top_p_1_and_the_support_below(tiny: Path) -> None:
    from mixrl.serve.core import HEAD_K

    core, tok = _core(tiny)
    vocab = len(tok)
    assert vocab > HEAD_K  # else the head would be the whole vocabulary and prove nothing

    async def ask(session: str, top_p: float) -> None:
        body = {"messages": [{"role": "user", "content": "2+3?"}], "max_tokens": 6, "top_p": top_p, "seed": 1}
        await core.chat_completion(body, session)

    async def both() -> None:  # one event loop: the sampler's batching task lives on it
        await ask("full", 1.0)
        await ask("nucleus", 0.5)

    asyncio.run(both())
    head, _ = core.sessions.finish("full")
    support, _ = core.sessions.finish("nucleus")
    sizes = [b - a for a, b in zip(head.cand_offsets, head.cand_offsets[1:], strict=False)]
    assert head.cand_kind == "head" and sizes and all(s == HEAD_K for s in sizes)  # not the vocabulary
    assert support.cand_kind == "support"
    for a, b in zip(support.cand_offsets, support.cand_offsets[1:], strict=False):
        assert 0 < b - a < vocab  # the nucleus, whose q sums to 1
        assert abs(sum(math.exp(x) for x in support.cand_logprobs[a:b]) - 1) < 1e-5
