"""Tasks from dataset rows: epochs with a seeded shuffle, and a cursor that checkpoints.

    src = DatasetSource(rows, "train", seed=0, family="dataset", prompt_key="prompt")
    task = src.next()            # row order[epoch][i]; advances the cursor
    src.state_dict()             # {"cursor": 137, ...}: saved in every checkpoint

Train sources are endless: the cursor runs over epochs, epoch ``e`` visiting
every row once in the order ``permutation(seed, e)`` (the identity with
``shuffle=False``), so the row of a cursor value is a pure function of
(seed, cursor) and a resumed run neither skips nor repeats a row. Held-out
sources are finite and unshuffled. A task's ``data`` is the whole row (every
column reaches the reward functions and the environment) plus ``_row`` (its
index) and ``_epoch``; ``prompt_id`` is unique per (split, epoch, row).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from mixrl.data.loading import DataError
from mixrl.records.task import Task


def check_prompt(value: Any, where: str) -> None:
    """A prompt is a non-empty string or a list of ``{"role", "content"}`` messages."""
    if isinstance(value, str) and value:
        return
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return
    raise DataError(f"{where}: the prompt must be a non-empty string or a list of {{role, content}} messages, got {str(value)[:60]!r}")


class DatasetSource:
    """Tasks of one split of a dataset, indexable, with a checkpointed cursor."""

    def __init__(self, rows: Any, split: str, seed: int, *, family: str, prompt_key: str = "prompt",
                 shuffle: bool = True, name: str = "data", digest: str = "") -> None:
        if prompt_key not in rows.column_names:
            raise DataError(f"data.prompt_key: column {prompt_key!r} is not in the {split} data (columns: {rows.column_names})")
        if len(rows) == 0:
            raise DataError(f"data: the {split} data has no rows")
        self.rows, self.split, self.seed, self.family = rows, split, seed, family
        self.prompt_key, self.shuffle, self.name, self.digest = prompt_key, shuffle and split == "train", name, digest
        self.n = len(rows)
        self.cursor = 0
        self._orders: dict[int, list[int]] = {}

    @property
    def columns(self) -> list[str]:
        return list(self.rows.column_names)

    def __len__(self) -> int:
        return self.n

    def order(self, epoch: int) -> list[int]:
        """Row indices of ``epoch`` in visiting order."""
        if epoch not in self._orders:
            idx = list(range(self.n))
            if self.shuffle:
                random.Random(f"data/{self.seed}/{epoch}").shuffle(idx)
            self._orders = {epoch: idx}  # one epoch at a time is enough (the cursor only moves forward)
        return self._orders[epoch]

    def row_at(self, cursor: int) -> tuple[int, int]:
        """(epoch, row index) that cursor value ``cursor`` visits."""
        epoch, i = divmod(cursor, self.n)
        return epoch, self.order(epoch)[i]

    def task(self, row: int, epoch: int = 0) -> Task:
        data = dict(self.rows[row])
        check_prompt(data[self.prompt_key], f"data {self.split} row {row}, column {self.prompt_key!r}")
        data.update({"_row": row, "_epoch": epoch, "_prompt_key": self.prompt_key})
        pid = f"{self.name}/{self.split}/e{epoch}/{row}" if self.split == "train" else f"{self.name}/{self.split}/{row}"
        return Task(prompt_id=pid, family=self.family, split=self.split, data=data)

    def __getitem__(self, i: int) -> Task:
        if not 0 <= i < self.n:
            raise IndexError(f"{self.name}/{self.split}: index {i} outside [0, {self.n})")
        return self.task(i)

    def next(self) -> Task:
        if self.split != "train" and self.cursor >= self.n:
            raise StopIteration
        epoch, row = self.row_at(self.cursor) if self.split == "train" else (0, self.cursor)
        self.cursor += 1
        return self.task(row, epoch)

    def __iter__(self) -> Iterator[Task]:
        while self.split == "train" or self.cursor < self.n:
            yield self.next()

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "split": self.split, "seed": self.seed, "cursor": self.cursor,
                "rows": self.n, "digest": self.digest, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in ("name", "split", "seed", "rows", "digest", "shuffle"):
            if k in state and state[k] != getattr(self, "n" if k == "rows" else k):
                raise DataError(f"data: the checkpoint's {k} is {state[k]!r}, this run's is "
                                f"{getattr(self, 'n' if k == 'rows' else k)!r} (the dataset changed?)")
        self.cursor = int(state["cursor"])
