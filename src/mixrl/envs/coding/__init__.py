"""Agentic coding: SWE-style bug fixes with a bash tool in a bubblewrap sandbox.

- ``env.py``: ``CodingEnv`` (rules of an episode), ``tools.py``: tool-call parsing;
- ``grade.py``: the diff applied to a fresh snapshot and checked, in one of two forms:
  ``oracle.py`` (values computed in the sandbox by ``oracle_child.py``, judged outside it;
  every bundled task) or ``pytest_runner.py`` (hidden tests restored and run, their
  expected values kept outside the sandbox by ``expect.py``, with the canary tests of
  ``canary.py``; verdicts in ``results.py``);
- ``loader.py``: instances (``tasks/<id>/``), ``load_tasks``, ``split_tasks``;
- ``mixrl.envs.sandbox``: the sandbox itself.

Importing this package registers the family ``"coding"`` with
``mixrl.envs.registry`` (``mixrl train --set env=coding``). Train indices
cycle through the train instances in a seeded order per epoch; held-out
index ``i`` is the ``i``-th held-out instance.

Adding a task: create ``tasks/<instance_id>/`` as described in ``loader.py``
(every repository and test file with an extra ``.txt`` suffix), then run
``pytest tests/test_coding_tasks.py``: it checks, in both grading forms, that the
reference patch earns reward 1 and the untouched snapshot 0 with exactly FAIL_TO_PASS
failing, and that the reference grades well within its time limit.
"""

from __future__ import annotations

import functools
import random

from mixrl.envs.coding.env import CodingEnv
from mixrl.envs.coding.loader import load_tasks, split_tasks
from mixrl.envs.family import Family
from mixrl.records.task import Task

__all__ = ["CodingEnv", "bundled_tasks", "load_tasks", "make_task", "split_tasks"]


@functools.lru_cache(maxsize=1)
def bundled_tasks() -> tuple[tuple[Task, ...], tuple[Task, ...]]:
    """(train, heldout) bundled instances, loaded once per process."""
    train, heldout = split_tasks(load_tasks())
    return tuple(train), tuple(heldout)


def make_task(seed: int, split: str, index: int) -> Task:
    """Task ``index`` of ``split``: deterministic in (seed, split, index)."""
    train, heldout = bundled_tasks()
    if split == "heldout":
        if not 0 <= index < len(heldout):
            raise IndexError(f"coding: held-out index {index} outside [0, {len(heldout)})")
        base = heldout[index]
    elif split == "train":
        epoch, k = divmod(index, len(train))
        order = list(range(len(train)))
        random.Random(f"coding/{seed}/{epoch}").shuffle(order)
        base = train[order[k]]
    else:
        raise ValueError(f"coding.make_task: split must be 'train' or 'heldout', got {split!r}")
    return Task(prompt_id=f"coding/{split}/s{seed}/{index}", family="coding", split=split, data=dict(base.data))


def family(name: str) -> Family:
    """The registry's family for ``env.name = "coding"`` (imported on first use)."""
    return Family(name, make_task, CodingEnv, heldout_size=len(bundled_tasks()[1]))
