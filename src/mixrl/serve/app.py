"""The HTTP face of ``ServeCore``: OpenAI's paths and error shapes as a FastAPI app (served by uvicorn).

    POST /v1/chat/completions   messages (+ tools) -> choices (content, tool_calls, logprobs)
    POST /v1/completions        prompt (text or token ids) -> choices (text)
    GET  /v1/models             the one model served
    GET  /health                liveness

With an API key set, every /v1 route needs ``Authorization: Bearer KEY``
(401 otherwise). Errors are OpenAI's JSON (``{"error": {...}}``): 400 for a
malformed body (the parameter named), 401, 404, 405, 503 when the sampler
failed, 500 for an internal error (its traceback logged on ``mixrl.serve``).

Bodies are validated by ``ServeCore`` (which names the parameter in its 400),
not by pydantic models, and read and written with ``orjson``. The two generation
routes are plain Starlette routes of the FastAPI app (``add_route``: the raw
``Request`` in, a ``Response`` out), so no dependency solving or endpoint
introspection runs per request (about 40 µs a request less, measured on the ASGI
app alone); errors, 404 and 405 go through the same handlers as every route. The engines
run in sampler worker processes (``mixrl serve``, a run's fleet), so the
server's Python never holds an engine's interpreter lock. A non-finite number
(the log-prob of a candidate outside the top-p support is -inf) is written as
null, which JSON can carry.
"""

from __future__ import annotations

import hmac
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mixrl.serve.core import ApiError, ServeCore

SESSION_HEADER = "x-session-id"

dumps, loads = orjson.dumps, orjson.loads
log = logging.getLogger("mixrl.serve")


def make_app(core: ServeCore, api_key: str | None = None) -> FastAPI:
    expected = f"Bearer {api_key}".encode() if api_key is not None else None
    app = FastAPI(title="mixrl", openapi_url=None, docs_url=None, redoc_url=None)

    def answer(status: int, out: Any) -> Response:
        return Response(dumps(out), status_code=status, media_type="application/json")

    def check_key(request: Request) -> None:
        got = request.headers.get("authorization", "").encode("latin-1")
        if expected is not None and not hmac.compare_digest(got, expected):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")

    async def body_of(request: Request) -> dict[str, Any]:
        check_key(request)
        raw = await request.body()
        try:
            body = loads(raw or b"null")
        except orjson.JSONDecodeError as e:
            raise ApiError(400, f"the request body is not JSON: {getattr(e, 'msg', e)}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def session_of(request: Request, body: dict[str, Any]) -> str | None:
        sid: Any = request.headers.get(SESSION_HEADER) or body.get("user")
        if sid is not None and (not isinstance(sid, str) or not 0 < len(sid) <= 256):
            raise ApiError(400, "the session id (X-Session-ID or user) must be a string of 1-256 characters",
                           param="user")
        return sid

    async def guarded(request: Request, work: Callable[[], Awaitable[Any]]) -> Response:
        """The route's answer: its result, an OpenAI-shaped error, or a logged 500."""
        try:
            return answer(200, await work())
        except ApiError as e:
            core.counts["errors"] += 1
            return answer(e.status, e.body())
        except ClientDisconnect:  # nobody to answer
            return Response(status_code=499)
        except Exception:  # noqa: BLE001 - answered as OpenAI does, the traceback kept in the log
            log.exception("internal error answering %s %s", request.method, request.url.path)
            return answer(500, ApiError(500, "internal server error", type_="server_error").body())

    def post(path: str, handle: Callable[[dict[str, Any], str | None], Awaitable[Any]]) -> None:
        async def route(request: Request) -> Response:
            async def work() -> Any:
                body = await body_of(request)
                return await handle(body, session_of(request, body))

            return await guarded(request, work)

        app.add_route(path, route, methods=["POST"])

    post("/v1/chat/completions", core.chat_completion)
    post("/v1/completions", core.completion)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        async def work() -> Any:
            check_key(request)
            return {"object": "list", "data": [
                {"id": core.model, "object": "model", "created": int(time.time()), "owned_by": "mixrl"}]}

        return await guarded(request, work)

    @app.get("/health")
    async def health() -> Response:
        return answer(200, {"status": "ok"})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> Response:  # unknown path, wrong method
        code = {404: "not_found"}.get(e.status_code)
        return answer(e.status_code, ApiError(e.status_code, str(e.detail), code=code).body())

    return app


def loopback_socket() -> socket.socket:
    """A socket bound to a free loopback port, for ``uvicorn.Server.serve(sockets=[...])``:
    bound here and kept, so no other process can take the port between choosing and serving."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def server_options() -> dict[str, Any]:
    """uvicorn settings of every server of this app: httptools' HTTP parser where installed
    (``uvicorn[standard]``; h11, pure Python, costs more per request), no proxy-header
    rewriting (the app never reads the client's address), no access log."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        http = "h11"
    else:
        http = "httptools"
    return {"http": http, "proxy_headers": False, "access_log": False, "log_level": "warning"}
