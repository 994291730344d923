"""The endpoint against hostile and careless clients: bodies bounded after the key check,
sessions that never leak, sessions that expire."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
from test_endpoint import _core

MSG = {"messages": [{"role": "user", "content": "2+3?"}], "max_tokens": 4}


def _asgi(app, headers: list[tuple[bytes, bytes]], chunks, path: str = "/v1/chat/completions"):
    """Call the ASGI app; ``chunks`` yields body pieces. Returns (status, JSON body, pieces read)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    it, read, sent = iter(chunks), [0], []

    async def receive() -> dict:
        piece = next(it, None)
        if piece is None:  # the body is over: the client waits for its answer (a server's receive blocks)
            await asyncio.Event().wait()
        read[0] += 1
        return {"type": "http.request", "body": piece[0], "more_body": piece[1]}

    async def send(m: dict) -> None:
        sent.append(m)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"]), read[0]


def _endless(piece: bytes):
    while True:
        yield piece, True


def test_body_limit_after_the_key_and_before_reading(tiny: Path) -> None:
    from mixrl.serve.app import make_app

    core, _ = _core(tiny)
    app = make_app(core, api_key="k", max_body=1 << 16)
    body = json.dumps(MSG).encode()
    huge = [(b"content-length", str(200 << 20).encode())]
    # a wrong key: 401 and not one byte of the (declared 200 MB) body read
    status, out, read = _asgi(app, [(b"authorization", b"Bearer bad"), *huge], _endless(b"x" * 65536))
    assert (status, out["error"]["code"], read) == (401, "invalid_api_key", 0)
    # the right key, a declared length past the limit: 413, unread
    status, out, read = _asgi(app, [(b"authorization", b"Bearer k"), *huge], _endless(b"x" * 65536))
    assert (status, out["error"]["code"], read) == (413, "request_too_large", 0)
    assert "65536" in out["error"]["message"]
    # no Content-Length (chunked): read until past the limit, then no more
    status, out, read = _asgi(app, [(b"authorization", b"Bearer k")], _endless(b"x" * 10000))
    assert (status, out["error"]["code"], read) == (413, "request_too_large", 7)  # 7 * 10,000 > 65,536
    # at the limit exactly: answered
    padded = body[:-1] + b" " * ((1 << 16) - len(body)) + b"}"
    status, out, read = _asgi(app, [(b"authorization", b"Bearer k")], [(padded, False)])
    assert status == 200 and out["choices"][0]["message"]["role"] == "assistant"
    assert core.counts["errors"] == 3


def test_wrong_key_with_a_large_body_allocates_nothing_on_a_real_server(tiny: Path) -> None:
    """uvicorn on loopback; a 48 MiB body declared with a wrong key, then with the right key:
    answered (401, 413) as soon as the headers arrived, the connection closed, so the client
    cannot stream the body; Python's allocation peak (tracemalloc: every bytes object the
    server would buffer) stays far below the body's size. A refused small body keeps its
    connection alive."""
    import uvicorn

    from mixrl.serve.app import loopback_socket, make_app, server_options

    core, _ = _core(tiny)
    sock = loopback_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(core, api_key="k"), lifespan="off", **server_options()))
    server.install_signal_handlers = lambda: None
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    piece, n = b"x" * (1 << 20), 48
    try:
        for key, want in (("bad", 401), ("k", 413)):
            tracemalloc.start()
            conn = socket.create_connection(("127.0.0.1", port), timeout=60)
            conn.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                         f"Content-Length: {n << 20}\r\n\r\n".encode())
            r = http.client.HTTPResponse(conn)  # answered before any of the body was sent
            r.begin()
            status, closing, out = r.status, r.getheader("connection"), json.loads(r.read())
            sent = 0
            with pytest.raises(OSError):  # the server closed the connection: the body cannot follow
                for _ in range(n):
                    conn.sendall(piece)
                    sent += 1
                    time.sleep(0.01)
            conn.close()
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert (status, closing) == (want, "close") and out["error"]["message"] and sent < n
            assert peak < 8 << 20, peak  # the body (48 MiB) was never buffered
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        for _ in range(2):  # a small refused body: read and discarded, the connection kept
            conn.request("POST", "/v1/chat/completions", body=b"x" * 1000, headers={"Authorization": "Bearer no"})
            r = conn.getresponse()
            assert r.status == 401 and r.getheader("connection") is None and r.read()
        conn.close()
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_failed_requests_leave_no_session(tiny: Path) -> None:
    from mixrl.serve.core import ApiError

    core, _ = _core(tiny)
    real = core.generate

    async def failing(session, request):  # the real sampler, failing for one seed
        if request.params.seed == 666:
            raise RuntimeError("the sampler's worker died")
        return await real(session, request)

    core.generate = failing
    long = {"messages": [{"role": "user", "content": "x" * 500}]}  # past the 400-token context
    longer = {"messages": [{"role": "user", "content": "x" * 6000}]}  # refused before tokenizing
    bad = [(long, ApiError), (longer, ApiError), ({**MSG, "stop": [""]}, ApiError), ({**MSG, "stop": 5}, ApiError),
           ({**MSG, "seed": 666}, RuntimeError), ({**MSG, "n": 2, "seed": 665}, RuntimeError),
           ({"messages": [{"role": "wizard", "content": "hi"}]}, ApiError)]

    async def main() -> None:
        for i in range(40):
            body, err = bad[i % len(bad)]
            with pytest.raises(err):
                await core.chat_completion(body, None if i % 2 else f"named-{i}")
        assert core.sessions.sessions == {}
        # a session that holds replies keeps them when a later request of it fails
        await core.chat_completion(MSG, "kept")
        with pytest.raises(ApiError):
            await core.chat_completion({**MSG, "stop": [""]}, "kept")
        st = core.sessions.sessions["kept"]  # the same question again: the reply moved to an earlier segment
        assert list(core.sessions.sessions) == ["kept"] and len(st.finished) == 1 and not st.forks
        # a completion prompt of more ids than the context, or of more characters than it can hold
        for prompt in ([5] * 401, "x" * 6000):
            with pytest.raises(ApiError) as e:
                await core.completion({"prompt": prompt}, None)
            assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"

    asyncio.run(main())


def test_sessions_expire_and_the_least_recently_used_goes(tiny: Path) -> None:
    core, _ = _core(tiny, session_ttl=60.0, max_sessions=3)
    now = [0.0]
    core.sessions.clock = lambda: now[0]

    async def ask(session: str) -> None:
        await core.chat_completion(MSG, session)

    async def main() -> None:
        for s in ("a", "b", "c"):
            await ask(s)
            now[0] += 1
        await ask("a")  # a is now the most recently used
        await ask("d")  # over the cap: b (least recently used) goes
        assert list(core.sessions.sessions) == ["c", "a", "d"] and core.sessions.evicted == 1
        now[0] += 61  # all unused for longer than the TTL
        await ask("e")
        assert list(core.sessions.sessions) == ["e"] and core.sessions.evicted == 4
        # a session with a request in flight is neither expired nor evicted
        st = core.sessions.sessions["e"]
        async with st.lock:
            now[0] += 120
            core.sessions.state("f")
            core.sessions.state("g")
            core.sessions.state("h")
            core.sessions.state("i")
            assert "e" in core.sessions.sessions and len(core.sessions.sessions) == 3

    asyncio.run(main())


def test_unbounded_store_for_an_in_run_endpoint(tiny: Path) -> None:
    core, _ = _core(tiny, session_ttl=None, max_sessions=None, owned=lambda s: s == "episode")
    core.sessions.clock = lambda: 1e12  # any age

    async def main() -> None:
        from mixrl.serve.core import ApiError

        with pytest.raises(ApiError):  # the episode's session is the run's to finish, even when empty
            await core.chat_completion({**MSG, "stop": 3}, "episode")
        with pytest.raises(ApiError):
            await core.chat_completion({**MSG, "stop": 3}, "stranger")
        assert list(core.sessions.sessions) == ["episode"]

    asyncio.run(main())


def test_in_run_endpoint_body_limit_is_an_env_option(tiny: Path) -> None:
    from transformers import AutoTokenizer

    from mixrl.envs.agent import OpenAIAgentEnv
    from mixrl.models.chat import ChatFormat
    from mixrl.records.task import Task

    chat, task = ChatFormat(AutoTokenizer.from_pretrained(str(tiny))), Task("p", "agent", "train", {})
    assert OpenAIAgentEnv(task, chat, agent=print, max_body_mib=0.5).max_body == 1 << 19
    with pytest.raises(ValueError, match="env.options.max_body_mib must be > 0, got 0"):
        OpenAIAgentEnv(task, chat, agent=print, max_body_mib=0)
