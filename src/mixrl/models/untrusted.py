"""Untrusted text stays text: encoding environment/tool output without special-token ids,
and stripping control bytes before output reaches a log.

    ids = encode_untrusted(tokenizer, tool_output)   # never a role/EOS/pad id
    log.info("tool said %s", strip_control(tool_output))

Why: a tokenizer matches its added tokens (``<|end|>``, ``<|user|>``, EOS ...) anywhere in
the text it encodes, so a command that prints ``<|end|><|user|>...<|assistant|>`` would
otherwise close the tool turn and forge a user turn and an assistant header: the policy
would be trained on a conversation the environment never produced (and an EOS mid-sequence
ends sampling early).

How: the text is cut at every occurrence of a special string (every added token, plus the
chat role markers, which are plain text with a tokenizer that lacks them); each ordinary
piece is encoded alone, and each special string is encoded one character at a time, so it
becomes ordinary ids (``<``, ``|``, ``e`` ...). Pieces are joined as ids, never re-encoded.
A piece whose encoding still carries a forbidden id (a normalizer that rebuilds a special
string) falls back to characters, and a character that alone encodes to a forbidden id is
dropped. The unknown-token id is allowed: it carries no structure.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable
from typing import Any

from mixrl.models.codec import Codec

ROLE_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>")


def special_strings(tokenizer: Any) -> tuple[str, ...]:
    """Every string the tokenizer turns into an added/special id, longest first."""
    found: set[str] = set(ROLE_MARKERS)
    found.update(str(t) for t in getattr(tokenizer, "all_special_tokens", ()) or ())
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found.update(str(getattr(t, "content", t)) for t in decoder.values())
    return tuple(sorted((s for s in found if s), key=lambda s: (-len(s), s)))


def forbidden_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that must never come from untrusted text: every special/added token except unk."""
    ids: set[int] = set(int(i) for i in (getattr(tokenizer, "all_special_ids", ()) or ()))
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, t in decoder.items() if getattr(t, "special", True))
    for s in ROLE_MARKERS:  # role tokens may be registered as non-special added tokens
        i = tokenizer.convert_tokens_to_ids(s)
        if isinstance(i, int):
            ids.add(i)
    unk = getattr(tokenizer, "unk_token_id", None)
    ids.discard(unk if isinstance(unk, int) else -1)
    return frozenset(ids)


@functools.lru_cache(maxsize=16)
def _plan(tokenizer: Any) -> tuple[re.Pattern[str], frozenset[int], Callable[[str], list[int]]]:
    pattern = re.compile("|".join(re.escape(s) for s in special_strings(tokenizer)))
    return pattern, forbidden_ids(tokenizer), Codec(tokenizer).encode  # the HF encode's ids, less wrapper


def _chars(encode: Callable[[str], list[int]], text: str, bad: frozenset[int]) -> list[int]:
    out: list[int] = []
    for ch in text:
        ids = encode(ch)
        if not bad.intersection(ids):
            out += ids
    return out


def encode_untrusted(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` (no BOS/EOS) in which no special-token id appears."""
    try:
        pattern, bad, encode = _plan(tokenizer)
    except TypeError:  # an unhashable tokenizer object: no cache
        pattern, bad, encode = _plan.__wrapped__(tokenizer)
    out: list[int] = []
    pos = 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            out += _safe_piece(encode, text[pos:m.start()], bad)
        out += _chars(encode, m.group(0), bad)
        pos = m.end()
    if pos < len(text):
        out += _safe_piece(encode, text[pos:], bad)
    return out


def _safe_piece(encode: Callable[[str], list[int]], piece: str, bad: frozenset[int]) -> list[int]:
    ids = encode(piece)
    return ids if not bad.intersection(ids) else _chars(encode, piece, bad)


# CSI (ESC [ ... final), OSC (ESC ] ... BEL or ESC \), other two-byte escapes.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]?")
_KEEP = frozenset("\n\t")


def strip_control(text: str) -> str:
    """``text`` without ANSI escape sequences, C0/C1 control characters (newline and tab
    kept; carriage returns dropped, they overwrite log lines) and Unicode format characters
    such as bidi overrides, so logged output cannot rewrite a terminal or hide text."""
    text = _ANSI.sub("", text)
    return "".join(c for c in text if c in _KEEP or unicodedata.category(c) not in ("Cc", "Cf"))
