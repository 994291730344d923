"""The HTTP face of ``ServeCore``: OpenAI's paths and error shapes as one ASGI app (served by uvicorn).

    POST /v1/chat/completions   messages (+ tools) -> choices (content, tool_calls, logprobs)
    POST /v1/completions        prompt (text or token ids) -> choices (text)
    GET  /v1/models             the one model served
    GET  /health                liveness

With an API key set, every /v1 route needs ``Authorization: Bearer KEY``
(401 otherwise). Errors are OpenAI's JSON (``{"error": {...}}``): 400 for a
malformed body (the parameter named), 401, 404, 405, 503 when the sampler
failed, 500 for an internal error (its traceback logged on ``mixrl.serve``).

Per-request cost: four fixed routes, each body parsed by ``ServeCore``, need no
framework, so the app is a plain ASGI callable: a dict lookup, the body read,
``orjson`` both ways. Beside the engine's thread every microsecond of the event
loop's Python holds the GIL the engine needs; the FastAPI/Starlette stack this
replaces (error and exception middleware, exit stack, router, request and
response objects) cost about 0.3 ms of the ~0.9 ms the server spent per
request under ``mixrl bench serve``'s load. A non-finite number (the log-prob
of a candidate outside the top-p support is -inf) is written as null, which
JSON can carry.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from mixrl.serve.core import ApiError, ServeCore

SESSION_HEADER = "x-session-id"

dumps, loads = orjson.dumps, orjson.loads
log = logging.getLogger("mixrl.serve")
Headers = dict[bytes, bytes]
ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
_JSON = (b"content-type", b"application/json")


class _Disconnected(Exception):
    pass


async def _read(receive: Any) -> bytes:
    chunks = []
    while True:
        m = await receive()
        if m["type"] != "http.request":  # http.disconnect: nobody to answer
            raise _Disconnected
        chunks.append(m.get("body", b""))
        if not m.get("more_body"):
            return b"".join(chunks)


def make_app(core: ServeCore, api_key: str | None = None) -> ASGIApp:
    expected = f"Bearer {api_key}".encode() if api_key is not None else None

    def check_key(headers: Headers) -> None:
        if expected is not None and not hmac.compare_digest(headers.get(b"authorization", b""), expected):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")

    async def body_of(headers: Headers, receive: Any) -> dict[str, Any]:
        check_key(headers)
        raw = await _read(receive)
        try:
            body = loads(raw or b"null")
        except orjson.JSONDecodeError as e:
            raise ApiError(400, f"the request body is not JSON: {getattr(e, 'msg', e)}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def session_of(headers: Headers, body: dict[str, Any]) -> str | None:
        sid: Any = headers.get(b"x-session-id")
        sid = sid.decode("latin-1") if sid else body.get("user")
        if sid is not None and (not isinstance(sid, str) or not 0 < len(sid) <= 256):
            raise ApiError(400, "the session id (X-Session-ID or user) must be a string of 1-256 characters",
                           param="user")
        return sid

    async def chat(headers: Headers, receive: Any) -> dict[str, Any]:
        body = await body_of(headers, receive)
        return await core.chat_completion(body, session_of(headers, body))

    async def completions(headers: Headers, receive: Any) -> dict[str, Any]:
        body = await body_of(headers, receive)
        return await core.completion(body, session_of(headers, body))

    async def models(headers: Headers, _: Any) -> dict[str, Any]:
        check_key(headers)
        return {"object": "list", "data": [
            {"id": core.model, "object": "model", "created": int(time.time()), "owned_by": "mixrl"}]}

    async def health(_: Headers, __: Any) -> dict[str, Any]:
        return {"status": "ok"}

    routes = {"/v1/chat/completions": ("POST", chat), "/v1/completions": ("POST", completions),
              "/v1/models": ("GET", models), "/health": ("GET", health)}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                await send({"type": m["type"] + ".complete"})
                if m["type"] == "lifespan.shutdown":
                    return
        if scope["type"] != "http":
            return
        route = routes.get(scope["path"].rstrip("/") or "/")
        try:
            if route is None:
                status, out = 404, ApiError(404, "Not Found", code="not_found").body()
            elif scope["method"] != route[0]:
                status, out = 405, ApiError(405, "Method Not Allowed").body()
            else:
                status, out = 200, await route[1](dict(scope["headers"]), receive)
        except ApiError as e:
            core.counts["errors"] += 1
            status, out = e.status, e.body()
        except _Disconnected:
            return
        except Exception:  # noqa: BLE001 - answered as OpenAI does, the traceback kept in the log
            log.exception("internal error answering %s %s", scope["method"], scope["path"])
            status, out = 500, ApiError(500, "internal server error", type_="server_error").body()
        payload = dumps(out)
        await send({"type": "http.response.start", "status": status,
                    "headers": [_JSON, (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    return app


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
