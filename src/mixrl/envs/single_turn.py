"""The single-turn episode shared by the ``upper`` and ``reverse`` families.

One reply ends the episode: ``<answer>X</answer>`` gives status ``ok`` and
reward 1 if X equals ``task.data["answer"]`` exactly, else 0; a reply without a
complete answer tag ends with ``format_error`` (reward 0).
"""

from __future__ import annotations

import re

from mixrl.envs.base import Env, StepResult
from mixrl.models.chat import ChatFormat
from mixrl.records.task import Task

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


class SingleTurnEnv(Env):
    """One single-turn episode."""

    def __init__(self, task: Task, chat: ChatFormat) -> None:
        self.task = task
        self.chat = chat
        self.stop_ids = chat.stop_ids

    async def reset(self) -> list[int]:
        return self.chat.prompt(self.task.data["question"])

    async def step(self, generated: list[int], finish_reason: str) -> StepResult:
        close = [] if generated and generated[-1] in self.stop_ids else [self.chat.end_of_turn_id]
        m = _ANSWER.search(self.chat.reply_text(generated))
        if m is None:
            return StepResult(close, True, 0.0, "format_error")
        ok = m.group(1).strip() == self.task.data["answer"]
        return StepResult(close, True, 1.0 if ok else 0.0, "ok", info={"answer": m.group(1)[:32]})
