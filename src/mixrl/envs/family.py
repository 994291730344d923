"""A task family (how its tasks are made and its env built), and a run's inputs to them: its
dataset, reward functions and env options (``registry.activate`` builds them; the caller passes
them to ``make_task_source`` and ``make_env``: nothing is held in a global)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mixrl.envs.base import Env
from mixrl.records.task import Task


@dataclass(frozen=True)
class Family:
    name: str
    make_task: Callable[[int, str, int], Task] | None  # (seed, split, index) -> Task; None = needs [data]
    make_env: Callable[..., Env]  # (task, chat, **cfg) -> Env
    heldout_size: int = 200


@dataclass
class Active:
    """A run's dataset, reward functions and environment options (``registry.activate``).
    ``Active()``: none of them (the families' own tasks, no rewards, no options)."""

    data: Any = None
    rewards: Any = None
    options: dict[str, Any] | None = None
    split_seed: int = 0  # seeds data.heldout_fraction (the run's seed)

