"""The in-run endpoint: one local OpenAI-compatible server that agent episodes sample through.

Started on first use inside the run's event loop (uvicorn on ``127.0.0.1``, a
free port, a fresh random API key), so agent code using the ``openai`` client
talks HTTP to it while every request goes to the *calling episode's* own
``generate``: the session runner's closure, pinned by the fleet's router to one
sampler group, seeded per request, shadowed for checkpoints. Each episode is
registered under an unguessable session id; a request naming an unknown
session is refused (an agent cannot write into another episode's record).

    endpoint = await InRunEndpoint.get(chat, max_total_tokens=..., record=...)
    with endpoint.episode(generate) as (session, base_url, api_key):
        ... agent code: AsyncOpenAI(base_url=base_url, api_key=api_key,
                                    default_headers={"X-Session-ID": session}) ...
    traj, earlier_segments = endpoint.core.sessions.finish(session)
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Iterator
from typing import Any

from mixrl.records.generation import GenerationRequest, GenerationResult
from mixrl.serve.app import MAX_BODY, loopback_socket, make_app, server_options
from mixrl.serve.core import ApiError, ServeCore
from mixrl.serve.guard import Guard
from mixrl.system.heap import settle_heap


class InRunEndpoint:
    _instances: dict[int, InRunEndpoint] = {}  # one per event loop

    def __init__(self, core: ServeCore, host: str, port: int, api_key: str, server: Any, task: Any) -> None:
        self.core, self.host, self.port, self.api_key = core, host, port, api_key
        self._server, self._task = server, task
        self.routes: dict[str, Any] = {}

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @classmethod
    async def get(cls, chat: Any, *, max_total_tokens: int, record: str = "support",
                  model: str = "policy", max_body: int | None = None) -> InRunEndpoint:
        """The loop's endpoint, started on first use. ``max_body``: the body limit in bytes
        (default ``app.MAX_BODY``). Its sessions are the registered episodes': unbounded in
        number, age and bytes (each episode finishes its own), and kept when a request fails."""
        loop = asyncio.get_running_loop()
        ep = cls._instances.get(id(loop))
        if ep is not None and not ep._task.done():
            return ep
        import uvicorn


        routes: dict[str, Any] = {}

        async def generate(session: str, request: GenerationRequest) -> GenerationResult:
            fn = routes.get(session)
            if fn is None:
                raise ApiError(400, "unknown session: use the X-Session-ID this episode was given", param="user")
            return await fn(request)

        def adapt(session: str, params: Any) -> Any:
            fn = routes.get(session)
            adapt_fn = getattr(fn, "adapt", None)
            return adapt_fn(params) if adapt_fn is not None else params

        core = ServeCore(chat, generate, model=model, max_total_tokens=max_total_tokens, record=record, adapt=adapt,
                         session_ttl=None, max_sessions=None, session_bytes=None, session_max_bytes=None,
                         owned=routes.__contains__)
        api_key = secrets.token_urlsafe(24)
        sock = loopback_socket()  # bound now: no other process can take the port meanwhile
        port = sock.getsockname()[1]
        # keep-alive longer than an agent's tool call: a connection the server closes while the
        # agent sends its next request would fail that request (agents' clients do not retry)
        app = make_app(core, api_key=api_key, max_body=MAX_BODY if max_body is None else max_body)
        config = uvicorn.Config(app, host="127.0.0.1", port=port,
                                lifespan="off", timeout_keep_alive=300,
                            **server_options(Guard(max_connections=None)))  # the run's own agents: no cap
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # the run owns Ctrl-C
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()  # raises the start-up error
            await asyncio.sleep(0.01)
        settle_heap()  # the run's start-up heap (modules, model, tokenizer) leaves the collector's walks
        ep = cls(core, "127.0.0.1", port, api_key, server, task)
        ep.routes = routes
        cls._instances[id(loop)] = ep
        return ep

    @contextlib.contextmanager
    def episode(self, generate: Any) -> Iterator[tuple[str, str, str]]:
        """Register one episode's ``generate``; yields (session id, base url, api key)."""
        session = secrets.token_hex(12)
        self.routes[session] = generate
        try:
            yield session, self.base_url, self.api_key
        finally:
            self.routes.pop(session, None)

    async def close(self) -> None:
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._task, timeout=5)
        for k, v in list(self._instances.items()):
            if v is self:
                del self._instances[k]
