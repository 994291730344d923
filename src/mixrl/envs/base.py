"""The environment interface: tokens in, tokens out.

A session runner (``mixrl.rollout.session``) drives one episode:

    tokens = await env.reset()                  # prompt tokens (chat-formatted)
    loop:
        generated = sampler(tokens)             # one assistant turn, token ids
        step = await env.step(generated, finish_reason)
        tokens += generated + step.tokens       # tool output / next header, loss_mask 0
        if step.done: reward, status = step.reward, step.status

Two levels of API. ``Env`` is token level (above). ``MessageEnv`` is text
level: override ``respond(reply)`` (and optionally ``prompt()``), answer with
``Reply.tool(text)``, ``Reply.user(text)`` or ``Reply.end(reward)``; the chat
format, end-of-turn tokens, the turn limit and ``reward_failed`` are handled
here. ``await self.reward(reply)`` scores with the run's ``[reward]``
functions. See docs/envs.md for a multi-turn example with a tool.

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

from mixrl.envs.rewards import RewardFailed
from mixrl.records.task import Task


@dataclass
class StepResult:
    """What the environment returns after one generated turn (fields in the comments)."""

    tokens: list[int]  # appended after the generated turn (loss_mask 0)
    done: bool
    reward: float | None = None  # set when done (None for infra_failed)
    status: str = ""  # when done: ok | format_error | max_turns | truncated | infra_failed | reward_failed
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


@dataclass
class Reply:
    """What a ``MessageEnv`` answers to one assistant reply."""

    kind: str  # "tool" | "user" | "end"
    text: str = ""
    reward: float | None = None
    status: str = "ok"

    @classmethod
    def tool(cls, text: str) -> Reply:
        """Tool output as the next turn (the episode goes on)."""
        return cls("tool", text)

    @classmethod
    def user(cls, text: str) -> Reply:
        """A user message as the next turn (the episode goes on)."""
        return cls("user", text)

    @classmethod
    def end(cls, reward: float, status: str = "ok") -> Reply:
        """End the episode with ``reward``."""
        return cls("end", reward=reward, status=status)


class MessageEnv(Env):
    """Text-level episodes over a task (a dataset row in ``task.data``).

    Subclasses override ``respond`` (and ``prompt`` if the row's prompt column
    is not the prompt). Options come from ``env.options`` as keyword arguments
    of ``__init__``; unknown ones are rejected at ``--dry-run``. After
    ``max_turns`` replies without an end, the episode ends with status
    ``max_turns`` and the reward of the last reply (``reward``). A
    ``RewardFailed`` from the reward functions ends it as ``reward_failed``.
    """

    rewards: Any = None  # the run's reward functions (set by the registry)

    def __init__(self, task: Task, chat: Any, max_turns: int = 4, system: str | None = None) -> None:
        if max_turns < 1:
            raise ValueError(f"env.options.max_turns must be >= 1, got {max_turns}")
        self.task, self.chat, self.max_turns, self.system = task, chat, max_turns, system
        self.turns = 0
        self.transcript: list[dict[str, str]] = []  # assistant replies and tool/user turns after the prompt

    @property
    def row(self) -> dict[str, Any]:
        """The task's dataset row (its columns, as the reward functions receive them)."""
        return self.task.data

    async def prompt(self) -> str | list[dict[str, str]]:
        """The prompt: a string, or chat messages (default: the row's prompt column)."""
        return self.row[self.row.get("_prompt_key", "prompt")]  # type: ignore[no-any-return]

    @abc.abstractmethod
    async def respond(self, reply: str) -> Reply:
        """Answer one assistant reply."""

    async def reward(self, reply: str) -> float:
        """The weighted sum of the run's reward functions on ``reply`` (raises ``RewardFailed``)."""
        if not self.rewards:
            raise ValueError(f"{type(self).__name__}: no [reward] function is configured")
        return float(await self.rewards.score(reply, self._prompt, self.row))

    async def reset(self) -> list[int]:
        """Start the episode: the prompt (or chat messages) rendered with the chat template, as token ids."""
        self.turns, self.transcript = 0, []
        self._prompt = await self.prompt()
        if isinstance(self._prompt, str):
            return list(self.chat.prompt(self._prompt, self.system))
        ids: list[int] = []
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + list(self._prompt)
        for m in msgs:
            ids += self.chat._turn(f"<|{m['role']}|>", str(m["content"]))
        return ids + self.chat.assistant_header

    async def step(self, generated: list[int], finish_reason: str) -> StepResult:
        """Decode one generated turn, answer it (``respond``) and return the tokens to append, or the end."""

        close = [] if generated and generated[-1] in self.chat.stop_ids else [self.chat.end_of_turn_id]
        text = self.chat.reply_text(generated)
        self.turns += 1
        self.transcript.append({"role": "assistant", "content": text})
        try:
            r = await self.respond(text)
            if r.kind != "end" and self.turns >= self.max_turns:
                r = Reply.end(await self.reward(text), "max_turns")
        except RewardFailed as e:
            return StepResult(close, True, None, "reward_failed", info={"error": str(e)})
        if r.kind == "end":
            return StepResult(close, True, r.reward, r.status)
        self.transcript.append({"role": r.kind, "content": r.text})
        nxt = self.chat.tool_result(r.text) if r.kind == "tool" else self.chat.user_turn(r.text)
        return StepResult(close + list(nxt), False)
