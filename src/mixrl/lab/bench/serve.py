"""The OpenAI-compatible endpoint against calling the sampler directly: ``mixrl bench serve --json``.

Every arm runs the same load in one invocation, on the same sampler replica
(built-in engine, FP32 profile by default, one ``BatchingSampler`` with the
same batching window). The replica is a sampler worker process, as in a run's
default embedded backend and in ``mixrl serve``; ``--workers thread`` puts it
in this process instead, where the engine and the HTTP server share one
interpreter and the server's Python work runs between the engine's steps:

- ``direct``: ``--sessions`` concurrent conversations of ``--turns`` turns,
  each turn a ``GenerationRequest`` of the recorded ids (what a mixrl episode
  does);
- ``endpoint`` (the headline): the same conversations as OpenAI chat requests
  (the same JSON bodies and ``X-Session-ID`` session ids the ``openai`` client
  sends) to a real uvicorn server on loopback (templating, session recording,
  tool-call parsing and JSON included), sent by a lean async HTTP client:
  ``aiohttp`` where installed (as vLLM's ``benchmark_serving`` load generator),
  else ``httpx.AsyncClient`` without the ``openai`` layer. The bench measures the
  endpoint, not a client library: the ``openai`` client's own CPU (pydantic
  models, retries, headers: about 5 ms a request) would share this machine's
  cores with the server and sit on every request's path;
- ``openai_client``: the same load through the official ``openai`` client,
  reported beside the headline (its ratio and CPU per request), not hidden.

The server runs in this process, as ``mixrl serve`` does; the client code runs
in a second process, as agent code beside a server does (``--client-in-process``
puts it here). Each conversation has its own connection (as each agent episode
does), opened before the timing and kept alive across turns.

The arms run interleaved, ``--repeats`` rounds of (direct, endpoint,
openai_client), so a change of the machine's load hits every arm alike; each
arm reports the median of its rounds and the range of its tokens/s, and every
round's figures are kept (``runs``). ``endpoint_over_direct`` is the ratio of the
median generated tokens per second (goal >= 0.8 at 64 concurrent sessions;
``pair_ratios``: each round's endpoint over that round's direct, and
``pair_ratio_median``, which a drift of the machine's speed during the run does
not move, with ``pair_ratio_ci95``: its distribution-free 95% interval over the
rounds, ``[lo, hi, coverage]``, ``null`` below 6 rounds). Requests carry the
same seeds in every arm, so they sample the same tokens (``same_tokens``). Also reported: requests/s, p50/p99 latency, the CPU
time of this process per arm (``serve_cpu_s``: over the timed load only, not the
server's start or the clients' connections and warm-up),
the engine's prefills and decode steps and (worker process) its CPU
(``engine_cpu_s``; ``engine_cpu_over_direct``: the endpoint arm's over the direct
arm's, the extra engine work from requests arriving spread out), the client's
CPU per request, and ``server_cpu_ms_per_request`` (the endpoint's median CPU
here beyond the direct arm's, per request: HTTP, templating, recording, JSON;
with ``--workers thread`` also any extra engine work), and the 1-minute load
average before and after each workload. Two workloads, each stating its model and reply length:

- the headline: ``--model`` (the shipped bundled policy: replies of a few
  tokens, so per-request HTTP cost weighs most);
- ``long_replies``: ``--long-model`` (default ``random:256x4``, a randomly
  initialised Qwen3 of hidden size 256 and 4 layers on the bundled tokenizer,
  which rarely samples an end of turn) with ``--long-max-tokens`` (64), over
  ``--long-repeats`` rounds (9); ``--long-model none`` skips it.

``--hostile`` runs ``mixrl.lab.bench.serve_hostile`` instead: the endpoint under hostile load.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import time
from typing import Any

from mixrl.lab.bench import serve_hostile
from mixrl.lab.bench.fixtures import random_model, shape
from mixrl.lab.bench.stats import load_summary, median_interval, round_medians
from mixrl.system.jsonout import json_text


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bundled",
                        help='"bundled", an HF model directory, or "random:HIDDENxLAYERS" (random init)')
    parser.add_argument("--profile", default="fp32", help="sampler profile of the replica")
    parser.add_argument("--sessions", type=int, default=64, help="concurrent conversations (>= 1)")
    parser.add_argument("--turns", type=int, default=2, help="requests per conversation (>= 1)")
    parser.add_argument("--max-tokens", type=int, default=24, help="max_tokens of each request")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--max-wait-ms", type=float, default=1000.0,
                        help="the sampler's longest batching window, the same in both arms")
    parser.add_argument("--idle-ms", type=float, default=10.0,
                        help="a batch closes once no request came for this long or a tenth of the longest of "
                             "the last 8 batches' times (the same in both arms)")
    parser.add_argument("--long-model", default="random:256x4",
                        help='second workload: "random:HIDDENxLAYERS", an HF directory, or "none"')
    parser.add_argument("--long-max-tokens", type=int, default=64, help="max_tokens of the second workload")
    parser.add_argument("--long-repeats", type=int, default=9,
                        help="rounds of the second workload (default 9: its arms are each ~20x longer)")
    parser.add_argument("--workers", default="process", choices=("process", "thread"),
                        help="the replica as a sampler worker process (default, as in a run and mixrl serve) "
                             "or in this process")
    parser.add_argument("--repeats", type=int, default=45,
                        help="interleaved rounds of the arms (>= 1; default 45; >= 6 for a 95%% interval)")
    parser.add_argument("--no-openai", action="store_true", help="skip the openai_client arm")
    parser.add_argument("--client-in-process", action="store_true",
                        help="run the endpoint arm's client code in this process")
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)  # internal: URL, run the client only
    parser.add_argument("--client-kind", default="lean", choices=("lean", "openai"), help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    serve_hostile.configure(parser)


async def _direct(chat: Any, sampler: Any, args: argparse.Namespace) -> dict[str, float]:
    from mixrl.records.generation import GenerationRequest, SamplingParams
    from mixrl.serve.core import record_for
    lat: list[float] = []
    tokens = 0

    async def conversation(i: int) -> None:
        nonlocal tokens
        ids = chat.prompt(f"What is {i} + {i + 1}?")
        for t in range(args.turns):
            params = SamplingParams(max_new_tokens=args.max_tokens, stop_ids=chat.stop_ids, seed=i * 100 + t,
                                    record=record_for(1.0))  # as the endpoint at top_p = 1
            t0 = time.perf_counter()
            res = await sampler.generate(GenerationRequest(list(ids), params, request_id=f"{i}/{t}"))
            lat.append(time.perf_counter() - t0)
            tokens += len(res.token_ids)
            ids = ids + res.token_ids
            if not res.token_ids or res.token_ids[-1] not in chat.stop_ids:
                ids.append(chat.end_of_turn_id)
            ids += chat.user_turn("And then?")

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(i) for i in range(args.sessions)))
    return load_summary(time.perf_counter() - t0, lat, tokens)


async def _load(send: Any, args: argparse.Namespace, client: str) -> dict[str, Any]:
    """``--sessions`` conversations of ``--turns`` chat requests; ``send(i, body)`` returns the
    response body (a dict) of conversation ``i``'s request. ``args.ready()`` is awaited before the
    timing and ``args.report(figures)`` called right after it, so the server measures its CPU over
    exactly the timed load (not the connections, warm-up and close)."""
    lat: list[float] = []
    tokens = 0

    async def conversation(i: int) -> None:
        nonlocal tokens
        msgs: list[dict[str, Any]] = [{"role": "user", "content": f"What is {i} + {i + 1}?"}]
        for t in range(args.turns):
            body = {"model": "policy", "messages": msgs, "max_tokens": args.max_tokens, "seed": i * 100 + t}
            t0 = time.perf_counter()
            r = await send(i, body)
            lat.append(time.perf_counter() - t0)
            tokens += r["usage"]["completion_tokens"]
            reply = {k: v for k, v in r["choices"][0]["message"].items() if v is not None}
            msgs = msgs + [reply, {"role": "user", "content": "And then?"}]

    await args.ready()
    cpu, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(conversation(i) for i in range(args.sessions)))
    out: dict[str, Any] = load_summary(time.perf_counter() - t0, lat, tokens)
    out["client_cpu_ms_per_request"] = round((time.process_time() - cpu) / len(lat) * 1e3, 2)
    out["client"] = client
    if asyncio.iscoroutine(done := args.report(out)):
        await done
    return out


def _headers(i: int) -> dict[str, str]:
    return {"Authorization": "Bearer bench", "X-Session-ID": f"s{i}", "Content-Type": "application/json"}


async def _lean_clients(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The headline load: the OpenAI JSON bodies over aiohttp (else httpx), one connection each."""
    import orjson

    try:
        import aiohttp
    except ImportError:
        aiohttp = None
    if aiohttp is not None:
        clients = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), headers=_headers(i),
                                         timeout=aiohttp.ClientTimeout(total=600)) for i in range(args.sessions)]

        async def send(i: int, body: dict[str, Any]) -> Any:
            async with clients[i].post(f"{url}/chat/completions", data=orjson.dumps(body)) as r:
                data = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
                return orjson.loads(data)

        async def warm(i: int) -> None:
            async with clients[i].get(f"{url}/models") as r:
                await r.read()

        name = f"aiohttp {aiohttp.__version__}"
    else:
        import httpx

        clients = [httpx.AsyncClient(headers=_headers(i), timeout=600, limits=httpx.Limits(max_connections=1))
                   for i in range(args.sessions)]

        async def send(i: int, body: dict[str, Any]) -> Any:
            r = await clients[i].post(f"{url}/chat/completions", content=orjson.dumps(body))
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.content[:200]!r}")
            return orjson.loads(r.content)

        async def warm(i: int) -> None:
            await clients[i].get(f"{url}/models")

        name = f"httpx {httpx.__version__}"
    try:
        await asyncio.gather(*(warm(i) for i in range(args.sessions)))  # connect outside the timing
        return await _load(send, args, name)
    finally:
        closing = [c.close() if aiohttp is not None else c.aclose() for c in clients]
        await asyncio.gather(*closing)


async def _openai_clients(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The same load through the official ``openai`` client, one client (and connection) each."""
    import httpx
    import openai

    clients = [openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0,
                                  default_headers={"X-Session-ID": f"s{i}"},
                                  http_client=httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1)))
               for i in range(args.sessions)]

    async def send(i: int, body: dict[str, Any]) -> Any:
        r = await clients[i].chat.completions.create(**body)
        return {"usage": {"completion_tokens": r.usage.completion_tokens},
                "choices": [{"message": r.choices[0].message.model_dump(exclude_none=True)}]}

    await asyncio.gather(*(c.models.list() for c in clients))  # connections and client warm-up
    try:
        return await _load(send, args, f"openai {openai.__version__}")
    finally:
        await asyncio.gather(*(c.close() for c in clients))


_CLIENTS = {"lean": _lean_clients, "openai": _openai_clients}


async def _endpoint(chat: Any, sampler: Any, args: argparse.Namespace, kind: str = "lean") -> dict[str, float]:

    import uvicorn

    from mixrl.serve.app import loopback_socket, make_app, server_options
    from mixrl.serve.core import ServeCore

    async def generate(session: str, request: Any) -> Any:
        return await sampler.generate(request)

    core = ServeCore(chat, generate, model="policy", max_total_tokens=4096, default_max_tokens=args.max_tokens)
    await core.chat_completion({"messages": [{"role": "user", "content": "warm-up"}], "max_tokens": 1}, None)
    sock = loopback_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(core, api_key="bench"), host="127.0.0.1", port=port,
                                           lifespan="off", timeout_keep_alive=300,  # connected before the timing
                                           **server_options()))
    server.install_signal_handlers = lambda: None
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{port}/v1"
    marks: list[tuple[Any, ...]] = []  # (CPU, batches, steps, engine CPU) when the timed load began and ended

    async def mark() -> None:
        marks.append((time.process_time(), *await _counts(sampler)))

    try:
        if args.client_in_process:
            out = await _CLIENTS[kind](url, argparse.Namespace(**{**vars(args), "ready": mark,
                                                                  "report": lambda _: mark()}))
        else:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mixrl.lab.bench.serve", "--client", url, "--client-kind", kind,
                "--sessions", str(args.sessions),
                "--turns", str(args.turns), "--max-tokens", str(args.max_tokens),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            assert proc.stdin is not None and proc.stdout is not None
            if (await proc.stdout.readline()).strip() == b"ready":  # connected and warmed up
                await mark()
                proc.stdin.write(b"go\n")
                await proc.stdin.drain()
                line = await proc.stdout.readline()
                await mark()
            if await proc.wait() or len(marks) != 2:
                raise RuntimeError(f"the client process exited with {proc.returncode}")
            out = json.loads(line)
        # this process over the timed load (engine and HTTP server; not the server's start, the
        # clients' connections and warm-up, or their close)
        (cpu0, b0, s0, e0), (cpu1, b1, s1, e1) = marks
        out["serve_cpu_s"] = round(cpu1 - cpu0, 3)
        out["engine_batches"], out["engine_steps"] = b1 - b0, s1 - s0
        if e0 is not None:  # a worker process: its CPU apart (None: the engine runs in this process)
            out["engine_cpu_s"] = round(e1 - e0, 3)
        out["history_rewrites"] = core.sessions.history_rewrites
        out["client"] += ", in-process" if args.client_in_process else ", separate process"
        return out
    finally:
        server.should_exit = True
        await task


async def _counts(sampler: Any) -> tuple[int, int, float | None]:
    """(prefills, decode steps, the engine's CPU seconds) so far: a worker process asked over
    its pipe, an in-process ``BatchingSampler`` read directly (CPU None: it is this process's)."""
    if hasattr(sampler, "stats"):
        st = await sampler.stats()
        return int(st["prefills"]), int(st["steps"]), float(st["cpu_s"])
    return sampler.batches, sampler.steps, None


async def _workload(model: str, max_tokens: int, repeats: int, args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from transformers import AutoTokenizer

    from mixrl.models.chat import ChatFormat
    from mixrl.models.loading import resolve_model
    from mixrl.sampling.batching import BatchingSampler
    from mixrl.sampling.factory import make_engine
    from mixrl.system.heap import settle_heap

    args = argparse.Namespace(**{**vars(args), "max_tokens": max_tokens, "repeats": repeats})
    with tempfile.TemporaryDirectory() as tmp:
        path = random_model(model, tmp) if model.startswith("random:") else str(resolve_model(model))
        chat = ChatFormat(AutoTokenizer.from_pretrained(path))
        n_params = sum(int(v.numel()) for v in _weights(path).values())
        batching = {"max_batch": args.sessions, "max_wait_ms": args.max_wait_ms, "idle_ms": args.idle_ms}
        sampler: Any
        if args.workers == "process":  # as in a run and ``mixrl serve``: the engine in a worker process
            from mixrl.runtime.backends.embedded.process import ProcessSampler

            sampler = ProcessSampler("bench/0", args.profile)
            await sampler.start(path, args.profile, 0, args.threads or (os.cpu_count() or 1), batching=batching)
        else:
            engine = make_engine(path, args.profile, args.profile, seed=0, max_batch=args.sessions,
                                 num_threads=args.threads or None)
            sampler = BatchingSampler(engine, **batching)
    await _direct(chat, sampler, argparse.Namespace(**{**vars(args), "sessions": 4, "turns": 1}))  # warm-up
    settle_heap()  # as ``mixrl serve`` does once started, before every arm
    arms: list[tuple[str, Any]] = [("direct", _direct), ("endpoint", _endpoint)]
    if not args.no_openai:
        arms.append(("openai_client", functools.partial(_endpoint, kind="openai")))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in arms}
    load = [round(os.getloadavg()[0], 2)]
    for _ in range(args.repeats):  # interleaved: a change of load hits every arm alike
        for name, arm in arms:
            # batches (prefills) and decode steps: how well concurrent requests were gathered
            (before, steps, eng), cpu = await _counts(sampler), time.process_time()
            out = await arm(chat, sampler, args)
            out["process_cpu_s"] = round(time.process_time() - cpu, 3)  # this process: server, asyncio (+ engine)
            after = await _counts(sampler)
            out.setdefault("engine_batches", after[0] - before)
            out.setdefault("engine_steps", after[1] - steps)
            if eng is not None:
                out.setdefault("engine_cpu_s", round(after[2] - eng, 3))
            runs[name].append(out)
    load.append(round(os.getloadavg()[0], 2))
    await sampler.close()
    med = {name: round_medians(rs) for name, rs in runs.items()}
    direct, endpoint = med["direct"], med["endpoint"]
    n_req = args.sessions * args.turns

    def server_ms(arm: dict[str, Any]) -> float:  # this process's CPU beyond the direct arm's, per request
        return round((arm["serve_cpu_s"] - direct["process_cpu_s"]) / n_req * 1e3, 2)

    pairs = [round(e["tokens_per_s"] / d["tokens_per_s"], 3) for d, e in zip(runs["direct"], runs["endpoint"],
                                                                               strict=True)]
    res: dict[str, Any] = {
        "endpoint_over_direct": round(endpoint["tokens_per_s"] / direct["tokens_per_s"], 3),
        # each round's endpoint over the direct arm just before it, and their median: a machine
        # whose speed drifts during the run moves the medians of the arms apart, not these
        "pair_ratios": pairs, "pair_ratio_median": statistics.median(pairs),
        # distribution-free interval of that median (order statistics, mixrl.lab.bench.stats): [lo, hi, coverage]
        "pair_ratio_ci95": median_interval(pairs),
        "server_cpu_ms_per_request": server_ms(endpoint),
        # the worker's CPU with requests over HTTP over its CPU on the direct arm's load
        "engine_cpu_over_direct": (round(endpoint["engine_cpu_s"] / direct["engine_cpu_s"], 3)
                                   if "engine_cpu_s" in direct else None),
        "requests_over_direct": round(endpoint["requests_per_s"] / direct["requests_per_s"], 3),
        "client": runs["endpoint"][0]["client"], "client_cpu_ms_per_request": endpoint["client_cpu_ms_per_request"],
        "repeats": args.repeats, "load_avg_1m": load,
        "model": model, "model_params": n_params, "max_tokens": max_tokens,
        "mean_reply_tokens": endpoint["mean_reply_tokens"],
        "same_tokens": len({r["generated_tokens"] for rs in runs.values() for r in rs}) == 1,
        "sessions": args.sessions, "turns": args.turns, "profile": args.profile, "workers": args.workers,
        "max_wait_ms": args.max_wait_ms, "idle_ms": args.idle_ms}
    if "openai_client" in med:
        o = med["openai_client"]
        med["openai_client"] = {"over_direct": round(o["tokens_per_s"] / direct["tokens_per_s"], 3),
                                "client": runs["openai_client"][0]["client"],
                                "server_cpu_ms_per_request": server_ms(o), **o}
    return {**res, **med, "runs": runs}


def _weights(path: str) -> dict[str, Any]:
    from pathlib import Path

    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    res = await _workload(args.model, args.max_tokens, args.repeats, args)
    if args.long_model != "none":
        res["long_replies"] = await _workload(args.long_model, args.long_max_tokens, args.long_repeats, args)
    return res


def main(args: argparse.Namespace) -> int:
    if args.client:  # the endpoint arm's client process
        from mixrl.serve.app import loop_runner

        async def ready() -> None:  # tell the server, wait for its go
            print("ready", flush=True)
            await asyncio.to_thread(sys.stdin.readline)

        args.ready, args.report = ready, lambda out: print(json.dumps(out), flush=True)
        loop_runner()(_CLIENTS[args.client_kind](args.client, args))
        return 0
    for name in ("sessions", "turns", "max_tokens", "long_max_tokens", "repeats", "long_repeats"):
        if getattr(args, name) < 1:
            print(f"mixrl bench serve: --{name.replace('_', '-')} must be >= 1", flush=True, file=sys.stderr)
            return 2
    if args.hostile:
        return serve_hostile.main(args)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.idle_ms is not None and args.idle_ms < 0 or args.max_wait_ms < 0:
        print("mixrl bench serve: --max-wait-ms and --idle-ms must be >= 0", flush=True, file=sys.stderr)
        return 2
    try:
        for spec in (args.model, args.long_model):
            if spec.startswith("random:"):
                shape(spec)
        from mixrl.serve.app import loop_runner

        res = loop_runner()(_run(args))  # the event loop ``mixrl serve`` runs on, for both arms
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


if __name__ == "__main__":
    _p = argparse.ArgumentParser()
    configure(_p)
    raise SystemExit(main(_p.parse_args()))
