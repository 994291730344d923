"""A task instance: what a task source yields and an environment is reset with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Task:
    """One task instance: a stable id, its family and split, and the family's data (the dataset row)."""

    prompt_id: str  # unique and stable across runs (seeded generators)
    family: str  # e.g. "calc", "copy", "coding"
    split: str  # "train" | "heldout"
    data: dict[str, Any] = field(default_factory=dict)  # family-specific (question, answer, ...)
