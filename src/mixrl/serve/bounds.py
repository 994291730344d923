"""Byte bounds of what the endpoint keeps between requests, and a request's size before encoding.

Everything kept is counted in bytes with one integer estimate, ``ITEM_BYTES`` per
list item (a list slot and the number it holds) plus the length of each string,
so a store's count is exact arithmetic over what it holds (no float, no
``sys.getsizeof`` walk) and a test can recount it from scratch:

- ``ByteLRU``: a least-recently-used map bounded in bytes and entries; an entry
  larger than an eighth of the bound is not kept (one request cannot flush it);
  used by the template cache (``conversation.Frames``);
- ``traj_bytes`` / ``norm_bytes``: a recorded trajectory, a normalized message
  (what ``SessionStore`` counts per session);
- ``request_chars``: the characters a chat request puts into the template beside
  its contents (``tools``, each message's ``name``, tool calls' names and
  arguments), counted before anything is rendered or encoded, so a request too
  large for the context is refused unencoded.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import orjson

ITEM_BYTES = 32  # a list slot (8) and its int or float (24-28; small ints are shared)
ENTRY_BYTES = 128  # a map entry or object's own overhead
MIB = 1 << 20


class ByteLRU:
    """key -> value, at most ``max_bytes`` (each entry's size given by the caller) and
    ``max_items`` entries; the least recently used go first."""

    def __init__(self, max_bytes: int, max_items: int | None = None) -> None:
        self.max_bytes, self.max_items = max_bytes, max_items
        self.max_entry = max_bytes // 8
        self._d: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self.bytes = self.evicted = 0

    def __len__(self) -> int:
        return len(self._d)

    def get(self, key: Any) -> Any:
        hit = self._d.get(key)
        if hit is None:
            return None
        self._d.move_to_end(key)
        return hit[0]

    def put(self, key: Any, value: Any, nbytes: int) -> bool:
        """Keep ``value`` (``nbytes`` with its key); False (not kept) when it is too large."""
        if nbytes > self.max_entry:
            return False
        old = self._d.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._d[key] = (value, nbytes)
        self.bytes += nbytes
        while self.bytes > self.max_bytes or (self.max_items is not None and len(self._d) > self.max_items):
            _, (_, b) = self._d.popitem(last=False)
            self.bytes -= b
            self.evicted += 1
        return True

    def sizes(self) -> list[int]:
        return [b for _, b in self._d.values()]


def traj_bytes(traj: Any) -> int:
    """A trajectory's lists (tokens, masks, log-probs, candidates ...) at ``ITEM_BYTES`` an item."""
    n = 0
    for v in vars(traj).values():
        if isinstance(v, list):
            n += len(v)
            if v and isinstance(v[0], list):  # per-token lists (routed experts)
                n += sum(len(x) for x in v)
        elif isinstance(v, dict):
            n += len(v)
    return ENTRY_BYTES + n * ITEM_BYTES


def norm_bytes(norm: tuple) -> int:
    """A normalized message (role, text, calls, tool call id): its strings' lengths."""
    role, text, calls, call_id = norm
    return ENTRY_BYTES + len(str(role)) + len(text) + len(str(call_id)) + sum(
        len(str(name)) + len(args) + ENTRY_BYTES for name, args in calls)


def request_chars(messages: list[dict[str, Any]], tools: list[Any] | None) -> tuple[int, int]:
    """(characters of ``tools`` as JSON, characters of every message's name, tool call id
    and tool calls): what the template writes beside the contents. Malformed tool calls
    raise ``ValueError`` (naming the message), before anything is rendered."""
    tool_chars = len(orjson.dumps(tools)) if tools else 0
    n = 0
    for i, m in enumerate(messages):
        for key in ("name", "tool_call_id"):
            v = m.get(key)
            if v is not None:
                if not isinstance(v, str):
                    raise ValueError(f"messages[{i}].{key} must be a string")
                n += len(v)
        calls = m.get("tool_calls")
        if not calls:
            continue
        if not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls must be a list")
        for c in calls:
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"messages[{i}].tool_calls: each must be "
                                 '{"type": "function", "function": {"name": ..., "arguments": ...}}')
            args = fn.get("arguments")
            n += len(fn["name"]) + (len(args) if isinstance(args, str) else len(orjson.dumps(args)))
            if c.get("id") is not None:
                n += len(str(c["id"]))
    return tool_chars, n
