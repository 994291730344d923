"""Task families by name: seeded task sources and environments.

    src = make_task_source("calc", "train", seed=0)    # indexable, with a cursor
    task = src.next()                                   # advances the cursor
    env = make_env(task, ChatFormat(tokenizer), max_turns=4)
    state = src.state_dict(); src.load_state_dict(state)  # checkpoint / resume

Bundled families: ``calc`` (multi-turn, calculator tool; what the bundled
policy is warm-started on), ``upper`` (single-turn, uppercase a word) and
``reverse`` (single-turn, reverse a word). The single-turn families are for
variety and for comparisons with single-turn frameworks; the default warm
start does not train them, so the bundled policy starts near 0 there.
``mix`` interleaves calc and upper (even indices calc, odd upper).

Adding a family (the hook ``envs/coding`` uses): call

    register_family(name, make_task=fn(seed, split, index) -> Task,
                    make_env=fn(task, chat, **cfg) -> Env, heldout_size=N)

at import of your module, and add ``name -> module`` to ``LAZY_FAMILIES`` so
the registry imports it on first use (``"coding" -> "mixrl.envs.coding"`` is
there already). ``make_env`` passes only the ``cfg`` keys that the family's
factory accepts, so one config can serve a mix of families.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mixrl.envs import calc, reverse, upper
from mixrl.envs.base import Env, Task
from mixrl.envs.chat import ChatFormat

SPLITS = ("train", "heldout")
TRAIN_SIZE = 10**9  # train sources are effectively endless


@dataclass(frozen=True)
class Family:
    name: str
    make_task: Callable[[int, str, int], Task]  # (seed, split, index) -> Task
    make_env: Callable[..., Env]  # (task, chat, **cfg) -> Env
    heldout_size: int = 200


FAMILIES: dict[str, Family] = {}
LAZY_FAMILIES: dict[str, str] = {"coding": "mixrl.envs.coding"}
MIXES: dict[str, tuple[str, ...]] = {"mix": ("calc", "upper")}


def register_family(
    name: str,
    make_task: Callable[[int, str, int], Task],
    make_env: Callable[..., Env],
    heldout_size: int = 200,
) -> None:
    """Register (or replace) a task family under ``name``."""
    FAMILIES[name] = Family(name, make_task, make_env, heldout_size)


register_family("calc", calc.make_task, calc.CalcEnv, heldout_size=200)
register_family("upper", upper.make_task, upper.UpperEnv, heldout_size=200)
register_family("reverse", reverse.make_task, reverse.ReverseEnv, heldout_size=200)


def get_family(name: str) -> Family:
    if name not in FAMILIES and name in LAZY_FAMILIES:
        importlib.import_module(LAZY_FAMILIES[name])  # registers itself on import
    if name not in FAMILIES:
        known = sorted(set(FAMILIES) | set(LAZY_FAMILIES) | set(MIXES))
        raise ValueError(f"unknown task family {name!r}; known: {known}")
    return FAMILIES[name]


class TaskSource:
    """Tasks of one family (or a mix) and split, indexable, with a cursor.

    ``source[i]`` is deterministic in (name, split, seed, i). ``next()``
    returns ``source[cursor]`` and advances; ``state_dict()`` /
    ``load_state_dict()`` save and restore the cursor, so a resumed run neither
    skips nor repeats a task. Held-out sources are finite (``len``), train
    sources endless; iteration starts at the cursor and advances it.
    """

    def __init__(self, name: str, split: str, seed: int, size: int | None = None) -> None:
        if split not in SPLITS:
            raise ValueError(f"TaskSource.split must be one of {SPLITS}, got {split!r}")
        self.name, self.split, self.seed = name, split, seed
        self.parts = [get_family(n) for n in MIXES.get(name, (name,))]
        default = TRAIN_SIZE if split == "train" else sum(f.heldout_size for f in self.parts)
        if size is not None and size < 1:
            raise ValueError(f"TaskSource.size must be >= 1, got {size}")
        self.size = default if size is None else size
        self.cursor = 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Task:
        if not 0 <= i < self.size:
            raise IndexError(f"TaskSource {self.name}/{self.split}: index {i} outside [0, {self.size})")
        fam = self.parts[i % len(self.parts)]
        return fam.make_task(self.seed, self.split, i // len(self.parts))

    def next(self) -> Task:
        if self.cursor >= self.size:
            raise StopIteration
        task = self[self.cursor]
        self.cursor += 1
        return task

    def __iter__(self) -> Iterator[Task]:
        while self.cursor < self.size:
            yield self.next()

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "split": self.split, "seed": self.seed, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in ("name", "split", "seed"):
            if state.get(k) != getattr(self, k):
                raise ValueError(f"TaskSource state {k}={state.get(k)!r} does not match {getattr(self, k)!r}")
        self.cursor = int(state["cursor"])


def make_task_source(name: str, split: str, seed: int = 0, size: int | None = None) -> TaskSource:
    """A ``TaskSource`` for a family name or a mix (``"mix"``)."""
    return TaskSource(name, split, seed, size)


def make_env(task: Task, chat: ChatFormat, **cfg: Any) -> Env:
    """The environment of ``task``'s family; unknown ``cfg`` keys are ignored per family."""
    factory = get_family(task.family).make_env
    params = inspect.signature(factory).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        cfg = {k: v for k, v in cfg.items() if k in params}
    return factory(task, chat, **cfg)
