"""Single-turn uppercasing (family ``"upper"``).

    user:      Uppercase: kqzt
    assistant: <answer>KQZT</answer>

One reply ends the episode: with ``<answer>X</answer>`` the status is ``ok``
and the reward 1 if X is exactly the uppercased word, else 0; a reply without
a complete answer tag ends with ``format_error`` (reward 0). No tools, one
turn: the single-turn family of the bundled ``mix`` (a character map, easier
for a small policy than ``reverse``).

Words are 3-7 lowercase letters; the split of a word is a hash of its text
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
    rng = random.Random(f"upper/{seed}/{split}/{index}")
    while True:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 7)))
        if split_of("upper:" + w) == split:
            break
    data = {"question": f"Uppercase: {w}", "word": w, "answer": w.upper()}
    return Task(prompt_id=f"upper/{split}/s{seed}/{index}", family="upper", split=split, data=data)


class UpperEnv(SingleTurnEnv):
    """One single-turn upper episode."""


def demo_turns(task: Task, rng: random.Random, style: str) -> list[tuple[str, str]]:
    """Demonstration: ``correct`` or ``slip`` (one letter left lowercase: imperfect)."""
    a = task.data["answer"]
    if style == "slip":
        j = rng.randrange(len(a))
        a = a[:j] + a[j].lower() + a[j + 1 :]
    elif style != "correct":
        raise ValueError(f"upper.demo_turns: unknown style {style!r}")
    return [("assistant", f"<answer>{a}</answer>")]
