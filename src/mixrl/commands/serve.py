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
out) and ``--session-ttl`` seconds unused (3600).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import sys
from pathlib import Path
from typing import Any

from mixrl.config import ConfigError
from mixrl.models.chat import ChatFormat, ChatTemplateError
from mixrl.models.loading import resolve_model
from mixrl.serve.app import BATCHING, loop_runner
from mixrl.system.heap import settle_heap
from mixrl.system.seeds import stable_seed
from mixrl.weights.refs import WeightsRef


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help='"bundled", a local HF model directory, or a hub id in the local HF cache')
    parser.add_argument("--profile", default="fp32", help="sampler profile(s), comma-separated: one group each")
    parser.add_argument("--replicas", type=int, default=1, help="replicas per group (>= 1)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    parser.add_argument("--api-key", default=None, help="required API key (default: $MIXRL_API_KEY)")
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


# A burst of HTTP requests reaches a sampler one parse at a time: gather it (idle_ms).


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


async def _serve(args: argparse.Namespace, path: Any, chat: Any, profiles: list[Any], api_key: str | None) -> None:
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
    core = ServeCore(chat, fleet.generate, model=args.model, max_total_tokens=args.max_total_tokens,
                     default_max_tokens=args.max_tokens, session_ttl=args.session_ttl, max_sessions=args.max_sessions)
    app = make_app(core, api_key=api_key, max_body=int(args.max_body_mib * (1 << 20)))
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            timeout_keep_alive=75, **server_options())
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
    api_key = args.api_key or os.environ.get("MIXRL_API_KEY") or None
    if not _loopback(args.host) and not api_key:
        print(f"mixrl serve: refusing to listen on {args.host} without an API key: set --api-key or "
              "MIXRL_API_KEY (loopback addresses need none)", file=sys.stderr)
        return 2
    if args.replicas < 1 or not 0 <= args.port < 65536 or args.max_total_tokens < 2:
        print("mixrl serve: --replicas must be >= 1, --port in [0, 65535], --max-total-tokens >= 2", file=sys.stderr)
        return 2
    for flag, value, lo in (("--max-body-mib", args.max_body_mib, 1 / 1024), ("--session-ttl", args.session_ttl, 1),
                            ("--max-sessions", args.max_sessions, 1)):
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
