"""Termination rules shared by every multi-turn environment.

An environment calls ``TurnTracker.on_reply`` once for every assistant reply
that did *not* end the episode (a reply with a final answer ends it before
the tracker is asked). The tracker counts turns, malformed tool calls and
consecutive replies without any tool call, and returns the terminal status
to end with, or ``None`` to go on:

- ``"format_error"``: ``max_no_tool`` consecutive replies (default 3) carried
  neither a tool call nor a final answer. A malformed call *is* an attempt at
  a tool call: it resets the streak (and is counted in ``num_malformed``; the
  environment answers it with an error message as tool output).
- ``"max_turns"``: ``max_turns`` replies were taken without a final answer.

``format_error`` is checked first, so the third reply without a tool call
ends as ``format_error`` even when it is also the last allowed turn.

Worked example (max_turns=4, max_no_tool=3)::

    t = TurnTracker(4)
    t.on_reply(False, False)  -> None            # streak 1
    t.on_reply(True, True)    -> None            # malformed call: streak 0, malformed 1
    t.on_reply(False, False)  -> None            # streak 1
    t.on_reply(True, False)   -> "max_turns"     # 4 turns, no answer

Both terminal statuses are the model's doing: the environment gives them
reward 0 (never ``None``, which is reserved for infrastructure failures).
"""

from __future__ import annotations


class TurnTracker:
    """Counts replies; decides ``format_error`` / ``max_turns``."""

    def __init__(self, max_turns: int, max_no_tool: int = 3) -> None:
        if max_turns < 1:
            raise ValueError(f"TurnTracker.max_turns must be >= 1, got {max_turns}")
        if max_no_tool < 1:
            raise ValueError(f"TurnTracker.max_no_tool must be >= 1, got {max_no_tool}")
        self.max_turns = max_turns
        self.max_no_tool = max_no_tool
        self.turns = 0  # replies seen by on_reply
        self.num_malformed = 0  # replies with a malformed tool call
        self.no_tool_streak = 0  # consecutive replies without any tool call

    def on_reply(self, had_tool_call: bool, malformed: bool = False) -> str | None:
        """Record one non-final reply; return a terminal status or ``None``.

        ``malformed`` implies an attempted tool call (it resets the streak).
        """
        self.turns += 1
        if malformed:
            self.num_malformed += 1
        if had_tool_call or malformed:
            self.no_tool_streak = 0
        else:
            self.no_tool_streak += 1
        if self.no_tool_streak >= self.max_no_tool:
            return "format_error"
        if self.turns >= self.max_turns:
            return "max_turns"
        return None

    def state_dict(self) -> dict[str, int]:
        return {"turns": self.turns, "num_malformed": self.num_malformed, "no_tool_streak": self.no_tool_streak}
