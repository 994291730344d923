"""Single-turn string reversal (family ``"reverse"``).

    user:      Reverse: kqzt
    assistant: <answer>tzqk</answer>

One reply ends the episode: with ``<answer>X</answer>`` the status is ``ok``
and the reward 1 if X is exactly the reversed word, else 0; a reply without a
complete answer tag ends with ``format_error`` (reward 0). No tools, one
turn: the family frameworks that only do single-turn RL can run too.

Words are 3-6 lowercase letters; the split of a word is a hash of its text
(``calc.split_of``), so train and held-out words never overlap.
"""

from __future__ import annotations

import random
import string

from mixrl.envs.calc import split_of
from mixrl.envs.single_turn import SingleTurnEnv
from mixrl.records.task import Task


def make_task(seed: int, split: str, index: int) -> Task:
    """Task ``index`` of ``split``: deterministic in (seed, split, index)."""
    rng = random.Random(f"reverse/{seed}/{split}/{index}")
    while True:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
        if split_of("reverse:" + w) == split:
            break
    data = {"question": f"Reverse: {w}", "word": w, "answer": w[::-1]}
    return Task(prompt_id=f"reverse/{split}/s{seed}/{index}", family="reverse", split=split, data=data)


class ReverseEnv(SingleTurnEnv):
    """One single-turn reverse episode."""


def demo_turns(task: Task, rng: random.Random, style: str) -> list[tuple[str, str]]:
    """Demonstration: ``correct`` or ``slip`` (two letters swapped: imperfect)."""
    a = task.data["answer"]
    if style == "slip" and len(a) >= 2:
        j = rng.randrange(len(a) - 1)
        a = a[:j] + a[j + 1] + a[j] + a[j + 2 :]
    elif style not in ("correct", "slip"):
        raise ValueError(f"reverse.demo_turns: unknown style {style!r}")
    return [("assistant", f"<answer>{a}</answer>")]
