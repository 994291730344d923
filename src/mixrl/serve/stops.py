"""Stop strings found in a reply as its tokens are decoded, searching the new text only.

A stop string that a token completes started at most ``max(len(stop)) - 1``
characters before that token's text, so each step searches ``tail + new``,
where ``tail`` holds the last ``max(len(stop)) - 1`` characters already
searched: linear in the reply's length (re-decoding the whole growing text
after every token is quadratic).

Text per token is decoded incrementally, as vLLM's detokenizer does: the
difference between the decode of a short window of ids ending at the token and
the same window without it. The window starts at the chunk before the last
complete one, so a tokenizer whose pieces depend on their left neighbour
(SentencePiece's leading space) decodes them as in the whole text, and a
character whose UTF-8 bytes span several tokens is emitted once its last byte
arrived: until then the window's decode ends in U+FFFD, and only the text
before that is searched. A window that grows past ``MAX_WINDOW`` tokens
without completing (a sampler emitting invalid UTF-8) is emitted as it
decodes, so the cost stays linear.

Result (equal to re-decoding the growing text after every token, the tests'
brute-force reference): the reply ends at the first token after which its text
holds a stop string; the text is cut at the earliest start of a stop string in
it, and the tokens kept are those up to the first one whose text reaches past
that start (that token is recorded, its text after the cut is not returned).

    cut([ids of "a+b=5\\nc"], ["\\n"], decode)  ->  (ids of "a+b=5\\n", "a+b=5", True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MAX_WINDOW = 32  # tokens: far more than one character's bytes


class StopScanner:
    """Feed a reply's ids one at a time; ``feed`` returns where a stop string starts once one is complete."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]) -> None:
        self.stops, self.decode = [s for s in stops if s], decode
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.reach: list[int] = []  # per token: the length of the text of the ids up to it
        self.parts: list[str] = []  # emitted text, chunk by chunk
        self.emitted = 0  # characters emitted
        self.prefix = self.read = 0  # the window: ids[prefix:] decoded against ids[prefix:read]
        self.prefix_text = ""
        self.visible = ""  # the complete text of the window's pending ids (not yet emitted)
        self.scanned = 0  # characters searched
        self.tail = ""

    def feed(self, token: int) -> int | None:
        ids = self.ids
        ids.append(token)
        new_text = self.decode(ids[self.prefix:])
        pending = new_text[len(self.prefix_text):]
        base = self.emitted
        self.reach.append(base + len(pending))
        if pending and (not pending.endswith("\ufffd") or len(ids) - self.prefix > MAX_WINDOW):
            self.parts.append(pending)
            self.emitted += len(pending)
            self.prefix, self.read = self.read, len(ids)
            self.prefix_text = self.decode(ids[self.prefix:self.read])
            visible, self.visible = pending, ""
        else:
            visible = self.visible = pending.rstrip("\ufffd")
        fresh = visible[self.scanned - base:]
        if not fresh:
            return None
        window = self.tail + fresh
        start = self.scanned - len(self.tail)
        self.scanned += len(fresh)
        self.tail = window[-self.keep:] if self.keep else ""
        hits = [i for i in (window.find(s) for s in self.stops) if i >= 0]
        return start + min(hits) if hits else None

    def text(self) -> str:
        """The text searched so far."""
        return "".join(self.parts) + self.visible

    def kept(self, at: int) -> int:
        """How many ids to keep for a cut at character ``at``: up to the first whose text reaches past it."""
        return next((i + 1 for i, r in enumerate(self.reach) if r > at), len(self.ids))


def cut(ids: list[int], stops: Sequence[str], decode: Callable[[list[int]], str]) -> tuple[list[int], str, bool]:
    """(ids kept, reply text, whether a stop string ended it). One decode when no stop string
    occurs in the whole text (a stop in a growing text is in the whole text); else the scan."""
    text = decode(ids)
    if not any(s and s in text for s in stops):
        return ids, text, False
    scanner = StopScanner(stops, decode)
    for tok in ids:
        at = scanner.feed(tok)
        if at is not None:
            return ids[:scanner.kept(at)], scanner.text()[:at], True
    return ids, text, False  # only a stop string holding U+FFFD matched a partial character's decode
