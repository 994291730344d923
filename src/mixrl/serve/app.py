"""The HTTP face of ``ServeCore``: OpenAI's paths and error shapes as a FastAPI app (served by uvicorn).

    POST /v1/chat/completions   messages (+ tools) -> choices (content, tool_calls, logprobs)
    POST /v1/completions        prompt (text or token ids) -> choices (text)
    GET  /v1/models             the one model served
    GET  /health                liveness

With an API key set (or several: one per client), every /v1 route needs
``Authorization: Bearer KEY`` (401 otherwise). Errors are OpenAI's JSON (``{"error": {...}}``): 400 for a
malformed body (the parameter named), 401, 404, 405, 503 when the sampler
failed, 500 for an internal error (its traceback logged on ``mixrl.serve``).

Bodies are validated by ``ServeCore`` (which names the parameter in its 400),
not by pydantic models, and read and written with ``orjson``. The two generation
routes are answered straight from the ASGI scope (``_Generation``: headers read
off the raw list, the body off ``receive``, the JSON bytes sent), before
FastAPI's middleware, routing and ``Request`` objects (the app's own cost
per request, measured on the ASGI app alone with a core that answers at once:
27 µs through a FastAPI route, 8 µs this way); every other path and method
goes to the FastAPI app, and both answer errors alike. The engines
run in sampler worker processes (``mixrl serve``, a run's fleet), so the
server's Python never holds an engine's interpreter lock. A non-finite number
(the log-prob of a candidate outside the top-p support is -inf) is written as
null, which JSON can carry.

Bodies are bounded (``max_body`` bytes, 4 MiB by default) and read only after the
API key was checked: a wrong key is answered 401 without reading the body, a
``Content-Length`` past the limit 413 without reading it, and a body sent without
one (chunked) is counted as it arrives and answered 413 once past the limit
(uvicorn discards what the client still sends; past ``UNREAD_CLOSE`` unread bytes,
or an unknown number, the answer closes the connection instead, as Go's net/http
does, so nobody streams gigabytes for the server to discard). A client that
closes its connection before its answer cancels its request (its choices still waiting
leave the fair gate). A body above ``OFFLOAD_BYTES`` is
parsed, templated and tokenized in a worker thread (the tokenizer's batch call
releases the interpreter lock), so ``/health`` and small requests are answered
meanwhile.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mixrl.serve.core import ApiError, ServeCore
from mixrl.serve.guard import Guard, guarded_protocol

SESSION_HEADER = b"x-session-id"  # or the body's "user" field
MAX_BODY = 4 << 20  # bytes: the default body limit
OFFLOAD_BYTES = 64 << 10  # a body past this is parsed and tokenized off the event loop
UNREAD_CLOSE = 256 << 10  # a refused body of more (or of unknown size) ends the connection
CLOSE = [(b"connection", b"close")]

dumps, loads = orjson.dumps, orjson.loads
log = logging.getLogger("mixrl.serve")


def make_app(core: ServeCore, api_key: str | Sequence[str] | None = None, max_body: int = MAX_BODY) -> _Generation:
    """The ASGI app: the generation routes (``_Generation``) in front of a FastAPI app for the rest.
    ``api_key``: one key, or several (each a client of its own to ``core.gate``; with one key
    or none, a client is its address)."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    accepted = [f"Bearer {k}".encode() for k in keys]
    expected = accepted or None
    app = FastAPI(title="mixrl", openapi_url=None, docs_url=None, redoc_url=None)

    def answer(status: int, out: Any) -> Response:
        return Response(dumps(out), status_code=status, media_type="application/json")

    def check_key(got: bytes) -> None:
        if expected is not None and not any([hmac.compare_digest(got, e) for e in expected]):  # each compared
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")

    def client_of(auth: bytes, scope: dict[str, Any]) -> str:
        """Who sent it, for the fair shares: its key among several, else its address."""
        if len(accepted) > 1:
            for i, e in enumerate(accepted):
                if hmac.compare_digest(auth, e):
                    return f"key{i}"
        addr = scope.get("client")
        return f"addr:{addr[0]}" if addr else "addr:?"

    async def respond(path: str, work: Callable[[], Awaitable[Any]]) -> tuple[int, Any]:
        """The route's status and JSON: its result, an OpenAI-shaped error, or a logged 500."""
        try:
            return 200, await work()
        except ApiError as e:
            core.counts["errors"] += 1
            return e.status, e.body()
        except Exception:  # noqa: BLE001 - answered as OpenAI does, the traceback kept in the log
            log.exception("internal error answering %s", path)
            return 500, ApiError(500, "internal server error", type_="server_error").body()

    async def generation(handle: Handler, path: str, sid: str | None, raw: bytes, client: str) -> tuple[int, Any]:
        async def work() -> Any:
            heavy = len(raw) > OFFLOAD_BYTES
            body = await asyncio.to_thread(_json_object, raw) if heavy else _json_object(raw)
            return await handle(body, _session(sid, body), heavy, client)

        return await respond(f"POST {path}", work)

    def refuse(auth: bytes | None, length: int | None) -> tuple[int, Any] | None:
        """The answer before the body is read (a wrong key, a declared length past the limit), or
        past the limit while reading (``auth`` None)."""
        try:
            if auth is not None:
                check_key(auth)
            if length is not None and length > max_body:
                raise _too_large(max_body)
        except ApiError as e:
            core.counts["errors"] += 1
            return e.status, e.body()
        return None

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        async def work() -> Any:
            check_key(request.headers.get("authorization", "").encode("latin-1"))
            return {"object": "list", "data": [
                {"id": core.model, "object": "model", "created": int(time.time()), "owned_by": "mixrl"}]}

        return answer(*await respond("GET /v1/models", work))

    @app.get("/health")
    async def health() -> Response:
        return answer(200, {"status": "ok"})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> Response:  # unknown path, wrong method
        code = {404: "not_found"}.get(e.status_code)
        return answer(e.status_code, ApiError(e.status_code, str(e.detail), code=code).body())

    routes: dict[str, Handler] = {"/v1/chat/completions": core.chat_completion, "/v1/completions": core.completion}
    return _Generation(app, routes, generation, refuse, max_body, client_of)


Handler = Callable[[dict[str, Any], "str | None", bool, str], Awaitable[Any]]


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large")


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = loads(raw or b"null")
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not JSON: {getattr(e, 'msg', e)}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _session(header: str | None, body: dict[str, Any]) -> str | None:
    sid: Any = header or body.get("user")
    if sid is not None and (not isinstance(sid, str) or not 0 < len(sid) <= 256):
        raise ApiError(400, "the session id (X-Session-ID or user) must be a string of 1-256 characters",
                       param="user")
    return sid


class _Generation:
    """ASGI: POSTs to the generation paths answered from the raw scope; anything else to ``app``."""

    def __init__(self, app: Any, routes: dict[str, Handler], run: Callable[..., Awaitable[tuple[int, Any]]],
                 refuse: Callable[[bytes | None, int | None], tuple[int, Any] | None], max_body: int,
                 client_of: Callable[[bytes, dict[str, Any]], str]) -> None:
        self.app, self.routes, self.run, self.refuse, self.max_body = app, routes, run, refuse, max_body
        self.client_of = client_of

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        handle = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if handle is None:
            return await self.app(scope, receive, send)
        if scope["method"] != "POST":
            out = ApiError(405, "Method Not Allowed").body()
            return await _send(send, 405, out, [(b"allow", b"POST")])
        auth, sid, length = b"", None, None
        for name, value in scope["headers"]:  # names are lower-case (ASGI); the first of each counts
            if name == b"authorization" and not auth:
                auth = value
            elif name == SESSION_HEADER and sid is None:
                sid = value.decode("latin-1")
            elif name == b"content-length" and length is None:
                length = int(value) if value.isdigit() else None  # the HTTP parser rejects a malformed one
        refused = self.refuse(auth, length)
        if refused is not None:  # the body is never read
            return await _send(send, *refused, CLOSE if length is None or length > UNREAD_CLOSE else ())
        chunks, size, limit = [], 0, self.max_body
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return  # nobody to answer
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:  # a body without Content-Length: no more is read once past the limit
                code, err = self.refuse(None, size) or (413, {})
                return await _send(send, code, err, CLOSE)
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        work = asyncio.ensure_future(self.run(handle, scope["path"], sid, raw, self.client_of(auth, scope)))
        watch = asyncio.ensure_future(receive())  # after the body, the next message is the client leaving

        def left(_: Any) -> None:
            work.cancel()  # its queued choices leave the fair gate, nothing is answered

        watch.add_done_callback(left)
        try:
            status, out = await work
        except asyncio.CancelledError:
            if watch.done() and not watch.cancelled():
                return  # nobody to answer
            raise
        finally:
            watch.remove_done_callback(left)
            watch.cancel()
        await _send(send, status, out)


async def _send(send: Any, status: int, out: Any, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = dumps(out)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *extra]})
    await send({"type": "http.response.body", "body": data})


def loopback_socket() -> socket.socket:
    """A socket bound to a free loopback port, for ``uvicorn.Server.serve(sockets=[...])``:
    bound here and kept, so no other process can take the port between choosing and serving."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def server_options(guard: Guard | None = None) -> dict[str, Any]:
    """uvicorn settings of every server of this app: httptools' HTTP parser where installed
    (``uvicorn[standard]``; h11, pure Python, costs more per request) under ``guard``'s
    deadlines and connection limit (``guard.Guard()``'s defaults when None), no proxy-header
    rewriting (the client's address is the socket's, not a header's), no access log."""
    return {"http": guarded_protocol(guard or Guard()), "proxy_headers": False, "access_log": False,
            "log_level": "warning"}


# How the endpoint's replicas batch concurrent requests (`mixrl serve` and its benchmarks).
BATCHING = {"max_batch": 64, "max_wait_ms": 500, "idle_ms": 5}


def loop_runner() -> Any:
    """``uvloop.run`` where uvloop is installed (``uvicorn[standard]``): a cheaper event loop per
    HTTP request; else ``asyncio.run``."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run
