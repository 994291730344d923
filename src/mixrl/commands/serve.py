"""``mixrl serve MODEL [--profile P[,P...]] [--replicas N] [--host H] [--port N] [--api-key KEY]``.

A local OpenAI-compatible server on the sampler fleet: one group per profile
(``fp32`` by default, any built-in or vLLM profile), ``--replicas`` replicas
each, sessions pinned to a group by the fleet's router (capacity-weighted),
exactly as in a training run. MODEL is ``bundled``, a local HF directory or a
hub id in the local HF cache.

Each replica is a sampler worker process, as in a run's default embedded
backend, so the server's event loop (HTTP, templating, session recording,
JSON) and the engines never share an interpreter; ``--workers thread`` keeps
them in the server's process.

It listens on ``127.0.0.1`` by default. Listening on any other address needs
an API key (``--api-key`` or ``$MIXRL_API_KEY``); without one it refuses to
start. Clients send ``Authorization: Bearer KEY`` (the ``openai`` client's
``api_key``) and a session id in ``X-Session-ID`` or ``user``.

Request bodies are limited to ``--max-body-mib`` (4 MiB; checked after the key,
before reading), sessions to ``--max-sessions`` (4096, least recently used first
out), ``--session-ttl`` seconds unused (3600) and ``--session-mib`` (256 MiB in all;
``--session-max-mib``, 32, each), the template cache to ``--frame-cache-mib`` (32).

Connections (``serve.guard``): headers within ``--header-timeout`` seconds (10) and
the body within ``--body-timeout`` (30), else 408 and closed; idle ones kept
``--keep-alive`` seconds (75); past ``--max-connections`` (1024) open ones, a new
one is answered 503 at once. Each choice of a request waits for its client's turn
at a slot of the fleet (``serve.fair``: round robin between clients, at most
``--client-queue`` waiting each, 429 past it); a client is its API key when there are
several (``--api-key`` repeated), else its address.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import os
import sys
from pathlib import Path
from typing import Any

from mixrl.config import ConfigError
from mixrl.models.chat import ChatFormat, ChatTemplateError
from mixrl.models.loading import resolve_model
from mixrl.serve.app import BATCHING, loop_runner
from mixrl.serve.bounds import MIB
from mixrl.serve.conversation import FRAME_BYTES
from mixrl.serve.core import SESSION_BYTES, SESSION_MAX_BYTES
from mixrl.serve.guard import Guard
from mixrl.system.heap import settle_heap
from mixrl.system.seeds import stable_seed
from mixrl.weights.refs import WeightsRef


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help='"bundled", a local HF model directory, or a hub id in the local HF cache')
    parser.add_argument("--profile", default="fp32", help="sampler profile(s), comma-separated: one group each")
    parser.add_argument("--replicas", type=int, default=1, help="replicas per group (>= 1)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    parser.add_argument("--api-key", action="append", default=None,
                        help="required API key (default: $MIXRL_API_KEY); repeat it for several clients, "
                             "each then a client of its own in the fair shares")
    parser.add_argument("--max-total-tokens", type=int, default=2048, help="context budget per session")
    parser.add_argument("--max-tokens", type=int, default=256, help="default max_tokens of a request")
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template file (else the tokenizer's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--workers", default="process", choices=("process", "thread"),
                        help="replicas as worker processes (default, as in a run) or inside the server's process")
    parser.add_argument("--max-body-mib", type=float, default=4.0,
                        help="largest request body in MiB (default 4); larger ones get 413 unread")
    parser.add_argument("--session-ttl", type=float, default=3600.0,
                        help="seconds an unused session is kept (default 3600)")
    parser.add_argument("--max-sessions", type=int, default=4096,
                        help="sessions kept at most; past it the least recently used goes (default 4096)")
    parser.add_argument("--session-mib", type=float, default=SESSION_BYTES / MIB,
                        help=f"MiB all sessions' records hold at most (default {SESSION_BYTES // MIB})")
    parser.add_argument("--session-max-mib", type=float, default=SESSION_MAX_BYTES / MIB,
                        help=f"MiB one session holds at most; past it its earliest segments go "
                             f"(default {SESSION_MAX_BYTES // MIB})")
    parser.add_argument("--frame-cache-mib", type=float, default=FRAME_BYTES / MIB,
                        help=f"MiB of the template cache (default {FRAME_BYTES // MIB})")
    parser.add_argument("--header-timeout", type=float, default=Guard.header_timeout,
                        help=f"seconds a request's headers may take (default {Guard.header_timeout:g}): then 408")
    parser.add_argument("--body-timeout", type=float, default=Guard.body_timeout,
                        help=f"seconds a request's body may take (default {Guard.body_timeout:g}): then 408")
    parser.add_argument("--keep-alive", type=float, default=75.0,
                        help="seconds an idle connection is kept between requests (default 75)")
    parser.add_argument("--max-connections", type=int, default=Guard.max_connections,
                        help=f"open connections at most (default {Guard.max_connections}); more are "
                             "answered 503 at once")
    parser.add_argument("--client-queue", type=int, default=256,
                        help="generations (choices) one client may have waiting (default 256); more: 429")


# A burst of HTTP requests reaches a sampler one parse at a time: gather it (idle_ms).


def _fd_room(connections: int, spare: int = 256) -> int:
    """``connections`` open at once, with ``spare`` descriptors beside them (workers, files): the
    soft descriptor limit raised toward the hard one if needed, else the connections fewer."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = connections + spare
    if soft == resource.RLIM_INFINITY or soft >= need:
        return connections
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft >= need:
        return connections
    fewer = max(1, soft - spare)
    print(f"mixrl serve: {soft} file descriptors at most: --max-connections {connections} lowered to {fewer}",
          file=sys.stderr)
    return fewer


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Replica:
    """A fleet handle over a ``BatchingSampler`` in this process (``--workers thread``)."""

    def __init__(self, name: str, group: str, sampler: Any) -> None:
        self.name, self.group, self.sampler = name, group, sampler

    async def generate(self, request: Any) -> Any:
        return await self.sampler.generate(request)

    async def load_weights(self, ref: WeightsRef, version: int) -> None:
        await self.sampler.load_weights(ref, version)

    async def close(self) -> None:
        await self.sampler.close()


async def _serve(args: argparse.Namespace, path: Any, chat: Any, profiles: list[Any], api_key: list[str] | None) -> None:
    import uvicorn
    from safetensors.torch import load_file

    from mixrl.fleet.fleet import Fleet, GroupSpec
    from mixrl.sampling.batching import BatchingSampler
    from mixrl.sampling.factory import make_engine
    from mixrl.serve.app import make_app, server_options
    from mixrl.serve.core import ServeCore
    from mixrl.weights.store import WeightStore

    async def make_replica(group: str, name: str) -> Any:
        prof = next(p for p in profiles if p.name == group)
        seed = stable_seed("serve", name) % (1 << 31)  # the same in every process (never hash())
        if args.workers == "process":  # the engine in its own interpreter: HTTP never waits on its GIL
            from mixrl.runtime.backends.embedded.process import ProcessSampler

            h = ProcessSampler(name, group)
            await h.start(str(path), prof, seed, args.threads, batching=BATCHING)
            return h
        engine = await asyncio.to_thread(make_engine, str(path), prof, group, seed=seed,
                                         max_batch=BATCHING["max_batch"], num_threads=args.threads)
        return _Replica(name, group, BatchingSampler(engine, **BATCHING))

    groups = [GroupSpec(p.name, p.relative_throughput, args.replicas, args.replicas, args.replicas) for p in profiles]
    fleet = Fleet(groups, make_replica, WeightStore())
    weights: dict[str, Any] = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    fleet.publish(0, weights)
    await fleet.start()
    from mixrl.serve.fair import FairGate

    gate = FairGate(capacity=BATCHING["max_batch"] * sum(g.replicas for g in groups), max_queued=args.client_queue)
    core = ServeCore(chat, fleet.generate, model=args.model, max_total_tokens=args.max_total_tokens,
                     default_max_tokens=args.max_tokens, session_ttl=args.session_ttl, max_sessions=args.max_sessions,
                     session_bytes=int(args.session_mib * MIB), session_max_bytes=int(args.session_max_mib * MIB),
                     frame_bytes=int(args.frame_cache_mib * MIB), gate=gate)
    app = make_app(core, api_key=api_key, max_body=int(args.max_body_mib * (1 << 20)))
    guard = Guard(header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                  max_connections=_fd_room(args.max_connections))
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            timeout_keep_alive=args.keep_alive, **server_options(guard))
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        settle_heap()  # start-up is over: the collector no longer walks its heap
        port = server.servers[0].sockets[0].getsockname()[1]
        names = ", ".join(f"{g.name} x{g.replicas}" for g in groups)
        print(f"mixrl serve: {args.model} on http://{args.host}:{port}/v1 (groups: {names}); Ctrl-C stops",
              file=sys.stderr, flush=True)
    try:
        await task
    finally:
        await fleet.close()


def main(args: argparse.Namespace) -> int:
    env_key = os.environ.get("MIXRL_API_KEY")
    api_key = args.api_key or ([env_key] if env_key else None)
    if not _loopback(args.host) and not api_key:
        print(f"mixrl serve: refusing to listen on {args.host} without an API key: set --api-key or "
              "MIXRL_API_KEY (loopback addresses need none)", file=sys.stderr)
        return 2
    if args.replicas < 1 or not 0 <= args.port < 65536 or args.max_total_tokens < 2:
        print("mixrl serve: --replicas must be >= 1, --port in [0, 65535], --max-total-tokens >= 2", file=sys.stderr)
        return 2
    for flag, value, lo in (("--max-body-mib", args.max_body_mib, 1 / 1024), ("--session-ttl", args.session_ttl, 1),
                            ("--max-sessions", args.max_sessions, 1), ("--session-mib", args.session_mib, 1),
                            ("--session-max-mib", args.session_max_mib, 1 / 16),
                            ("--frame-cache-mib", args.frame_cache_mib, 1 / 16),
                            ("--header-timeout", args.header_timeout, 0.1), ("--body-timeout", args.body_timeout, 0.1),
                            ("--keep-alive", args.keep_alive, 0.1), ("--max-connections", args.max_connections, 1),
                            ("--client-queue", args.client_queue, 1)):
        if not value >= lo:
            print(f"mixrl serve: {flag} must be >= {lo:g}, got {value}", file=sys.stderr)
            return 2
    from mixrl.sampling.profiles import get_profile

    try:
        path = resolve_model(args.model)
        profiles = [get_profile(p.strip()) for p in args.profile.split(",") if p.strip()]
        from transformers import AutoTokenizer

        template = Path(args.chat_template).read_text() if args.chat_template else None
        chat = ChatFormat(AutoTokenizer.from_pretrained(str(path)), template)
    except (ConfigError, ChatTemplateError, KeyError, ValueError, OSError) as e:
        print(f"mixrl serve: {e}".splitlines()[0], file=sys.stderr)
        return 2
    try:
        loop_runner()(_serve(args, path, chat, profiles, api_key))
    except KeyboardInterrupt:
        return 0
    return 0
