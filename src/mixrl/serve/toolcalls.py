"""Tool calls in generated text: parse them out of a reply, as OpenAI's ``tool_calls``.

Two conventions cover the chat templates in use:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
  (Qwen2/2.5/3, Hermes, many Llama fine-tunes);
- ``tags``: ``<NAME>TEXT</NAME>`` for a tool NAME the request declared, TEXT
  becoming its first parameter (the bundled policy's ``<calc>2+3</calc>``).

``auto`` tries ``hermes`` first, then ``tags``. Parsing never changes what was
recorded: the reply's tokens are kept as generated; only the message returned
to the agent is split into ``content`` and ``tool_calls``.
"""

from __future__ import annotations

import json
import re
from typing import Any

PARSERS = ("auto", "hermes", "tags", "none")
_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def _first_param(tool: dict[str, Any]) -> str:
    params = (tool.get("function") or {}).get("parameters") or {}
    props = list((params.get("properties") or {}).keys())
    required = params.get("required") or props
    return str(required[0]) if required else "input"


def _call(i: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def parse_hermes(text: str) -> tuple[str, list[dict[str, Any]]]:
    calls = []
    for i, m in enumerate(_HERMES.finditer(text)):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue  # a malformed call stays text: the agent sees what the model wrote
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments") or {}
            calls.append(_call(i, obj["name"], args if isinstance(args, dict) else {"input": args}))
    content = _HERMES.sub("", text).strip() if calls else text
    return content, calls


def parse_tags(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    by_name = {(t.get("function") or {}).get("name"): t for t in tools}
    calls, spans = [], []
    for name, tool in by_name.items():
        if not name:
            continue
        for m in re.finditer(rf"<{re.escape(name)}>(.*?)</{re.escape(name)}>", text, re.S):
            spans.append((m.start(), m.end(), name, m.group(1), tool))
    spans.sort()
    for i, (_, _, name, inner, tool) in enumerate(spans):
        calls.append(_call(i, name, {_first_param(tool): inner}))
    return text, calls  # tags are part of the reply's text: content keeps them


def parse(text: str, tools: list[dict[str, Any]] | None, parser: str = "auto") -> tuple[str, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a reply; no tools declared means no tool calls."""
    if not tools or parser == "none":
        return text, []
    if parser in ("auto", "hermes"):
        content, calls = parse_hermes(text)
        if calls or parser == "hermes":
            return content, calls
    return parse_tags(text, tools)
