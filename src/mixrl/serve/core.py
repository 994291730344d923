"""The endpoint's logic, apart from HTTP: OpenAI request bodies in, response bodies out.

``ServeCore`` turns a chat or completion request into one ``GenerationRequest``
per choice, sends it through ``generate(session, request)`` (the fleet's
router: every request of a session is pinned to one sampler group), records
the result in the session (``SessionStore``), and answers in OpenAI's shapes.

Sampling parameters map one to one (``temperature``, ``top_p``, ``max_tokens``
/ ``max_completion_tokens``, ``seed``); ``temperature = 0`` is greedy (top-k 1:
the recorded behaviour log-prob is then 0, exactly the distribution sampled
from). ``stop`` strings end a reply at the first token that completes one; the
tokens kept are recorded, those after it are not. A session is named by the
``X-Session-ID`` header or the body's ``user`` field; a request without one is
a session of its own.

Sessions are bounded (``session_ttl`` seconds unused, ``max_sessions`` least recently
used, ``session_bytes`` in all and ``session_max_bytes`` each: ``SessionStore``), the
template cache too (``frame_bytes``), a chat request whose text (contents, ``tools``,
names, tool calls) the context cannot hold is refused before it is rendered, and a failed request (context too long, a bad parameter,
the sampler failed) leaves no session holding no reply behind, except sessions whose
lifetime the caller manages (``owned``: an in-run endpoint's episodes). A request whose
body is large (``heavy``) is templated and tokenized in a worker thread, so the event
loop keeps answering other requests meanwhile. With a ``gate`` (``fair.FairGate``) each
choice waits for its client's turn at a slot of the fleet (``client``: who sent it).

Candidates of q recorded with each token (``record``): ``"auto"`` (the default)
records the whole top-p support when ``top_p < 1`` and the 64 most likely tokens
at ``top_p = 1``, as a run does; an in-run endpoint passes the run's own choice.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from mixrl.config.presets import HEAD_K  # what a run records at top_p = 1 (config.schema.derive)
from mixrl.models.chat import ChatFormat
from mixrl.records.generation import GenerationRequest, GenerationResult, SamplingParams
from mixrl.records.trajectory import Trajectory
from mixrl.serve import toolcalls
from mixrl.serve.bounds import MIB, request_chars
from mixrl.serve.conversation import FRAME_BYTES, SessionStore, content_chars
from mixrl.serve.fair import FairGate, QueueFull
from mixrl.serve.stops import cut

Generate = Callable[[str, GenerationRequest], Awaitable[GenerationResult]]
# (session, the request's parameters) -> the parameters really used (an in-run endpoint
# imposes the run's temperature, top-p and candidate recording); recorded per result.
Adapt = Callable[[str, SamplingParams], SamplingParams]
SESSION_TTL_S, MAX_SESSIONS = 3600.0, 4096  # the defaults of ``mixrl serve``
SESSION_BYTES, SESSION_MAX_BYTES = 256 * MIB, 32 * MIB  # its sessions' bytes in all, and each


def record_for(top_p: float) -> str:
    """The ``record`` of ``"auto"``: the whole support under top-p truncation, else the
    ``HEAD_K`` most likely tokens (the support at top_p = 1 is the whole vocabulary: 150k
    candidates a token for a real model's tokenizer)."""
    return "support" if top_p < 1 else f"head:{HEAD_K}"


class ApiError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ApiError(400, f"{key} must be a number in [{lo}, {hi}], got {v!r}", param=key)
    return float(v)


class ServeCore:
    def __init__(self, chat: ChatFormat, generate: Generate, *, model: str, max_total_tokens: int,
                 default_max_tokens: int = 256, record: str = "auto", tool_parser: str = "auto",
                 adapt: Adapt | None = None, session_ttl: float | None = SESSION_TTL_S,
                 max_sessions: int | None = MAX_SESSIONS, owned: Callable[[str], bool] | None = None,
                 session_bytes: int | None = SESSION_BYTES, session_max_bytes: int | None = SESSION_MAX_BYTES,
                 frame_bytes: int = FRAME_BYTES, gate: FairGate | None = None) -> None:
        self.chat, self.generate, self.model = chat, generate, model
        self.adapt, self.owned, self.gate = adapt, owned, gate
        self.max_total_tokens, self.default_max_tokens = max_total_tokens, default_max_tokens
        self.record, self.tool_parser = record, tool_parser
        self.sessions = SessionStore(chat, ttl=session_ttl, max_sessions=max_sessions, max_bytes=session_bytes,
                                     max_session_bytes=session_max_bytes, frame_bytes=frame_bytes)
        self.stop_ids = chat.stop_ids  # a property that builds its tuple on every read
        # the longest token's text (its vocabulary string: a byte-level token's string has a character
        # per byte): text longer than the context times this cannot fit, and is refused untokenized
        self.token_chars = max(1, max(map(len, chat.tokenizer.get_vocab()), default=1))
        self.counts = {"requests": 0, "errors": 0, "generated_tokens": 0}
        # response ids: unique per server (a random prefix, then a counter), without a
        # system call per request as uuid4 makes
        prefix = os.urandom(6).hex()
        self._ids = (f"{prefix}{i:012x}" for i in itertools.count())

    # -- parameters ------------------------------------------------------------------
    def _params(self, body: dict[str, Any], prompt_len: int, st: Any = None) -> tuple[SamplingParams, int, list[str]]:
        n = body.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 16:
            raise ApiError(400, f"n must be an integer in [1, 16], got {n!r}", param="n")
        temperature = _num(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _num(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0:
            raise ApiError(400, "top_p must be > 0", param="top_p")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = int(_num(body, key, self.default_max_tokens, 1, 1 << 20))
        room = self.max_total_tokens - prompt_len
        if room < 1:
            if st is not None:
                st.truncated = True
            raise ApiError(400, f"the conversation has {prompt_len} tokens; this endpoint's context is "
                                f"{self.max_total_tokens}", param="messages", code="context_length_exceeded")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise ApiError(400, "stop must be a string or a list of up to 4 non-empty strings", param="stop")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ApiError(400, f"seed must be an integer, got {seed!r}", param="seed")
        greedy = temperature == 0
        record = record_for(top_p) if self.record == "auto" else self.record
        params = SamplingParams(temperature=1.0 if greedy else temperature, top_p=top_p, top_k=1 if greedy else 0,
                                max_new_tokens=min(max_tokens, room), stop_ids=self.stop_ids,
                                record=record, seed=None if seed is None else seed & 0xFFFFFFFF)
        return params, n, stop

    def _cut(self, ids: list[int], stop: list[str]) -> tuple[list[int], str, bool]:
        """Ids kept, reply text, and whether a stop string ended it (``stops.cut``: linear)."""
        if not stop:
            return ids, self.chat.reply_text(ids), False
        return cut(ids, stop, self._reply_decode)

    def _reply_decode(self, ids: list[int]) -> str:
        return self.chat.decode(ids, skip_special=True)  # reply_text: stop ids are special tokens

    def _too_long(self, param: str, size: int) -> ApiError:
        """Refused unread: more characters than the context times the longest token, or more ids."""
        return ApiError(400, f"the {param} hold {size} characters or ids: more than this endpoint's context of "
                             f"{self.max_total_tokens} tokens can hold", param=param, code="context_length_exceeded")

    def _logprobs(self, res: GenerationResult, ids: list[int], top: int) -> dict[str, Any]:
        content = []
        for j, tok in enumerate(ids):
            a, b = res.cand_offsets[j], res.cand_offsets[j + 1]
            cands = sorted(zip(res.cand_logprobs[a:b], res.cand_ids[a:b], strict=True), reverse=True)[:top]
            piece = self.chat.decode([tok])
            content.append({"token": piece, "logprob": res.logprobs[j], "bytes": list(piece.encode()),
                            "top_logprobs": [{"token": self.chat.decode([c]), "logprob": lp,
                                              "bytes": list(self.chat.decode([c]).encode())} for lp, c in cands]})
        return {"content": content}

    async def _choices(self, session: str, base: Trajectory, params: SamplingParams, n: int,
                       client: str = "") -> list[GenerationResult]:
        reqs = [GenerationRequest(list(base.tokens), params if params.seed is None or i == 0 else
                                  SamplingParams(**{**params.__dict__, "seed": (params.seed + i) & 0xFFFFFFFF}),
                                  request_id=f"{session}/{len(base.tokens)}/{i}", session=session) for i in range(n)]
        gate = self.gate
        if gate is None:
            if n == 1:
                results = [await self.generate(session, reqs[0])]
            else:
                results = await asyncio.gather(*(self.generate(session, r) for r in reqs))
        else:  # each choice waits for its client's turn at a slot of the fleet
            try:
                gate.admit(client, n)
            except QueueFull as e:
                raise ApiError(429, f"this client has {e.limit} generations waiting at most; retry once some "
                                    "have finished", type_="rate_limit_error", code="client_queue_full") from None

            async def one(r: GenerationRequest) -> GenerationResult:
                async with gate.slot(client):
                    return await self.generate(session, r)

            results = [await one(reqs[0])] if n == 1 else await asyncio.gather(*map(one, reqs))
        for r in results:
            if r.finish_reason in ("error", "numerical_error", "context_exceeded"):
                raise ApiError(503, f"the sampler failed: {r.finish_reason} {r.error}".strip(),
                               type_="server_error", code="sampler_failed")
        return list(results)

    # -- endpoints ------------------------------------------------------------------------
    def _check_size(self, messages: list[Any], tools: list[Any] | None) -> None:
        """Refuse unencoded a request whose text (contents, tools, names, tool calls) the context
        cannot hold: more characters than the context times the longest token."""
        try:
            tool_chars, extra = request_chars(messages, tools)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        room = self.max_total_tokens * self.token_chars
        if tool_chars > room:
            raise self._too_long("tools", tool_chars)
        chars = content_chars(messages) + extra + tool_chars
        if chars > room:
            raise self._too_long("messages", chars)

    async def chat_completion(self, body: dict[str, Any], session: str | None, heavy: bool = False,
                              client: str = "") -> dict[str, Any]:
        if body.get("stream"):
            raise ApiError(400, "stream=true is not supported by this endpoint", param="stream")
        messages, tools = body.get("messages"), body.get("tools") or None
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of message objects", param="messages")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise ApiError(400, "tools must be a list of tool objects", param="tools")
        parser = "none" if body.get("tool_choice") == "none" else self.tool_parser
        top = body.get("top_logprobs") or 0
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise ApiError(400, f"top_logprobs must be an integer in [0, 20], got {top!r}", param="top_logprobs")
        ephemeral = session is None
        session = session or f"anon-{uuid.uuid4().hex}"
        st = self.sessions.state(session)
        st.pending += 1
        try:
            return await self._chat(body, session, st, ephemeral, messages, tools, parser, top, heavy, client)
        except BaseException:
            alone = st.pending == 1  # no other request of this session is waiting for it
            if alone and (ephemeral or not (st.forks or st.finished
                                            or (self.owned is not None and self.owned(session)))):
                self.sessions.discard(session, st)  # a failed request leaves no empty session behind
            raise
        finally:
            st.pending -= 1

    async def _chat(self, body: dict[str, Any], session: str, st: Any, ephemeral: bool, messages: list[Any],
                    tools: list[Any] | None, parser: str, top: int, heavy: bool, client: str) -> dict[str, Any]:
        async with st.lock:
            try:
                return await self._chat_locked(body, session, st, ephemeral, messages, tools, parser, top, heavy,
                                               client)
            finally:
                self.sessions.account(session, st)  # its bytes counted again, the bounds held

    async def _chat_locked(self, body: dict[str, Any], session: str, st: Any, ephemeral: bool, messages: list[Any],
                           tools: list[Any] | None, parser: str, top: int, heavy: bool,
                           client: str) -> dict[str, Any]:
        try:
            self._check_size(messages, tools)  # before anything is rendered or encoded
        except ApiError as e:
            if e.code == "context_length_exceeded":
                st.truncated = True
            raise
        try:
            if heavy:  # templating and tokenizing a large body: off the event loop
                base = await asyncio.to_thread(self.sessions.prompt, st, session, messages, tools)
            else:
                base = self.sessions.prompt(st, session, messages, tools)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        prompt_len = len(base.tokens)  # before the reply is recorded into base (n = 1)
        params, n, stop = self._params(body, prompt_len, st)
        if self.adapt is not None:
            params = self.adapt(session, params)
        results = await self._choices(session, base, params, n, client)
        choices, recorded = [], []
        for i, res in enumerate(results):
            ids, text, stopped = self._cut(res.token_ids, stop)
            content, calls = toolcalls.parse(text, tools, parser)
            ended = stopped or (bool(ids) and ids[-1] in self.stop_ids)
            message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": i, "message": message,
                      "finish_reason": "tool_calls" if calls else ("stop" if ended else "length"),
                      "logprobs": self._logprobs(res, ids, top) if body.get("logprobs") else None}
            choices.append(choice)
            recorded.append((res, ids, message))
            self.counts["generated_tokens"] += len(ids)
        self.sessions.record(st, base, recorded, params)
        if ephemeral:
            self.sessions.finish(session)
        self.counts["requests"] += 1
        gen = sum(len(r[1]) for r in recorded)
        return {"id": f"chatcmpl-{next(self._ids)}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model, "choices": choices,
                "usage": {"prompt_tokens": prompt_len, "completion_tokens": gen,
                          "total_tokens": prompt_len + gen},
                "mixrl": {"session": None if ephemeral else session, "group": results[0].group,
                          "version": results[0].version, "segment": base.info.get("segment", 0)}}

    async def completion(self, body: dict[str, Any], session: str | None, heavy: bool = False,
                         client: str = "") -> dict[str, Any]:
        if body.get("stream"):
            raise ApiError(400, "stream=true is not supported by this endpoint", param="stream")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > self.max_total_tokens:
            raise self._too_long("prompt", len(prompt))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            vocab = len(self.chat.tokenizer)
            if any(not 0 <= t < vocab for t in ids):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        elif isinstance(prompt, str) and prompt:
            if len(prompt) > self.max_total_tokens * self.token_chars:
                raise self._too_long("prompt", len(prompt))
            ids = await asyncio.to_thread(self.chat.encode, prompt) if heavy else self.chat.encode(prompt)
        else:
            raise ApiError(400, "prompt must be a non-empty string or a list of token ids", param="prompt")
        params, n, stop = self._params(body, len(ids))
        traj = Trajectory(prompt_id=session or "anon", sample_idx=0, task="openai")
        traj.append_env(ids)
        results = await self._choices(session or f"anon-{uuid.uuid4().hex}", traj, params, n, client)
        choices, gen = [], 0
        for i, res in enumerate(results):
            kept, text, stopped = self._cut(res.token_ids, stop)
            gen += len(kept)
            ended = stopped or (bool(kept) and kept[-1] in self.stop_ids)
            choices.append({"index": i, "text": text, "finish_reason": "stop" if ended else "length",
                            "logprobs": None})
        self.counts["requests"] += 1
        self.counts["generated_tokens"] += gen
        return {"id": f"cmpl-{next(self._ids)}", "object": "text_completion", "created": int(time.time()),
                "model": self.model, "choices": choices,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": gen, "total_tokens": len(ids) + gen}}
