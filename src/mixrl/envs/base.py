"""The environment interface: tokens in, tokens out.

A session runner (``mixrl.rollout.session``) drives one episode:

    tokens = await env.reset()                  # prompt tokens (chat-formatted)
    loop:
        generated = sampler(tokens)             # one assistant turn, token ids
        step = await env.step(generated, finish_reason)
        tokens += generated + step.tokens       # tool output / next header, loss_mask 0
        if step.done: reward, status = step.reward, step.status

Environments never raise into the runner for anything the model wrote (bad
tool calls, garbage): they answer with an error message as tool output or end
the episode with the right status. Failures on our side (a sandbox that cannot
start) end the episode with status ``infra_failed`` and ``reward None`` —
never a reward of 0.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Task:
    prompt_id: str  # unique and stable across runs (seeded generators)
    family: str  # e.g. "calc", "copy", "coding"
    split: str  # "train" | "heldout"
    data: dict[str, Any] = field(default_factory=dict)  # family-specific (question, answer, ...)


@dataclass
class StepResult:
    tokens: list[int]  # appended after the generated turn (loss_mask 0)
    done: bool
    reward: float | None = None  # set when done (None for infra_failed)
    status: str = ""  # when done: ok | format_error | max_turns | truncated | infra_failed
    malformed: bool = False  # this turn carried a malformed tool call
    info: dict[str, Any] = field(default_factory=dict)


class Env(abc.ABC):
    """One episode of one task."""

    task: Task

    @abc.abstractmethod
    async def reset(self) -> list[int]:
        """Return the initial tokens (the prompt)."""

    @abc.abstractmethod
    async def step(self, generated: list[int], finish_reason: str) -> StepResult:
        """Take one generated assistant turn; answer with tokens or end the episode."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (sandboxes)."""
