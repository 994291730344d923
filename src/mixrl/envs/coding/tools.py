"""Tool calls in a model's reply: ``<bash>`` tags or OpenAI-style JSON function calls.

Accepted forms (the first call in the reply is the one taken)::

    <bash>ls -la</bash>                                   run a command
    <submit/>   (or <submit>, <submit></submit>)          end the episode, grade
    {"name": "bash", "arguments": {"command": "ls -la"}}  JSON, arguments as an object
    {"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"} ... or as a JSON string
    {"name": "submit", "arguments": {}}
    {"type": "function", "function": {"name": ..., "arguments": ...}}   (tool_calls entry)

JSON calls may sit inside code fences or ``<tool_call>`` tags: any JSON object
in the text with a ``"name"`` (or ``"function"``) key counts. The command
inside ``<bash>`` is taken verbatim (no entity decoding), without one leading
and one trailing newline.

Malformed (an attempt that cannot be run; the environment answers with the
reason and counts it): an unclosed ``<bash>``, an empty command, a JSON
object naming an unknown tool, arguments that are neither an object nor a
JSON-encoded object, a missing or non-string ``command``, or text that looks
like a JSON call (``"name": "bash"``) but does not parse.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

TOOLS = ("bash", "submit")
MAX_JSON_ATTEMPTS = 64  # bound the work on pathological text with many '{'
_BASH = re.compile(r"<bash>(.*?)</bash>", re.S)
_SUBMIT = re.compile(r"<submit\s*/?>")
_JSON_HINT = re.compile(r'"(?:name|function)"\s*:')


@dataclass(frozen=True)
class ToolCall:
    name: str  # "bash" | "submit"
    command: str = ""  # bash only
    pos: int = 0  # offset in the reply (the earliest call wins)


@dataclass(frozen=True)
class Malformed:
    reason: str  # what the tool answers: "error: <reason>"
    pos: int = 0


def _from_json(obj: object, pos: int) -> ToolCall | Malformed | None:
    if not isinstance(obj, dict):
        return None
    fn = obj.get("function")
    if isinstance(fn, dict):  # {"type": "function", "function": {...}}
        obj = fn
    if "name" not in obj:
        return None
    name, args = obj.get("name"), obj.get("arguments", obj.get("parameters", {}))
    if name not in TOOLS:
        return Malformed(f"unknown tool {str(name)[:40]!r}; tools: {', '.join(TOOLS)}", pos)
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return Malformed(f"arguments of {name} are not valid JSON ({e.msg})", pos)
    if not isinstance(args, dict):
        return Malformed(f"arguments of {name} must be an object", pos)
    if name == "submit":
        return ToolCall("submit", pos=pos)
    cmd = args.get("command")
    if not isinstance(cmd, str) or not cmd.strip():
        return Malformed('bash needs a non-empty string "command" argument', pos)
    return ToolCall("bash", cmd, pos)


def _json_calls(text: str) -> list[ToolCall | Malformed]:
    out: list[ToolCall | Malformed] = []
    dec = json.JSONDecoder()
    i, tries = text.find("{"), 0
    while i != -1 and tries < MAX_JSON_ATTEMPTS:
        tries += 1
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            continue
        call = _from_json(obj, i)
        if call is not None:
            out.append(call)
            i = text.find("{", end)
        else:
            i = text.find("{", i + 1)
    return out


def parse_tool_call(text: str) -> ToolCall | Malformed | None:
    """The first tool call in ``text``, a ``Malformed`` attempt, or ``None`` (no attempt)."""
    found: list[ToolCall | Malformed] = []
    m = _BASH.search(text)
    if m is not None:
        cmd = m.group(1)
        cmd = cmd[1:] if cmd.startswith("\n") else cmd
        cmd = cmd[:-1] if cmd.endswith("\n") else cmd
        found.append(ToolCall("bash", cmd, m.start()) if cmd.strip() else Malformed("empty command", m.start()))
    elif "<bash>" in text:
        found.append(Malformed("missing </bash>", text.index("<bash>")))
    s = _SUBMIT.search(text)
    if s is not None:
        found.append(ToolCall("submit", pos=s.start()))
    found += _json_calls(text)
    if not found:
        hint = _JSON_HINT.search(text)
        if hint is not None and re.search(r'"(bash|submit)"', text):
            return Malformed("could not parse the JSON tool call", hint.start())
        return None
    return min(found, key=lambda c: c.pos)
