"""Connection deadlines and a connection limit for the endpoint's uvicorn server.

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``) but not a
client that connects and then sends its request slowly or not at all: a socket
that never finishes its headers, or its body, holds a file descriptor for ever,
and enough of them starve every other client. ``guarded_protocol(Guard(...))``
is uvicorn's own HTTP protocol class (httptools', else h11's) with four rules:

- **header deadline**: a connection's request line and headers must arrive within
  ``header_timeout`` seconds of its first byte (of the connection, for its first
  request); else it is answered ``408`` and closed;
- **body deadline**: the whole body must arrive within ``body_timeout`` seconds of
  the headers; else ``408`` (if nothing was answered yet) and closed;
- **header size**: headers past ``max_header_bytes`` are answered ``431`` and closed;
- **connection limit**: a connection beyond ``max_connections`` open ones is answered
  ``503`` at once (a JSON error naming the limit), its write side shut; it lingers at
  most ``REFUSED_LINGER`` seconds (so the client reads the answer, not a reset) and
  never reaches the app.

An idle connection between requests is uvicorn's keep-alive timeout, unchanged.
Every answer here is OpenAI's JSON error shape with ``Connection: close``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson

REFUSED_LINGER = 1.0  # seconds a refused connection stays open for its client to read the 503


@dataclass(frozen=True)
class Guard:
    """The deadlines and limits of one server (``mixrl serve``'s defaults)."""

    header_timeout: float = 10.0  # seconds for a request's line and headers, from its first byte
    body_timeout: float = 30.0  # seconds for a request's whole body, from its headers
    max_connections: int | None = 1024  # open connections at most; None: no limit
    max_header_bytes: int = 64 << 10  # the request line and headers at most


def _answer(status: int, reason: str, message: str, code: str) -> bytes:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                   else "server_error", "param": None, "code": code}})
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


class _Guarded:
    """The rules, over either uvicorn protocol (``_phase`` is kept by the subclass's parser hooks)."""

    guard: Guard = Guard()
    _refused = False
    _timer: asyncio.TimerHandle | None = None
    _phase = "idle"  # idle (between requests) | header | body | wait (the app answers)
    _head = 0  # header bytes of the current request so far
    transport: Any
    server_state: Any
    cycle: Any
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: Any) -> None:
        limit = self.guard.max_connections
        if limit is not None and len(self.server_state.connections) >= limit:
            self._refuse(transport, limit)
            return
        super().connection_made(transport)  # type: ignore[misc]
        self._enter("header")  # a new connection owes its first request's headers

    def _refuse(self, transport: Any, limit: int) -> None:
        self._refused, self.transport = True, transport
        transport.write(_answer(503, "Service Unavailable",
                                f"this server holds its limit of {limit} open connections; retry later",
                                "too_many_connections"))
        if transport.can_write_eof():
            transport.write_eof()  # the answer, then end of stream: the client reads both
        self._timer = asyncio.get_running_loop().call_later(REFUSED_LINGER, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self._refused:
            return
        super().connection_lost(exc)  # type: ignore[misc]

    def eof_received(self) -> Any:
        if self._refused:
            self.transport.close()
            return None
        return super().eof_received()  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped until it closes
        super().data_received(data)  # type: ignore[misc]
        if self._phase == "header" and not self.transport.is_closing():
            self._head += len(data)
            if self._head > self.guard.max_header_bytes:
                self._close(431, "Request Header Fields Too Large",
                            f"the request's headers are larger than this server's limit of "
                            f"{self.guard.max_header_bytes} bytes", "headers_too_large")

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if self._phase == "wait":  # else the rest of the body is still owed, within its deadline
            self._enter("idle")

    # -- phases ---------------------------------------------------------------------
    def _enter(self, phase: str) -> None:
        if phase == self._phase and self._timer is not None:
            return
        self._cancel()
        self._phase = phase
        if phase == "header":
            self._head = 0
            self._timer = self.loop.call_later(self.guard.header_timeout, self._expire, "headers")
        elif phase == "body":
            self._timer = self.loop.call_later(self.guard.body_timeout, self._expire, "body")

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, what: str) -> None:
        self._timer = None
        seconds = self.guard.header_timeout if what == "headers" else self.guard.body_timeout
        self._close(408, "Request Timeout", f"the request's {what} did not arrive within this server's "
                                            f"deadline of {seconds:g} seconds", "request_timeout")

    def _close(self, status: int, reason: str, message: str, code: str) -> None:
        self._cancel()
        if self.transport.is_closing():
            return
        cycle = getattr(self, "cycle", None)
        if cycle is None or not cycle.response_started:
            self.transport.write(_answer(status, reason, message, code))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app reads a disconnect; what it sends is dropped
            cycle.message_event.set()
        self.transport.close()


def guarded_protocol(guard: Guard, http: str = "auto") -> type:
    """uvicorn's HTTP protocol class (``http``: ``httptools``, ``h11`` or ``auto``) under ``guard``."""
    if http in ("auto", "httptools"):
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        except ImportError:
            if http == "httptools":
                raise
        else:
            return type("GuardedHttpTools", (_HttpTools, HttpToolsProtocol), {"guard": guard})
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return type("GuardedH11", (_H11, H11Protocol), {"guard": guard})


class _HttpTools(_Guarded):
    """httptools' parser calls back at each step of a request."""

    def on_message_begin(self) -> None:
        self._enter("header")
        super().on_message_begin()  # type: ignore[misc]

    def on_headers_complete(self) -> None:
        super().on_headers_complete()  # type: ignore[misc]
        self._enter("body")

    def on_message_complete(self) -> None:
        self._enter("wait")
        super().on_message_complete()  # type: ignore[misc]


class _H11(_Guarded):
    """h11 tells where a request stands through its peer's state after each read."""

    conn: Any

    def data_received(self, data: bytes) -> None:
        import h11

        super().data_received(data)
        if self._refused or self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._enter("body")
        elif state in (h11.DONE, h11.MUST_CLOSE):
            self._enter("wait")
        elif state is h11.IDLE and self._phase == "idle" and self.conn.trailing_data[0]:
            self._enter("header")
