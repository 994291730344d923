"""The generation routes at the ASGI level: a body in several chunks, a client gone, headers as sent."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from test_endpoint import _core

BODY = json.dumps({"messages": [{"role": "user", "content": "2+3?"}], "max_tokens": 4}).encode()


def _call(app, body_chunks: list[bytes], headers: list[tuple[bytes, bytes]], method: str = "POST",
          disconnect_first: bool = False) -> list[dict]:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    msgs = [{"type": "http.disconnect"}] if disconnect_first else []
    msgs += [{"type": "http.request", "body": c, "more_body": i < len(body_chunks) - 1}
             for i, c in enumerate(body_chunks)]
    sent: list[dict] = []

    async def receive() -> dict:
        if not msgs:  # the body is over: the client waits for its answer (a server's receive blocks)
            await asyncio.Event().wait()
        return msgs.pop(0)

    async def send(m: dict) -> None:
        sent.append(m)

    asyncio.run(app(scope, receive, send))
    return sent


def test_chunked_body_first_headers_and_a_gone_client(tiny: Path) -> None:
    from mixrl.serve.app import make_app

    core, _ = _core(tiny)
    app = make_app(core, api_key="k")
    auth = [(b"authorization", b"Bearer k")]
    # a body that arrives in three pieces is one request; the session is the X-Session-ID header's
    sent = _call(app, [BODY[:7], BODY[7:20], BODY[20:]], auth + [(b"x-session-id", b"s1")])
    assert sent[0]["status"] == 200 and dict(sent[0]["headers"])[b"content-type"] == b"application/json"
    assert int(dict(sent[0]["headers"])[b"content-length"]) == len(sent[1]["body"])
    assert json.loads(sent[1]["body"])["choices"][0]["message"]["role"] == "assistant"
    assert "s1" in core.sessions.sessions
    # the first Authorization header counts, as in Starlette's Request.headers
    sent = _call(app, [BODY], [(b"authorization", b"Bearer wrong"), (b"authorization", b"Bearer k")])
    assert sent[0]["status"] == 401 and json.loads(sent[1]["body"])["error"]["code"] == "invalid_api_key"
    # a client gone before its body arrived is answered by nobody, and nothing is generated
    before = core.counts.get("requests", 0)
    assert _call(app, [BODY], auth, disconnect_first=True) == []
    assert core.counts.get("requests", 0) == before
    # any other method on a generation path: 405, OpenAI-shaped, with the method allowed
    sent = _call(app, [b""], auth, method="PUT")
    assert sent[0]["status"] == 405 and dict(sent[0]["headers"])[b"allow"] == b"POST"
    assert json.loads(sent[1]["body"])["error"]["message"]


def test_a_client_that_leaves_cancels_its_generation(tiny: Path) -> None:
    """The body arrived, generation started, then the client left: the generation is cancelled and
    nothing is answered."""
    from transformers import AutoTokenizer

    from mixrl.models.chat import ChatFormat
    from mixrl.serve.app import make_app
    from mixrl.serve.core import ServeCore

    started, cancelled = asyncio.Event(), []

    async def generate(session, request):  # type: ignore[no-untyped-def]
        started.set()
        try:
            await asyncio.Event().wait()  # an engine that takes its time
        except asyncio.CancelledError:
            cancelled.append(request.request_id)
            raise

    core = ServeCore(ChatFormat(AutoTokenizer.from_pretrained(str(tiny))), generate, model="tiny", max_total_tokens=400)
    app = make_app(core, api_key="k")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(b"authorization", b"Bearer k")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 2)}
    sent: list[dict] = []
    first = [True]

    async def receive() -> dict:
        if first[0]:
            first[0] = False
            return {"type": "http.request", "body": BODY, "more_body": False}
        await started.wait()  # the client leaves once its request is being generated
        return {"type": "http.disconnect"}

    async def send(m: dict) -> None:
        sent.append(m)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=30))
    assert sent == [] and len(cancelled) == 1
