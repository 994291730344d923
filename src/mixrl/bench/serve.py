"""The OpenAI-compatible endpoint against calling the sampler directly: ``mixrl bench serve --json``.

Both arms run the same load in one invocation, on the same sampler replica
(built-in engine, FP32 profile by default, one ``BatchingSampler`` with the
same batching window):

- ``direct``: ``--sessions`` concurrent conversations of ``--turns`` turns,
  each turn a ``GenerationRequest`` of the recorded ids (what a mixrl episode
  does);
- ``endpoint``: the same conversations as HTTP requests from the ``openai``
  client to a real uvicorn server on loopback (templating, session recording,
  tool-call parsing and JSON included). The server runs in this process, as
  ``mixrl serve`` does; the agents' client code runs in a second process, as
  agent code beside a server does (``--client-in-process`` puts it here). Each
  conversation has its own client (as each agent episode does), created and
  connected before the timing; its connection is kept alive across turns.

Requests carry the same seeds in both arms, so they sample the same tokens
(``same_tokens`` checks it); ``endpoint_over_direct`` is the ratio of generated
tokens per second (goal >= 0.8 at 64 concurrent sessions), with requests/s,
p50/p99 latency, the CPU time of this process per arm (``serve_cpu_s``: while
the endpoint's clients ran, so without the server's start), the engine's
prefills and decode steps per arm, the client's CPU per request, and
``server_cpu_ms_per_request`` (the endpoint arm's CPU beyond the direct arm's,
per request: HTTP, templating, recording, JSON, and any extra engine work from
requests arriving spread out). Two workloads, each stating its model and reply length:

- the headline: ``--model`` (the shipped bundled policy: replies of a few
  tokens, so per-request HTTP cost weighs most);
- ``long_replies``: ``--long-model`` (default ``random:256x4``, a randomly
  initialised Qwen3 of hidden size 256 and 4 layers on the bundled tokenizer,
  which rarely samples an end of turn) with ``--long-max-tokens`` (64);
  ``--long-model none`` skips it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
from typing import Any


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
    parser.add_argument("--client-in-process", action="store_true",
                        help="run the endpoint arm's client code in this process")
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)  # internal: URL, run the client only
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] * 1e3, 1)


def _summary(wall: float, lat: list[float], tokens: int) -> dict[str, float]:
    return {"wall_s": round(wall, 3), "requests_per_s": round(len(lat) / wall, 2),
            "tokens_per_s": round(tokens / wall, 1), "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99),
            "mean_ms": round(statistics.fmean(lat) * 1e3, 1), "generated_tokens": tokens,
            "mean_reply_tokens": round(tokens / len(lat), 1)}


async def _direct(chat: Any, sampler: Any, args: argparse.Namespace) -> dict[str, float]:
    from mixrl.sampling.base import GenerationRequest, SamplingParams

    lat: list[float] = []
    tokens = 0

    async def conversation(i: int) -> None:
        nonlocal tokens
        ids = chat.prompt(f"What is {i} + {i + 1}?")
        for t in range(args.turns):
            params = SamplingParams(max_new_tokens=args.max_tokens, stop_ids=chat.stop_ids, seed=i * 100 + t)
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
    return _summary(time.perf_counter() - t0, lat, tokens)


async def _clients(url: str, args: argparse.Namespace) -> dict[str, float]:
    """The endpoint arm's load: ``--sessions`` conversations, each through its own ``openai`` client."""
    import httpx
    import openai

    clients = [openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0,
                                  default_headers={"X-Session-ID": f"s{i}"},
                                  http_client=httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1)))
               for i in range(args.sessions)]
    lat: list[float] = []
    tokens = 0

    async def conversation(i: int) -> None:
        nonlocal tokens
        msgs: list[dict[str, Any]] = [{"role": "user", "content": f"What is {i} + {i + 1}?"}]
        for t in range(args.turns):
            t0 = time.perf_counter()
            r = await clients[i].chat.completions.create(model="policy", messages=msgs, max_tokens=args.max_tokens,
                                                         seed=i * 100 + t)
            lat.append(time.perf_counter() - t0)
            tokens += r.usage.completion_tokens
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And then?"}]

    # connections and client warm-up, outside the timing (keep-alive holds them across turns)
    await asyncio.gather(*(c.models.list() for c in clients))
    try:
        cpu, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(conversation(i) for i in range(args.sessions)))
        out = _summary(time.perf_counter() - t0, lat, tokens)
        out["client_cpu_ms_per_request"] = round((time.process_time() - cpu) / len(lat) * 1e3, 2)
        return out
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def _endpoint(chat: Any, sampler: Any, args: argparse.Namespace) -> dict[str, float]:
    import sys

    import uvicorn

    from mixrl.serve.app import make_app
    from mixrl.serve.core import ServeCore

    async def generate(session: str, request: Any) -> Any:
        return await sampler.generate(request)

    core = ServeCore(chat, generate, model="policy", max_total_tokens=4096, default_max_tokens=args.max_tokens)
    await core.chat_completion({"messages": [{"role": "user", "content": "warm-up"}], "max_tokens": 1}, None)
    before = sampler.batches
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(core, api_key="bench"), host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False, lifespan="off",
                                           timeout_keep_alive=300))  # the clients connect before the timing
    server.install_signal_handlers = lambda: None
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{port}/v1"
    steps, cpu = sampler.steps, time.process_time()
    try:
        if args.client_in_process:
            out = await _clients(url, args)
        else:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mixrl.bench.serve", "--client", url, "--sessions", str(args.sessions),
                "--turns", str(args.turns), "--max-tokens", str(args.max_tokens),
                stdout=asyncio.subprocess.PIPE)
            stdout, _ = await proc.communicate()
            if proc.returncode:
                raise RuntimeError(f"the client process exited with {proc.returncode}")
            out = json.loads(stdout.decode().strip().splitlines()[-1])
        # this process while the clients ran (engine and HTTP server; not the server's start)
        out["serve_cpu_s"] = round(time.process_time() - cpu, 3)
        out["engine_batches"] = sampler.batches - before  # the warm-up request not counted
        out["engine_steps"] = sampler.steps - steps
        out["history_rewrites"] = core.sessions.history_rewrites
        out["client"] = "in-process" if args.client_in_process else "separate process"
        return out
    finally:
        server.should_exit = True
        await task


def _shape(spec: str) -> tuple[int, int]:
    """(hidden, layers) of ``random:HIDDENxLAYERS``; ValueError naming the flag otherwise."""
    try:
        hidden, layers = (int(x) for x in spec.split(":", 1)[1].lower().split("x"))
    except ValueError:
        raise ValueError(f"--model/--long-model {spec!r}: expected random:HIDDENxLAYERS, e.g. random:256x4") from None
    if hidden < 32 or hidden % 32 or not 1 <= layers <= 64:
        raise ValueError(f"--model/--long-model {spec!r}: HIDDEN must be a multiple of 32, LAYERS in [1, 64]")
    return hidden, layers


def _random_model(spec: str, into: str) -> str:
    """``random:HIDDENxLAYERS``: a randomly initialised Qwen3 on the bundled tokenizer, saved in ``into``."""
    import torch
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import qwen3_config
    from mixrl.models.tokenizer import save_tokenizer

    hidden, layers = _shape(spec)
    tok = save_tokenizer(into)
    torch.manual_seed(0)
    cfg = qwen3_config(len(tok), layers=layers, hidden=hidden, heads=hidden // 32, kv_heads=1,
                       intermediate=3 * hidden, max_positions=1024, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(into)
    return into


async def _workload(model: str, max_tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from transformers import AutoTokenizer

    from mixrl.envs.chat import ChatFormat
    from mixrl.models.loading import resolve_model
    from mixrl.sampling.batching import BatchingSampler
    from mixrl.sampling.factory import make_engine

    args = argparse.Namespace(**{**vars(args), "max_tokens": max_tokens})
    with tempfile.TemporaryDirectory() as tmp:
        path = _random_model(model, tmp) if model.startswith("random:") else str(resolve_model(model))
        chat = ChatFormat(AutoTokenizer.from_pretrained(path))
        engine = make_engine(path, args.profile, args.profile, seed=0, max_batch=args.sessions,
                             num_threads=args.threads or None)
        n_params = sum(int(v.numel()) for v in _weights(path).values())
    sampler = BatchingSampler(engine, max_batch=args.sessions, max_wait_ms=args.max_wait_ms, idle_ms=args.idle_ms)
    await _direct(chat, sampler, argparse.Namespace(**{**vars(args), "sessions": 4, "turns": 1}))  # warm-up
    arms = {}
    for name, arm in (("direct", _direct), ("endpoint", _endpoint), ("direct_again", _direct)):
        # batches (prefills) and decode steps: how well concurrent requests were gathered
        before, steps, cpu = sampler.batches, sampler.steps, time.process_time()
        arms[name] = await arm(chat, sampler, args)
        arms[name].setdefault("engine_batches", sampler.batches - before)
        arms[name].setdefault("engine_steps", sampler.steps - steps)
        arms[name]["process_cpu_s"] = round(time.process_time() - cpu, 3)  # this process: engine, server, asyncio
    direct, endpoint, direct2 = arms["direct"], arms["endpoint"], arms["direct_again"]
    await sampler.close()
    best = max(direct["tokens_per_s"], direct2["tokens_per_s"])
    n_req = args.sessions * args.turns
    # the server's own CPU per request: the endpoint arm's CPU here beyond the direct arm's
    extra = (endpoint["serve_cpu_s"] - min(direct["process_cpu_s"], direct2["process_cpu_s"])) / n_req
    return {"endpoint_over_direct": round(endpoint["tokens_per_s"] / best, 3),
            "server_cpu_ms_per_request": round(extra * 1e3, 2),
            "requests_over_direct": round(endpoint["requests_per_s"] / max(direct["requests_per_s"],
                                                                           direct2["requests_per_s"]), 3),
            "model": model, "model_params": n_params, "max_tokens": max_tokens,
            "mean_reply_tokens": endpoint["mean_reply_tokens"],
            "same_tokens": direct["generated_tokens"] == endpoint["generated_tokens"] == direct2["generated_tokens"],
            "sessions": args.sessions, "turns": args.turns, "profile": args.profile,
            "max_wait_ms": args.max_wait_ms, "idle_ms": args.idle_ms,
            "direct": direct, "direct_again": direct2, "endpoint": endpoint}


def _weights(path: str) -> dict[str, Any]:
    from pathlib import Path

    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    res = await _workload(args.model, args.max_tokens, args)
    if args.long_model != "none":
        res["long_replies"] = await _workload(args.long_model, args.long_max_tokens, args)
    return res


def main(args: argparse.Namespace) -> int:
    if args.client:  # the endpoint arm's client process
        print(json.dumps(asyncio.run(_clients(args.client, args))))
        return 0
    for name in ("sessions", "turns", "max_tokens", "long_max_tokens"):
        if getattr(args, name) < 1:
            print(f"mixrl bench serve: --{name.replace('_', '-')} must be >= 1", flush=True)
            return 2
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.idle_ms is not None and args.idle_ms < 0 or args.max_wait_ms < 0:
        print("mixrl bench serve: --max-wait-ms and --idle-ms must be >= 0", flush=True)
        return 2
    try:
        for spec in (args.model, args.long_model):
            if spec.startswith("random:"):
                _shape(spec)
        from mixrl.serve.cli import _loop_runner

        res = _loop_runner()(_run(args))  # the event loop ``mixrl serve`` runs on, for both arms
    except ValueError as e:
        if not str(e).startswith("--"):
            raise
        print(f"mixrl bench serve: {e}", flush=True)
        return 2
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:24s} {v}")
    return 0


if __name__ == "__main__":
    _p = argparse.ArgumentParser()
    configure(_p)
    raise SystemExit(main(_p.parse_args()))
