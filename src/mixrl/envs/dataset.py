"""The dataset environment (``env.name = "dataset"``): your prompts, your reward functions.

    user:      <the row's prompt>
    assistant: <calc>3*14-5</calc>        # only with env.options.tools = ["calc"]
    tool:      37
    assistant: <answer>37</answer>        # a reply without a tool call is final

The final reply is scored by the ``[reward]`` functions (``mixrl.envs.rewards``)
with every column of the row. With the ``calc`` tool, ``<calc>EXPR</calc>``
gets the exact value of an integer expression as tool output (the calculator
of ``envs/calc``; a bad expression gets ``error: ...``). Without tools, it is
one reply per episode, as in single-turn RL frameworks.
"""

from __future__ import annotations

import re
from typing import Any

from mixrl.envs.base import MessageEnv, Reply
from mixrl.envs.calc import CalcError, evaluate_expr, format_value
from mixrl.records.task import Task

TOOLS = ("calc",)
_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)


class DatasetEnv(MessageEnv):
    """One episode of one dataset row; see the module docstring."""

    def __init__(self, task: Task, chat: Any, max_turns: int = 4, tools: list[str] | tuple[str, ...] = (),
                 system: str | None = None) -> None:
        super().__init__(task, chat, max_turns=max_turns, system=system)
        self.check_options({"tools": tools})
        self.tools = tuple(tools)

    @staticmethod
    def check_options(options: dict[str, Any]) -> None:
        bad = [t for t in options.get("tools", ()) if t not in TOOLS]
        if bad:
            raise ValueError(f"env.options.tools: unknown tool(s) {bad}; choose from {list(TOOLS)}")

    async def respond(self, reply: str) -> Reply:
        call = _CALL.search(reply) if "calc" in self.tools and "<answer>" not in reply else None
        if call is None:
            return Reply.end(await self.reward(reply))
        try:
            return Reply.tool(format_value(evaluate_expr(call.group(1))))
        except CalcError as e:
            return Reply.tool(f"error: {e}")
