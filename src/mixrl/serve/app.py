"""The HTTP face of ``ServeCore``: FastAPI routes in OpenAI's paths and error shapes.

    POST /v1/chat/completions   messages (+ tools) -> choices (content, tool_calls, logprobs)
    POST /v1/completions        prompt (text or token ids) -> choices (text)
    GET  /v1/models             the one model served
    GET  /health                liveness

With an API key set, every /v1 route needs ``Authorization: Bearer KEY``
(401 otherwise). Errors are OpenAI's JSON (``{"error": {...}}``): 400 for a
malformed body (the parameter named), 401, 404, 503 when the sampler failed.

Per-request cost: the routes are plain Starlette routes on the FastAPI app
(the body is parsed here, so FastAPI's dependency solving and validation would
do nothing but cost time), and JSON goes through ``orjson``; a non-finite number
(the log-prob of a candidate outside the top-p support is -inf) is written as null,
which JSON can carry.
"""

from __future__ import annotations

import hmac
import time
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import Response

from mixrl.serve.core import ApiError, ServeCore

SESSION_HEADER = "x-session-id"


dumps, loads = orjson.dumps, orjson.loads
DecodeError: type[ValueError] = orjson.JSONDecodeError


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def make_app(core: ServeCore, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="mixrl", docs_url=None, redoc_url=None, openapi_url=None)

    def check_key(request: Request) -> None:
        if api_key is not None:
            auth = request.headers.get("authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {api_key}".encode()):
                raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")

    async def body_of(request: Request) -> dict[str, Any]:
        check_key(request)
        try:
            body = loads(await request.body() or b"null")
        except DecodeError as e:
            raise ApiError(400, f"the request body is not JSON: {getattr(e, 'msg', e)}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def session_of(request: Request, body: dict[str, Any]) -> str | None:
        sid = request.headers.get(SESSION_HEADER) or body.get("user")
        if sid is not None and (not isinstance(sid, str) or not 0 < len(sid) <= 256):
            raise ApiError(400, "the session id (X-Session-ID or user) must be a string of 1-256 characters",
                           param="user")
        return sid

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        core.counts["errors"] += 1
        return _error(e)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> JSONResponse:  # 404, 405: OpenAI's shape too
        return _error(ApiError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None))

    async def chat(request: Request) -> JSONResponse:
        body = await body_of(request)
        return JSONResponse(await core.chat_completion(body, session_of(request, body)))

    async def completions(request: Request) -> JSONResponse:
        body = await body_of(request)
        return JSONResponse(await core.completion(body, session_of(request, body)))

    async def models(request: Request) -> JSONResponse:
        check_key(request)
        return JSONResponse({"object": "list", "data": [
            {"id": core.model, "object": "model", "created": int(time.time()), "owned_by": "mixrl"}]})

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    return app
