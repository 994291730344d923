"""A task family (how its tasks are made and its env built), and the run's active data,
rewards and env options that the families' sources and envs read (``registry.activate``)."""

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
    """The run's dataset, reward functions and environment options (``activate``)."""

    data: Any = None
    rewards: Any = None
    options: dict[str, Any] | None = None
    split_seed: int = 0  # seeds data.heldout_fraction (the run's seed)


ACTIVE = Active()
