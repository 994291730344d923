"""Connection deadlines and the connection limit (``serve.guard``): real sockets against a real
uvicorn on 127.0.0.1 with short deadlines, under both HTTP parsers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

HEAD = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"


async def _echo(scope, receive, send) -> None:
    """Reads the whole body, answers its length; counts disconnects seen while reading."""
    if scope["type"] != "http":
        return
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            _echo.disconnects += 1  # type: ignore[attr-defined]
            return
        size += len(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    body = json.dumps({"size": size}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


_echo.disconnects = 0  # type: ignore[attr-defined]


@contextlib.contextmanager
def _server(http: str, keep_alive: float = 30, **guard_kw) -> Iterator[int]:
    import uvicorn

    from mixrl.serve.app import loopback_socket
    from mixrl.serve.guard import Guard, guarded_protocol

    guard = Guard(**{"header_timeout": 0.5, "body_timeout": 0.5, **guard_kw})
    sock = loopback_socket()
    server = uvicorn.Server(uvicorn.Config(_echo, lifespan="off", http=guarded_protocol(guard, http),
                                           timeout_keep_alive=keep_alive, log_level="error"))
    server.install_signal_handlers = lambda: None
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _status(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body else {}


def _response(s: socket.socket) -> tuple[int, dict]:
    """One response off a kept-alive connection (headers, then Content-Length bytes)."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += s.recv(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    return int(head.split()[1]), json.loads(body)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


HTTP = ["httptools", "h11"]


@pytest.mark.parametrize("http", HTTP)
def test_header_deadline_closes_a_slow_or_silent_client(http: str) -> None:
    with _server(http) as port:
        fds = _fds()
        silent, slow = _connect(port), _connect(port)
        slow.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
        t0 = time.monotonic()
        for s in (silent, slow):
            status, out = _status(_read_all(s))  # answered, then closed by the server
            assert status == 408 and out["error"]["code"] == "request_timeout" and "headers" in out["error"]["message"]
            s.close()
        assert 0.4 < time.monotonic() - t0 < 3
        time.sleep(0.2)
        assert _fds() <= fds  # nothing left open


@pytest.mark.parametrize("http", HTTP)
def test_body_deadline_closes_a_slow_body_and_the_app_sees_a_disconnect(http: str) -> None:
    with _server(http) as port:
        before = _echo.disconnects  # type: ignore[attr-defined]
        s = _connect(port)
        s.sendall(HEAD % 1000 + b"x" * 10)  # 990 bytes owed, never sent
        t0 = time.monotonic()
        status, out = _status(_read_all(s))
        assert status == 408 and "body" in out["error"]["message"] and 0.4 < time.monotonic() - t0 < 3
        s.close()
        time.sleep(0.1)
        assert _echo.disconnects == before + 1  # type: ignore[attr-defined]
        # a body that arrives in time, in pieces, on a kept-alive connection: answered each time
        s = _connect(port)
        for _ in range(2):
            s.sendall(HEAD % 6)
            time.sleep(0.2)
            s.sendall(b"abc")
            time.sleep(0.2)
            s.sendall(b"def")
            assert _response(s) == (200, {"size": 6})
        s.close()


@pytest.mark.parametrize("http", HTTP)
def test_idle_keep_alive_is_closed(http: str) -> None:
    with _server(http, keep_alive=0.5, header_timeout=5) as port:
        s = _connect(port)
        s.sendall(HEAD % 2 + b"hi")
        assert _response(s) == (200, {"size": 2})
        t0 = time.monotonic()
        assert _read_all(s) == b""  # closed without an answer: nothing was asked
        assert 0.4 < time.monotonic() - t0 < 3  # the keep-alive timeout, not the 5 s header deadline
        s.close()


@pytest.mark.parametrize("http", HTTP)
def test_connection_limit_refuses_clearly_and_frees_its_descriptor(http: str) -> None:
    with _server(http, header_timeout=20, max_connections=3) as port:
        fds = _fds()
        held = [_connect(port) for _ in range(3)]
        time.sleep(0.2)
        extra = _connect(port)
        extra.sendall(HEAD % 2 + b"hi")
        t0 = time.monotonic()
        status, out = _status(_read_all(extra))  # the 503, then the end of the stream
        assert status == 503 and out["error"]["code"] == "too_many_connections"
        assert "limit of 3 open connections" in out["error"]["message"] and time.monotonic() - t0 < 2
        extra.close()
        held.pop().close()  # a place frees: the next connection is served
        time.sleep(0.2)
        s = _connect(port)
        s.sendall(HEAD % 2 + b"hi")
        assert _response(s) == (200, {"size": 2})
        s.close()
        for h in held:
            h.close()
        time.sleep(1.2)  # a refused connection lingers at most REFUSED_LINGER
        assert _fds() <= fds


def test_headers_past_the_limit_are_refused() -> None:
    with _server("httptools", header_timeout=20, max_header_bytes=4096) as port:
        s = _connect(port)
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n" + (b"X-Pad: " + b"a" * 1000 + b"\r\n") * 6)
        status, out = _status(_read_all(s))  # 6 KB of headers, unfinished: refused at once
        assert status == 431 and out["error"]["code"] == "headers_too_large"
        s.close()
