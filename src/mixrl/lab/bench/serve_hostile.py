"""The endpoint under hostile load: ``mixrl bench serve --hostile --json``.

A real server (uvicorn on 127.0.0.1, ``ServeCore`` with ``mixrl serve``'s defaults:
4 MiB body limit, session TTL and LRU cap) in this process over one sampler
worker process; the clients in a second process, speaking HTTP/1.1 over plain
asyncio streams (no client library between the bytes and the server).

Rounds alternate (``--hostile-rounds`` of each, interleaved, so a change of the
machine's load hits all alike):

- ``quiet``: ``--sessions`` well-formed conversations of ``--turns`` chat
  requests (``--max-tokens``), each on its own keep-alive connection; each
  request a session of its own (no ``X-Session-ID``), so what the server keeps
  after the rounds is only what leaked (the warm-up's conversations are named
  sessions, kept: the server's state before the rounds);
- ``hostile``: the same well-formed load, while, until it is done (each attacker
  bounded in count): bodies declaring 64 MiB (8 MiB sent), chunked bodies of
  6 MiB (no ``Content-Length``), 16 MiB bodies with a wrong key, slow bodies
  (64 bytes every 100 ms, never finished), failing requests in named sessions
  (a conversation past the context, 1 MiB of text, an empty stop string, n = 99,
  an unknown role, a body that is not JSON), and long replies (``max_tokens``
  256) with stop strings;
- ``long_replies``: the well-formed load beside the same long replies without stop
  strings and no attacker: the engine's share of the machine, the limit that the
  hostile round is also measured against (``p99_hostile_over_long_replies``).

Reported: p50/p99 latency of the well-formed requests per kind of round and
``p99_hostile_over_quiet`` (goal <= 2); this process's RSS (the server's: the
engine is in its worker) after a warm-up round and after the last round
(``rss_after_over_before``, goal <= 1.1), and its anonymous part alone
(``anon_*``: the server's own allocations, not the mapped libraries that other
processes' memory pressure evicts; its peak sampled every 50 ms);
``leaked_sessions``: sessions left beside the warm-up's (goal 0); the attackers' requests by status; the 1-minute load average.
Then each attack of ``serve_attacks`` beside a normal client (``--attack-seconds`` each; 0
skips them), on the same server: its deadlines, connection limit, session bound and fair
gate are reported under ``limits``, each attack's figures under ``attacks``.
The model is ``--long-model`` (default ``random:256x4``: a random Qwen3 that
rarely ends a turn, so long replies are long), or ``--model`` when that is ``none``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any

from mixrl.lab.bench.http_wire import CHAT, KEY, MIB
from mixrl.lab.bench.http_wire import Conn as _Conn
from mixrl.lab.bench.http_wire import auth as _auth
from mixrl.lab.bench.http_wire import p_ms as _p
from mixrl.lab.bench.http_wire import post_head as _head
from mixrl.lab.bench.http_wire import read_response as _read
from mixrl.system.jsonout import json_text

KINDS = ("quiet", "long_replies", "hostile")  # the rounds, interleaved


def configure(parser: argparse.ArgumentParser) -> None:
    """The hostile bench's own options (with ``mixrl bench serve``'s model, sessions, turns, max tokens)."""
    parser.add_argument("--hostile", action="store_true",
                        help="the endpoint under hostile load beside well-formed requests (serve_hostile)")
    parser.add_argument("--hostile-rounds", type=int, default=3, help="rounds of each kind, quiet and hostile")
    parser.add_argument("--hostile-seconds", type=float, default=300.0, help="the whole load's time limit")
    parser.add_argument("--hostile-pause", type=float, default=0.1,
                        help="seconds each attacker waits between attempts (0: as fast as it can)")
    parser.add_argument("--attack-seconds", type=float, default=15.0,
                        help="seconds of each attack beside the normal client (serve_attacks); 0: none")


# -- client side (a second process): mixrl.lab.bench.http_wire ------------------------


async def _well_formed(port: int, args: argparse.Namespace, session: str | None) -> list[float]:
    """``--sessions`` conversations; named ``{session}-{i}`` sessions, or each request a session of its own."""
    conns = [await _Conn(port).open() for _ in range(args.sessions)]
    lat: list[float] = []

    async def conversation(i: int) -> None:
        msgs: list[dict[str, Any]] = [{"role": "user", "content": f"What is {i} + {i + 1}?"}]
        for t in range(args.turns):
            body = json.dumps({"messages": msgs, "max_tokens": args.max_tokens, "seed": i * 100 + t}).encode()
            t0 = time.perf_counter()
            named = {"X-Session-ID": f"{session}-{i}"} if session else {}
            status, data = await conns[i].post(body, _auth(**named))
            lat.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"a well-formed request got HTTP {status}: {data[:200]!r}")
            reply = json.loads(data)["choices"][0]["message"]
            msgs = msgs + [{k: v for k, v in reply.items() if v is not None}, {"role": "user", "content": "And?"}]

    try:
        await asyncio.gather(*(conversation(i) for i in range(args.sessions)))
    finally:
        for c in conns:
            c.close()
    return lat


FAILING = [  # (kind, body): each refused with a 400
    ("past_context", {"messages": [{"role": "user", "content": "1+2=3; " * 300}]}),
    ("one_mib_text", {"messages": [{"role": "user", "content": "x" * MIB}]}),
    ("empty_stop", {"messages": [{"role": "user", "content": "hi"}], "stop": [""]}),
    ("bad_n", {"messages": [{"role": "user", "content": "hi"}], "n": 99}),
    ("bad_role", {"messages": [{"role": "wizard", "content": "hi"}]}),
]


async def _attackers(port: int, stop: asyncio.Event, seen: Counter, hostile: bool, pause: float) -> None:
    """Every attacker loops until ``stop`` (each bounded in count); not ``hostile``: only the
    long replies, without stop strings (the engine's share, the limit the others are measured by)."""
    chunk = b"x" * MIB

    async def raw(headers: dict[str, str], pieces: int, piece: bytes, kind: str) -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        try:
            w.write(_head(CHAT, headers))
            for _ in range(pieces):
                w.write(piece)
                await w.drain()
                seen["bytes_sent"] += len(piece)
            status, _ = await asyncio.wait_for(_read(r), 30)
            seen[f"{kind}:{status}"] += 1
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError) as e:
            seen[f"{kind}:{type(e).__name__}"] += 1
        finally:
            w.close()

    async def loop(kind: str, limit: int, once: Any) -> None:
        for i in range(limit):
            if stop.is_set():
                return
            await once(i)
            await asyncio.sleep(pause)  # each attacker's pace

    async def declared(_: int) -> None:  # 64 MiB declared, 8 MiB sent
        await raw(_auth(**{"Content-Length": str(64 * MIB)}), 8, chunk, "declared_64mib")

    async def chunked(_: int) -> None:  # no Content-Length: 6 MiB in 64 KiB chunks
        piece = b"10000\r\n" + b"x" * 65536 + b"\r\n"
        await raw(_auth(**{"Transfer-Encoding": "chunked"}), 96, piece, "chunked_6mib")

    async def wrong_key(_: int) -> None:
        await raw(_auth("wrong", **{"Content-Length": str(16 * MIB)}), 16, chunk, "wrong_key_16mib")

    async def slow(_: int) -> None:  # 64 bytes every 100 ms, never finished
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_head(CHAT, _auth(**{"Content-Length": "1000000"})))
        try:
            while not stop.is_set():
                w.write(b" " * 64)
                await w.drain()
                await asyncio.sleep(0.1)
            seen["slow_body:abandoned"] += 1
        except OSError:
            seen["slow_body:closed"] += 1  # the server's body deadline
        finally:
            w.close()

    async def failing(i: int) -> None:
        conn = await _Conn(port).open()
        try:
            for j, (kind, body) in enumerate(FAILING):
                data = json.dumps(body).encode()
                seen["bytes_sent"] += len(data)
                status, _ = await conn.post(data, _auth(**{"X-Session-ID": f"evil-{i}-{j}"}))
                seen[f"{kind}:{status}"] += 1
            status, _ = await conn.post(b"{not json", _auth(**{"X-Session-ID": f"evil-{i}-json"}))
            seen[f"not_json:{status}"] += 1
        finally:
            conn.close()

    async def long_reply(i: int) -> None:
        conn = await _Conn(port).open()
        body = {"messages": [{"role": "user", "content": f"Tell a long story {i}"}], "max_tokens": 256,
                "seed": i, **({"stop": ["zz", "q!", "<<", ">>"]} if hostile else {})}
        try:
            status, _ = await conn.post(json.dumps(body).encode(), _auth())
            seen[f"long_reply{'_stops' if hostile else ''}:{status}"] += 1
        finally:
            conn.close()

    long = [loop("long", 200, long_reply) for _ in range(4)]
    if not hostile:
        await asyncio.gather(*long)
        return
    await asyncio.gather(loop("declared", 40, declared), loop("chunked", 40, chunked),
                         loop("wrong_key", 40, wrong_key), *(slow(i) for i in range(16)),
                         *(loop("failing", 400, failing) for _ in range(2)), *long)


async def _client(port: int, args: argparse.Namespace) -> None:
    """Warm-up, then the rounds; a line on stdout at each round's start and end (the server
    samples its RSS and sessions there), then the figures."""
    def say(**kw: Any) -> None:
        print(json.dumps(kw), flush=True)

    await _well_formed(port, args, "warm")  # the sessions the server keeps
    say(event="warmed")
    await asyncio.to_thread(sys.stdin.readline)  # the server has taken its "before" figures
    lat: dict[str, list[float]] = {kind: [] for kind in KINDS}
    seen: Counter = Counter()
    deadline = time.perf_counter() + args.hostile_seconds
    for _ in range(args.hostile_rounds):
        for kind in KINDS:
            if time.perf_counter() > deadline:
                break
            stop = asyncio.Event()
            attack = (asyncio.ensure_future(_attackers(port, stop, seen, kind == "hostile", args.hostile_pause))
                      if kind != "quiet" else None)
            if attack is not None:
                await asyncio.sleep(0.2)  # the attackers are on the wire first
            lat[kind] += await _well_formed(port, args, None)
            if attack is not None:
                stop.set()
                await attack
    attacks: dict[str, Any] = {}
    if args.attack_seconds > 0:
        from mixrl.lab.bench import serve_attacks

        async def wait(_: Any) -> None:
            await asyncio.to_thread(sys.stdin.readline)  # the server has taken its figures

        attacks = await serve_attacks.client(port, args, say, wait)
    say(event="done", latencies=lat, attackers=dict(sorted(seen.items())), attacks=attacks)


# -- server side (this process) ----------------------------------------------------------
def _rss() -> tuple[int, int]:
    """(RSS, its anonymous part) of this process in bytes. The anonymous part is what the
    server allocated (heap, buffers); the rest is mapped files (libraries), which the kernel
    drops and reloads under memory pressure from other processes."""
    try:
        with open("/proc/self/status") as f:
            kb = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if k in ("VmRSS", "RssAnon")}
        return kb["VmRSS"] << 10, kb["RssAnon"] << 10
    except (OSError, KeyError):
        import psutil

        rss = int(psutil.Process().memory_info().rss)
        return rss, rss


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import uvicorn
    from transformers import AutoTokenizer

    from mixrl.lab.bench import serve_attacks
    from mixrl.lab.bench.fixtures import random_model
    from mixrl.models.chat import ChatFormat
    from mixrl.models.loading import resolve_model
    from mixrl.records.generation import GenerationRequest, SamplingParams
    from mixrl.runtime.backends.embedded.process import ProcessSampler
    from mixrl.serve.app import BATCHING, loopback_socket, make_app, server_options
    from mixrl.serve.core import ServeCore
    from mixrl.serve.fair import FairGate
    from mixrl.system.heap import settle_heap

    model = args.long_model if args.long_model != "none" else args.model
    with tempfile.TemporaryDirectory() as tmp:
        path = random_model(model, tmp) if model.startswith("random:") else str(resolve_model(model))
        chat = ChatFormat(AutoTokenizer.from_pretrained(path))
        sampler = ProcessSampler("hostile/0", args.profile)
        await sampler.start(path, args.profile, 0, args.threads or (os.cpu_count() or 1), batching=BATCHING)

    async def generate(session: str, request: Any) -> Any:
        return await sampler.generate(request)

    gate = FairGate(capacity=BATCHING["max_batch"])
    core = ServeCore(chat, generate, model="policy", max_total_tokens=1024, default_max_tokens=args.max_tokens,
                     session_bytes=serve_attacks.SESSION_MIB * MIB, gate=gate)
    guard = serve_attacks.guard()
    args.limit, args.room = guard.max_connections, gate.capacity - gate.reserve  # for the attackers
    sock = loopback_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(core, api_key=KEY), lifespan="off", timeout_keep_alive=300,
                                           **server_options(guard)))
    server.install_signal_handlers = lambda: None
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    settle_heap()
    load = [round(os.getloadavg()[0], 2)]
    peak = [0]

    async def sample() -> None:
        while True:
            peak[0] = max(peak[0], _rss()[1])
            await asyncio.sleep(0.05)

    sampling = asyncio.ensure_future(sample())
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mixrl.lab.bench.serve_hostile", str(port), json.dumps(vars(args)),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 24)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = await proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the client process exited with {await proc.wait()}")
        gc.collect()
        before, peak[0] = _rss(), 0
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        rounds_done, after, marks, kept = False, before, {}, None
        probe_ids = chat.encode("probe")

        async def probe() -> None:
            await sampler.generate(GenerationRequest(probe_ids, SamplingParams(max_new_tokens=1)))

        t0 = time.perf_counter()
        await probe()
        quiet_probe = time.perf_counter() - t0
        while (line := await proc.stdout.readline()):
            msg = json.loads(line)
            if msg["event"] == "done":
                break
            if not rounds_done:  # the rounds are over: their "after" figures
                gc.collect()
                after, rounds_done, kept = _rss(), True, list(core.sessions.sessions)
            if msg["at"] == "after":
                await serve_attacks.drain(core, probe, quiet_probe)
            gc.collect()
            marks[f"{msg['name']}:{msg['at']}"] = {
                "rss_mb": round(_rss()[0] / 2**20, 1), "fds": serve_attacks.fds(),
                "sessions_mb": round(core.sessions.bytes / 2**20, 1),
                "frames_mb": round(core.sessions.frames.bytes / 2**20, 1)}
            proc.stdin.write(b"ok\n")
            await proc.stdin.drain()
        if await proc.wait() or not line:
            raise RuntimeError(f"the client process exited with {proc.returncode}")
        out = json.loads(line)
        if not rounds_done:
            gc.collect()
            after = _rss()
    finally:
        sampling.cancel()
        server.should_exit = True
        await task
        await sampler.close()
    load.append(round(os.getloadavg()[0], 2))
    lat = out["latencies"]
    kept = list(core.sessions.sessions) if kept is None else kept  # after the rounds, before the attacks
    legit = sum(1 for s in kept if s.startswith("warm-"))  # the warm-up's conversations
    p99 = {kind: _p(lat[kind], 0.99) for kind in KINDS}
    return {
        "p99_hostile_over_quiet": round(p99["hostile"] / p99["quiet"], 3),
        # the engine serving the long replies beside is the limit: the attackers' cost beyond it
        "p99_hostile_over_long_replies": round(p99["hostile"] / p99["long_replies"], 3),
        **{kind: {"requests": len(lat[kind]), "p50_ms": _p(lat[kind], 0.5), "p99_ms": p99[kind],
                  "mean_ms": round(statistics.fmean(lat[kind]) * 1e3, 1)} for kind in KINDS},
        "rss_before_mb": round(before[0] / 2**20, 1), "rss_after_mb": round(after[0] / 2**20, 1),
        "rss_after_over_before": round(after[0] / before[0], 3),
        "anon_before_mb": round(before[1] / 2**20, 1), "anon_after_mb": round(after[1] / 2**20, 1),
        "anon_peak_mb": round(peak[0] / 2**20, 1), "anon_after_over_before": round(after[1] / before[1], 3),
        "leaked_sessions": len(kept) - legit, "sessions_kept": legit,
        "sessions_evicted": core.sessions.evicted, "attackers": out["attackers"],
        "errors_answered": core.counts["errors"], "rounds": args.hostile_rounds, "sessions": args.sessions,
        "turns": args.turns, "max_tokens": args.max_tokens, "model": model, "profile": args.profile,
        "hostile_pause_s": args.hostile_pause, "load_avg_1m": load,
        "attacks": serve_attacks.report(out.get("attacks") or {}, marks),
        "limits": {"header_timeout_s": guard.header_timeout, "body_timeout_s": guard.body_timeout,
                   "max_connections": guard.max_connections, "session_mib": serve_attacks.SESSION_MIB,
                   "fair_capacity": gate.capacity, "fair_reserve": gate.reserve, "attack_seconds": args.attack_seconds}}


def main(args: argparse.Namespace) -> int:
    """``mixrl bench serve --hostile``: checked flags, then ``run``; exit 2 naming a bad flag."""
    if (args.hostile_rounds < 1 or not args.hostile_seconds > 0 or not args.hostile_pause >= 0
            or not args.attack_seconds >= 0):
        print("mixrl bench serve: --hostile-rounds must be >= 1, --hostile-seconds > 0, --hostile-pause >= 0, "
              "--attack-seconds >= 0",
              flush=True, file=sys.stderr)
        return 2
    from mixrl.serve.app import loop_runner

    try:
        res = loop_runner()(run(args))
    except ValueError as e:
        if not str(e).startswith("--"):
            raise
        print(f"mixrl bench serve: {e}", flush=True, file=sys.stderr)
        return 2
    if args.json:
        print(json_text(res))
    else:
        for k, v in res.items():
            print(f"{k:24s} {v}")
    return 0


if __name__ == "__main__":  # the client process: PORT ARGS_JSON
    from mixrl.serve.app import loop_runner

    loop_runner()(_client(int(sys.argv[1]), argparse.Namespace(**json.loads(sys.argv[2]))))
