"""Sessions of an OpenAI-style chat, recorded as exact token ids.

A session (one agent episode) sends its whole conversation on every request.
The server keeps what it already encoded and generated for that session, so a
request whose messages *extend* the recorded ones is encoded as exactly

    recorded tokens (prompt, replies as generated)  +  ids of the new messages + assistant header

where the new messages are rendered with the tokenizer's own template as the
difference between a conversation with and without them (``ChatFormat``'s
rule: cut after the last assistant reply's end-of-turn token). The agent's copy
of an earlier reply is never re-tokenized: it only has to *match* what the
server returned (content and tool calls), so the recorded ids stand for it.

A request that does not extend the record (the agent edited or dropped its
past, changed its tools, or asks again at the same point) starts a new
*segment*: the conversation is rendered from scratch as prompt tokens (loss
mask 0) and ``history_rewrites`` is counted. A segment never mixes
re-tokenized text into recorded replies.

Worked example (session "s", n = 1)::

    request 1  [user "2+3?"]                      -> segment 0: prompt P1, reply R1
    request 2  [user, assistant R1, tool "5"]     -> extends: P1 R1 T2 (T2 = tool turn + header), reply R2
    request 3  [user "2+3?" edited, ...]          -> rewrite: segment 1 from scratch, history_rewrites = 1
    finish("s")                                    -> the trajectory of the last segment (+ earlier ones, counted)

With ``n > 1`` each choice is a fork of the record; the next request continues
the fork whose reply it carries.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mixrl.models.chat import ChatFormat
from mixrl.models.untrusted import encode_untrusted
from mixrl.records.generation import GenerationResult
from mixrl.records.trajectory import Trajectory
from mixrl.serve.bounds import ENTRY_BYTES, ITEM_BYTES, MIB, ByteLRU, norm_bytes, traj_bytes

# Private-use characters no template or text contains: message contents are located in the
# rendered text through them and encoded apart, as untrusted text (a tool result that
# prints "<|im_end|>" stays text), while the template's own text becomes special ids.
SENTINEL = "\ue010{}\ue011"
FILLER_USER, FILLER_REPLY = "\ue012", "\ue013"
FRAME_BYTES = 32 * MIB  # the template cache's default bound


def _render(chat: ChatFormat, messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
    try:
        return str(chat.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False, chat_template=chat.template))
    except Exception as e:  # a template that cannot render these roles or fields
        raise ValueError(f"the chat template failed on roles {[m['role'] for m in messages]}: {e}") from e


def _frame(chat: ChatFormat, text: str, n: int) -> list[list[int]]:
    """Rendered ``text`` with sentinels 0..n-1 -> the ids of the template text around them."""
    pieces: list[list[int]] = []
    for i in range(n):
        mark = SENTINEL.format(i)
        if text.count(mark) != 1:
            raise ValueError(f"the chat template does not write message contents verbatim (content {i})")
        before, text = text.split(mark)
        pieces.append(chat.encode(before))
    return pieces + [chat.encode(text)]


def _join(frame: list[list[int]], contents: list[str], encode: Any) -> list[int]:
    """Template ids as trusted text, each content between them as untrusted text."""
    out = list(frame[0])
    for content, after in zip(contents, frame[1:], strict=True):
        out += encode(content) + after
    return out


class Frames:
    """Encoded template text per conversation *shape* (roles, names, tool calls, tools; contents
    replaced by sentinels): a template writes contents verbatim, so the text around them does
    not depend on them, and rendering and encoding it once per shape gives the same ids as
    every time. A template that reads the clock (``strftime_now``) is rendered every time.
    Contents seen before (system prompts, repeated turns) keep their untrusted encoding too.
    Both caches are least-recently-used, bounded in entries (``size`` each) and bytes
    (``max_bytes`` in all, half each: ``bounds.ByteLRU``, which keeps no entry over an
    eighth of its bound, so a request of a rare large shape never flushes them)."""

    def __init__(self, chat: ChatFormat, size: int = 4096, max_bytes: int = FRAME_BYTES) -> None:
        self.chat, self.size = chat, size
        self.enabled = size > 0 and "strftime" not in str(chat.template) and "now(" not in str(chat.template)
        self._cache = ByteLRU(max_bytes // 2, size)
        self._texts = ByteLRU(max_bytes // 2, size)

    @property
    def bytes(self) -> int:
        return self._cache.bytes + self._texts.bytes

    def _untrusted(self, content: str) -> list[int]:
        ids = self._texts.get(content)
        if ids is None:
            ids = encode_untrusted(self.chat.tokenizer, content)
            if self.enabled and len(content) <= 1024:
                self._texts.put(content, ids, ENTRY_BYTES + len(content) + ITEM_BYTES * len(ids))
        return ids

    def ids(self, kind: str, msgs: list[dict[str, Any]], tools: list[Any] | None, contents: list[str],
            render: Any) -> list[int]:
        key = json.dumps([kind, msgs, tools], sort_keys=True, default=str) if self.enabled else None
        frame = self._cache.get(key) if key is not None else None
        if frame is None:
            frame = _frame(self.chat, render(), len(contents))
            if key is not None:
                self._cache.put(key, frame, frame_bytes(key, frame))
        return _join(frame, contents, self._untrusted)


def frame_bytes(key: str, frame: list[list[int]]) -> int:
    """A cached frame's bytes: its key (ASCII JSON), its pieces of ids."""
    return ENTRY_BYTES + len(key) + sum(ENTRY_BYTES + ITEM_BYTES * len(p) for p in frame)


def _text(content: Any) -> str:
    """OpenAI content (a string, None, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise ValueError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def content_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the messages' contents: their tokens are at least this over the longest token's length."""
    n = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(str(p.get("text", ""))) for p in content if isinstance(p, dict))
    return n


def _args(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def normalize(message: dict[str, Any]) -> tuple:
    """What must match for a message to stand for a recorded one (role, text, calls, ids)."""
    calls = tuple((c.get("function", {}).get("name"), json.dumps(_args(c.get("function", {}).get("arguments")),
                                                                   sort_keys=True))
                  for c in message.get("tool_calls") or ())
    return (message.get("role"), _text(message.get("content")).strip(), calls, message.get("tool_call_id") or "")


def template_messages(messages: list[dict[str, Any]], contents: list[str]) -> list[dict[str, Any]]:
    """Copies of ``messages`` with each content replaced by a sentinel (collected in ``contents``)."""
    out = []
    for m in messages:
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"message role must be system, user, assistant or tool, got {m.get('role')!r}")
        t = {k: v for k, v in m.items() if k in ("role", "name", "tool_call_id")}
        text = _text(m.get("content"))
        if text:
            t["content"] = SENTINEL.format(len(contents))
            contents.append(text)
        else:
            t["content"] = ""
        if m.get("tool_calls"):
            t["tool_calls"] = [{"type": "function", "id": c.get("id"),
                                "function": {"name": c["function"]["name"],
                                             "arguments": _args(c["function"].get("arguments"))}}
                               for c in m["tool_calls"]]
        out.append(t)
    return out


def render_ids(chat: ChatFormat, messages: list[dict[str, Any]], tools: list[Any] | None,
               frames: Frames | None = None) -> list[int]:
    """A whole conversation plus the assistant header (a new segment's prompt)."""
    contents: list[str] = []
    msgs = template_messages(messages, contents)
    return (frames or Frames(chat, 0)).ids("prompt", msgs, tools, contents, lambda: _render(chat, msgs, tools))


def continuation_ids(chat: ChatFormat, new: list[dict[str, Any]], tools: list[Any] | None,
                     frames: Frames | None = None) -> list[int]:
    """Ids of ``new`` messages after an assistant reply's end-of-turn token, plus the header."""
    contents: list[str] = []
    msgs = template_messages(new, contents)

    def render() -> str:
        history = [{"role": "user", "content": FILLER_USER}, {"role": "assistant", "content": FILLER_REPLY}]
        full = _render(chat, history + msgs, tools)
        cut = full.index(FILLER_REPLY) + len(FILLER_REPLY)
        eot = chat.decode([chat.end_of_turn_id])
        if full.startswith(eot, cut):  # the generated reply already holds that token
            cut += len(eot)
        return full[cut:]

    return (frames or Frames(chat, 0)).ids("after", msgs, tools, contents, render)


def _clone(traj: Trajectory) -> Trajectory:
    """A copy whose lists can grow apart (fields hold primitives: no deep copy needed)."""
    return Trajectory(**{k: list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
                         for k, v in vars(traj).items()})


@dataclass
class Fork:
    traj: Trajectory  # the record up to and including this choice's reply
    reply: tuple  # normalize() of the assistant message returned for it


@dataclass
class SessionState:
    prefix: list[tuple] = field(default_factory=list)  # normalized messages before the last reply
    tools_key: str = ""
    forks: list[Fork] = field(default_factory=list)
    finished: list[Trajectory] = field(default_factory=list)  # earlier segments
    truncated: bool = False  # a request outgrew the context budget (the model was too long)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    used: float = 0.0  # the clock when a request last named it
    pending: int = 0  # requests naming it that have not finished (waiting for its lock or holding it)
    nbytes: int = 0  # what it holds, as last counted (``state_bytes``)
    dropped: int = 0  # earlier segments dropped to keep it within its byte bound


def state_bytes(st: SessionState) -> int:
    """A session's bytes: its segments, forks and the normalized messages it compares against."""
    return (ENTRY_BYTES + len(st.tools_key) + sum(norm_bytes(m) for m in st.prefix)
            + sum(traj_bytes(f.traj) + norm_bytes(f.reply) for f in st.forks)
            + sum(traj_bytes(t) for t in st.finished))


class SessionStore:
    """Session id -> recorded segments; counts ``history_rewrites``.

    Bounded when asked: a session no request named for ``ttl`` seconds expires, and a new
    session beyond ``max_sessions`` makes the least recently used one go (``evicted`` counts
    both; a request naming it later starts a new segment). In bytes (``state_bytes``, counted
    after each request: ``account``): a session past ``max_session_bytes`` drops its earliest
    segments (``SessionState.dropped``), and the whole session if its current record alone is
    past it; past ``max_bytes`` in all, the least recently used sessions go. A session with a
    request in flight (its lock held) is never dropped. None: unbounded (an in-run endpoint,
    whose episodes finish their sessions). Sessions are kept in order of last use, so the
    checks look at the oldest only: O(1) per request.
    """

    def __init__(self, chat: ChatFormat, ttl: float | None = None, max_sessions: int | None = None,
                 clock: Callable[[], float] = time.monotonic, max_bytes: int | None = None,
                 max_session_bytes: int | None = None, frame_bytes: int = FRAME_BYTES) -> None:
        self.chat, self.ttl, self.max_sessions, self.clock = chat, ttl, max_sessions, clock
        self.max_bytes, self.max_session_bytes = max_bytes, max_session_bytes
        self.frames = Frames(chat, max_bytes=frame_bytes)
        self.sessions: OrderedDict[str, SessionState] = OrderedDict()
        self.history_rewrites = self.evicted = self.bytes = 0

    def state(self, session: str) -> SessionState:
        now = self.clock()
        st = self.sessions.get(session)
        if st is None:  # not setdefault: that builds a state (and its lock) on every request
            self._sweep(now, room=1)
            st = self.sessions[session] = SessionState()
        else:
            self.sessions.move_to_end(session)
            if self.ttl is not None:
                self._sweep(now, room=0)
        st.used = now
        return st

    def _drop(self, session: str) -> SessionState | None:
        st = self.sessions.pop(session, None)
        if st is not None:
            self.bytes -= st.nbytes
        return st

    def discard(self, session: str, st: SessionState) -> None:
        """Forget a session (a request that created it failed), if ``st`` is still its state."""
        if self.sessions.get(session) is st:
            self._drop(session)

    def account(self, session: str, st: SessionState) -> None:
        """Count the session's bytes again (after a request changed it), then hold the bounds."""
        if self.sessions.get(session) is not st:
            return
        new = state_bytes(st) if self.max_bytes is not None or self.max_session_bytes is not None else 0
        self.bytes += new - st.nbytes
        st.nbytes = new
        cap = self.max_session_bytes
        if cap is not None and new > cap:
            while st.finished and st.nbytes > cap:  # the earliest segments first
                self.bytes -= traj_bytes(st.finished[0])
                st.nbytes -= traj_bytes(st.finished.pop(0))
                st.dropped += 1
            if st.nbytes > cap:  # its current record alone: the session goes
                self._drop(session)
                self.evicted += 1
        if self.max_bytes is not None and self.bytes > self.max_bytes:
            self._sweep(self.clock(), room=0)

    def _sweep(self, now: float, room: int) -> None:
        """Drop expired sessions, and the least recently used while ``room`` more would pass the
        cap or the sessions hold more than ``max_bytes``."""
        cap, limit = self.max_sessions, self.max_bytes
        for _ in range(len(self.sessions)):
            sid, st = next(iter(self.sessions.items()))
            if not ((self.ttl is not None and now - st.used > self.ttl)
                    or (cap is not None and len(self.sessions) + room > cap)
                    or (limit is not None and self.bytes > limit)):
                return
            if st.lock.locked() or st.pending:  # in flight: counts as used now
                st.used = now
                self.sessions.move_to_end(sid)
            else:
                self._drop(sid)
                self.evicted += 1

    def prompt(self, st: SessionState, session: str, messages: list[dict[str, Any]],
               tools: list[Any] | None) -> Trajectory:
        """The record a new generation continues (a copy; the caller appends the reply)."""
        if not messages:
            raise ValueError("messages must not be empty")
        key = json.dumps(tools, sort_keys=True) if tools else ""
        norm = [normalize(m) for m in messages]
        k = len(st.prefix)
        if st.forks and key == st.tools_key and len(norm) > k + 1 and norm[:k] == st.prefix:
            for fork in st.forks:
                if fork.reply == norm[k]:
                    traj = _clone(fork.traj)
                    if not traj.tokens or traj.tokens[-1] not in self.chat.stop_ids:
                        traj.append_env([self.chat.end_of_turn_id])  # the reply was cut (length, stop string)
                    traj.append_env(continuation_ids(self.chat, messages[k + 1:], tools, self.frames))
                    st.prefix, st.tools_key = norm, key
                    return traj
        if st.forks:  # the agent's history is not ours: a new segment
            self.history_rewrites += 1
            st.finished.append(st.forks[0].traj)
        traj = Trajectory(prompt_id=session, sample_idx=0, task="openai")
        traj.info["segment"] = len(st.finished)
        traj.append_env(render_ids(self.chat, messages, tools, self.frames))
        st.prefix, st.tools_key, st.forks = norm, key, []
        return traj

    def record(self, st: SessionState, base: Trajectory, results: list[tuple[GenerationResult, list[int], dict]],
               params: Any) -> None:
        """Keep each choice (its result, the ids kept, the message returned) as a fork;
        ``params`` (the ``SamplingParams`` really used) are recorded with each result."""
        forks = []
        for res, ids, message in results:
            traj = _clone(base) if len(results) > 1 else base
            kept = GenerationResult(
                token_ids=ids, logprobs=res.logprobs[: len(ids)],
                cand_offsets=res.cand_offsets[: len(ids) + 1],
                cand_ids=res.cand_ids[: res.cand_offsets[len(ids)]],
                cand_logprobs=res.cand_logprobs[: res.cand_offsets[len(ids)]],
                cand_kind=res.cand_kind, version=res.version, group=res.group,
                finish_reason=res.finish_reason,
            )  # fmt: skip
            traj.append_generated(kept, params)
            traj.turns += 1
            forks.append(Fork(traj, normalize(message)))
        st.forks = forks

    def finish(self, session: str) -> tuple[Trajectory | None, int]:
        """The session's last segment (what trains) and how many earlier segments it had."""
        st = self._drop(session)
        if st is None or not st.forks:
            return None, len(st.finished) + st.dropped if st else 0
        return st.forks[0].traj, len(st.finished) + st.dropped
