"""Attacks on the endpoint, each beside a normal client: the second part of ``mixrl bench serve --hostile``.

After ``serve_hostile``'s rounds, the same server (``GUARD``'s deadlines and limit,
``SESSION_MIB`` of sessions, a ``FairGate``) meets each attack in turn:

- ``slow_headers``: 200 sockets sending a header line a second, never finishing;
- ``slow_bodies``: 200 sockets sending 64 bytes of a 100 kB body every 0.5 s;
- ``idle_sockets``: sockets that send nothing, up to the connection limit and 64 past it;
- ``failing_3mb``: 40 distinct 3 MB requests (tools, a name, tool-call arguments,
  contents), each refused with a 400;
- ``sessions``: 16 named sessions growing turn by turn and one rewritten at every request, from
  their own address (a client of the fair gate other than the normal one: their generations are real load);
- ``fairness``: 16 clients (each its own address, 127.0.0.2-17) sending 16-choice
  requests of 2,000 tokens;

and two windows that measure the machine, not the server: ``cpu_busy`` (a process
spinning one of the cores, no attack: what the attackers' own CPU costs the normal
client) and ``fair_limit`` (one client holding the rows the fair gate leaves heavy
clients, ``capacity - reserve``, no queue: the engine's cost of sharing its batch).

Each attack: a quiet window of the normal client alone (``NORMAL`` conversations,
each request a session of its own), then the attack with the normal client beside
it; the server's RSS and open descriptors are taken before the quiet window and
after the attack (its sockets closed, the gate and the engine drained). Reported per
attack: ``p99_over_quiet`` (goal <= 1.5), ``rss_after_over_before`` (<= 1.2),
``fds_leaked`` (0), the normal client's failures and the attackers' answers by status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections import Counter
from typing import Any

from mixrl.lab.bench.http_wire import CHAT, MIB
from mixrl.lab.bench.http_wire import Conn as _Conn
from mixrl.lab.bench.http_wire import auth as _auth
from mixrl.lab.bench.http_wire import p_ms as _p
from mixrl.lab.bench.http_wire import post_head as _head
from mixrl.lab.bench.http_wire import read_response as _read

ATTACKS = ("slow_headers", "slow_bodies", "idle_sockets", "failing_3mb", "sessions", "cpu_busy",
           "fair_limit", "fairness")
SESSIONS_ADDR = "127.0.0.3"  # the session attackers are one client of their own (not the normal client's address)
MACHINE = ("cpu_busy", "fair_limit")  # the machine's limits, not attacks
NORMAL = 2  # the normal client's concurrent conversations
QUIET_S = 6.0
SESSION_MIB = 64  # the bench server's session bound (``mixrl serve``: 256)


def guard() -> Any:
    """The bench server's deadlines and connection limit (shorter than ``mixrl serve``'s, so an
    attack window sees them act)."""
    from mixrl.serve.guard import Guard

    return Guard(header_timeout=5.0, body_timeout=10.0, max_connections=512)


# -- client side ---------------------------------------------------------------------------
async def _normal(port: int, args: Any, seconds: float, conns: list[_Conn]) -> tuple[list[float], int]:
    """``NORMAL`` conversations of sequential requests for ``seconds`` on ``conns`` (opened before the
    attack, as a client's kept-alive connections are): latencies, failures."""
    lat, failed = [], [0]
    end = time.perf_counter() + seconds

    async def one(i: int) -> None:
        k = 0
        while time.perf_counter() < end:
            body = json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {k}?"}],
                               "max_tokens": args.max_tokens, "seed": k}).encode()
            t0 = time.perf_counter()
            try:
                status, _ = await asyncio.wait_for(conns[i].post(body, _auth()), 120)
            except (OSError, asyncio.IncompleteReadError, TimeoutError, IndexError, ValueError):
                failed[0] += 1
                conns[i].close()
                await asyncio.sleep(0.1)
                with contextlib.suppress(OSError):
                    conns[i] = await _Conn(port).open()
                continue
            lat.append(time.perf_counter() - t0)
            failed[0] += status != 200
            k += 1

    await asyncio.gather(*(one(i) for i in range(NORMAL)))
    return lat, failed[0]


async def _status_of(r: asyncio.StreamReader, wait: float) -> str | None:
    """What the server said on a connection within ``wait`` s: its status, ``closed``, or None."""
    try:
        line = await asyncio.wait_for(r.readline(), wait)
    except TimeoutError:
        return None
    except OSError as e:
        return type(e).__name__
    return line.split()[1].decode() if line.startswith(b"HTTP/") else "closed"


async def _trickle(port: int, stop: asyncio.Event, seen: Counter, kind: str, prefix: bytes, piece: bytes,
                   every: float) -> None:
    """Connect, send ``prefix``, then ``piece`` every ``every`` s until the server answers or
    closes (then again), until ``stop``."""
    while not stop.is_set():
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
        except OSError as e:
            seen[f"{kind}:{type(e).__name__}"] += 1
            await asyncio.sleep(0.2)
            continue
        try:
            w.write(prefix)
            while not stop.is_set():
                got = await _status_of(r, every)
                if got is not None:
                    seen[f"{kind}:{got}"] += 1
                    await asyncio.sleep(0.1)  # then again
                    break
                w.write(piece)
        except OSError as e:
            seen[f"{kind}:{type(e).__name__}"] += 1
        finally:
            w.close()


async def _attack(name: str, port: int, args: Any, stop: asyncio.Event, seen: Counter) -> None:
    if name == "slow_headers":
        prefix = f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
        await asyncio.gather(*(_trickle(port, stop, seen, name, prefix, b"X-Slow: 1\r\n", 1.0) for _ in range(200)))
    elif name == "slow_bodies":
        prefix = _head(CHAT, {**_auth(), "Content-Length": "100000"})
        await asyncio.gather(*(_trickle(port, stop, seen, name, prefix, b" " * 64, 0.5) for _ in range(200)))
    elif name == "idle_sockets":
        await asyncio.gather(*(_trickle(port, stop, seen, name, b"", b"", 1.0) for _ in range(args.limit + 64)))
    elif name == "failing_3mb":
        await _failing(port, stop, seen)
    elif name == "sessions":
        await asyncio.gather(*(_grow(port, stop, seen, i) for i in range(16)), _rewrite(port, stop, seen))
    elif name == "fairness":
        await asyncio.gather(*(_heavy(port, stop, seen, f"127.0.0.{2 + i}", 16, 1) for i in range(16)))
    elif name == "fair_limit":
        await _heavy(port, stop, seen, "127.0.0.2", 1, args.room)
    elif name == "cpu_busy":
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "while True: pass")
        await stop.wait()
        proc.kill()
        await proc.wait()


async def _failing(port: int, stop: asyncio.Event, seen: Counter) -> None:
    big = "y" * (3 * MIB)

    def body(i: int) -> dict[str, Any]:
        msgs: list[dict[str, Any]] = [{"role": "user", "content": f"hi {i}"}]
        kind = i % 4
        if kind == 0:
            return {"messages": msgs, "tools": [{"type": "function", "function": {"name": f"f{i}", "description": big}}]}
        if kind == 1:
            msgs[0]["name"] = f"{i}{big}"
        elif kind == 2:
            call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": f"{i}{big}"}}
            msgs += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c", "content": "1"}]
        else:
            msgs[0]["content"] = f"{i}{big}"
        return {"messages": msgs}

    async def sender(start: int) -> None:
        conn = await _Conn(port).open()
        try:
            for i in range(start, 40, 2):
                if stop.is_set():
                    return
                status, _ = await conn.post(json.dumps(body(i)).encode(), _auth(**{"X-Session-ID": f"big-{i}"}))
                seen[f"{['tools', 'name', 'arguments', 'content'][i % 4]}_3mb:{status}"] += 1
        finally:
            conn.close()

    await asyncio.gather(sender(0), sender(1))


async def _grow(port: int, stop: asyncio.Event, seen: Counter, i: int) -> None:
    """A named session extended turn by turn (a new one once past the context), from its own address."""
    conn, gen = await _Conn(port, SESSIONS_ADDR).open(), 0
    msgs: list[dict[str, Any]] = []
    try:
        while not stop.is_set():
            msgs = msgs or [{"role": "user", "content": f"Tell story {i}-{gen}"}]
            body = json.dumps({"messages": msgs, "max_tokens": 64, "seed": gen}).encode()
            status, data = await conn.post(body, _auth(**{"X-Session-ID": f"grow-{i}-{gen}"}))
            seen[f"grow:{status}"] += 1
            if status != 200:
                msgs, gen = [], gen + 1
                continue
            reply = json.loads(data)["choices"][0]["message"]
            msgs = msgs + [{k: v for k, v in reply.items() if v is not None}, {"role": "user", "content": "More."}]
    finally:
        conn.close()


async def _rewrite(port: int, stop: asyncio.Event, seen: Counter) -> None:
    """One named session whose history changes at every request: a new segment each time."""
    conn, k = await _Conn(port, SESSIONS_ADDR).open(), 0
    try:
        while not stop.is_set():
            body = json.dumps({"messages": [{"role": "user", "content": f"Draft {k}"}], "max_tokens": 64}).encode()
            status, _ = await conn.post(body, _auth(**{"X-Session-ID": "rewritten"}))
            seen[f"rewrite:{status}"] += 1
            k += 1
    finally:
        conn.close()


async def _heavy(port: int, stop: asyncio.Event, seen: Counter, addr: str, n: int, parallel: int) -> None:
    """Requests of ``n`` choices of 2,000 tokens from ``addr``, ``parallel`` at a time, until ``stop``."""
    body = json.dumps({"messages": [{"role": "user", "content": "Write at length."}], "n": n,
                       "max_tokens": 2000}).encode()

    async def loop() -> None:
        while not stop.is_set():
            r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(addr, 0))
            try:
                w.write(_head(CHAT, {"Content-Length": str(len(body)), **_auth()}) + body)
                read = asyncio.ensure_future(_read(r))
                halt = asyncio.ensure_future(stop.wait())
                await asyncio.wait({read, halt}, return_when=asyncio.FIRST_COMPLETED)
                halt.cancel()
                if read.done() and not read.exception():
                    seen[f"heavy:{read.result()[0]}"] += 1
                else:
                    read.cancel()  # the connection closes: the server drops what it still owes
                    seen["heavy:abandoned"] += 1
            finally:
                w.close()

    await asyncio.gather(*(loop() for _ in range(parallel)))


async def client(port: int, args: Any, say: Any, wait: Any) -> dict[str, Any]:
    """Each attack between marks (the server takes its figures there); the normal client's figures."""
    out: dict[str, Any] = {}
    attack_s = args.attack_seconds
    for name in ATTACKS:
        print(f"mixrl bench serve: attack {name}", file=sys.stderr, flush=True)
        await wait(say(event="mark", name=name, at="before"))
        conns = [await _Conn(port).open() for _ in range(NORMAL)]
        quiet, quiet_failed = await _normal(port, args, max(1.0, min(QUIET_S, attack_s)), conns)
        stop, seen = asyncio.Event(), Counter()
        task = asyncio.ensure_future(_attack(name, port, args, stop, seen))
        await asyncio.sleep(1.0)  # the attackers are on the wire first
        try:
            lat, failed = await _normal(port, args, attack_s, conns)
        finally:
            stop.set()
            for c in conns:
                c.close()
        await asyncio.wait_for(task, 60)
        await wait(say(event="mark", name=name, at="after"))
        out[name] = {"quiet": quiet, "attack": lat, "failed": quiet_failed + failed, "attackers": dict(sorted(seen.items()))}
    return out


# -- server side -----------------------------------------------------------------------------
def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def drain(core: Any, probe: Any, quiet_probe: float, budget: float = 120.0) -> None:
    """Until the fair gate is empty and the engine answers a one-token probe about as fast as when idle."""
    end = time.monotonic() + budget
    while time.monotonic() < end and core.gate is not None and core.gate.total:
        await asyncio.sleep(0.1)
    while time.monotonic() < end:
        t0 = time.perf_counter()
        await probe()
        if time.perf_counter() - t0 < 3 * quiet_probe + 0.01:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(1.5)  # refused and closed sockets: past REFUSED_LINGER


def report(figures: dict[str, Any], marks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per attack: p99 under attack over quiet, RSS after over before, descriptors leaked."""
    res: dict[str, Any] = {}
    for name, f in figures.items():
        before, after = marks[f"{name}:before"], marks[f"{name}:after"]
        q, a = _p(f["quiet"], 0.99), _p(f["attack"], 0.99)
        res[name] = {"p99_over_quiet": round(a / q, 3) if q else None, "quiet_p99_ms": q, "attack_p99_ms": a,
                     "quiet_p50_ms": _p(f["quiet"], 0.5), "attack_p50_ms": _p(f["attack"], 0.5),
                     "normal_requests": len(f["quiet"]) + len(f["attack"]), "normal_failed": f["failed"],
                     "rss_before_mb": before["rss_mb"], "rss_after_mb": after["rss_mb"],
                     "rss_after_over_before": round(after["rss_mb"] / before["rss_mb"], 3),
                     "fds_before": before["fds"], "fds_after": after["fds"],
                     "fds_leaked": max(0, after["fds"] - before["fds"]), "attackers": f["attackers"],
                     **{k: after[k] for k in ("sessions_mb", "frames_mb") if k in after}}
    attacks = [res[n] for n in res if n not in MACHINE]
    if attacks:
        res["worst_rss_after_over_before"] = max(r["rss_after_over_before"] for r in attacks)
        res["fds_leaked"] = sum(r["fds_leaked"] for r in attacks)
        res["normal_failed"] = sum(r["normal_failed"] for r in attacks)
    return res
