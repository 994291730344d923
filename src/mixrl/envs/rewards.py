"""User reward functions, as written for TRL or verl, scored one episode at a time.

    [reward]
    function = "reward.py:exact_match"        # a file next to the config, or "package.module:fn"
    # functions = ["reward.py:exact_match", "reward.py:short"]; weights = [1.0, 0.1]

Two signatures are accepted unchanged, told apart by the parameter names:

- TRL's: ``fn(completions, prompts=None, **columns) -> list[float]`` (sync or
  ``async``); ``completions``/``prompts`` are lists (here of one item) and
  every dataset column comes as a keyword with a list of values;
- verl's: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``
  returning a float or a dict with ``"score"``; ``ground_truth`` is the row's
  ``ground_truth``, ``reward_model.ground_truth`` or ``answer`` column.

The total reward is the weighted sum. A function that raises, or returns
None / NaN / the wrong number of values for the item, fails the episode's
reward: ``RewardFailed`` (the environment ends the episode with status
``reward_failed``, reward None, which is left out of advantages and counted,
never scored 0). The first failure of each function is logged once, with its
row index and traceback, to the ``mixrl.reward`` logger (the run log). What
the run does then is ``reward.on_error`` (``rollout.failures``): ``"fail"``
(the default) stops it with that one line, ``"skip"`` leaves such episodes out.

:meth:`Rewards.try_rows` calls every function on real dataset rows before a
run starts (``mixrl train`` and ``--dry-run``): a function that cannot score
an empty reply or a short one on those rows is refused there, as a
``RewardError`` naming the function, the row and the error.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mixrl.envs.plugins import load_attr

log = logging.getLogger("mixrl.reward")
_VERL = ("solution_str", "ground_truth")
PROBE_REPLIES = ("", "I think the answer is 42.")  # an empty reply and a plain one: both happen


class RewardError(ValueError):
    """A reward spec that cannot be loaded (user error: one line)."""


class RewardFailed(Exception):
    """The reward of one episode could not be computed."""


def load_function(spec: str) -> Callable[..., Any]:
    """``"path/to/file.py:name"`` or ``"package.module:name"`` -> the callable."""

    return load_attr(spec, what=f"reward function {spec!r}", error=RewardError)  # type: ignore[no-any-return]


@dataclass
class RewardFunction:
    """One user reward function, loaded from a spec, called with TRL's or verl's signature."""

    spec: str
    fn: Callable[..., Any]
    weight: float = 1.0
    style: str = "trl"  # "trl" | "verl"
    params: set[str] = field(default_factory=set)
    var_kw: bool = False
    failures: int = 0

    @classmethod
    def load(cls, spec: str, weight: float = 1.0) -> RewardFunction:
        """Load ``spec`` (``file.py:name`` or ``module:name``) and detect its signature style."""
        fn = load_function(spec)
        sig = inspect.signature(fn)
        params = {n for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        style = "verl" if all(n in params for n in _VERL) else "trl"
        if style == "trl" and "completions" not in params and not var_kw:
            raise RewardError(f"reward function {spec!r}: takes neither TRL's 'completions' nor verl's "
                              f"(solution_str, ground_truth); its parameters are {sorted(params)}")
        return cls(spec, fn, weight, style, params, var_kw)

    def check_columns(self, columns: list[str]) -> None:
        """Every required parameter must be something we pass (TRL style: a dataset column)."""
        if self.style != "trl":
            return
        have = {"completions", "prompts", "completion_ids", "trainer_state", *columns}
        sig = inspect.signature(self.fn)
        missing = [n for n, p in sig.parameters.items()
                   if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in have]
        if missing:
            raise RewardError(f"reward function {self.spec!r}: needs {missing}, which are not dataset columns (columns: {columns})")

    def _call_args(self, completion: str, prompt: Any, row: dict[str, Any]) -> dict[str, Any]:
        cols = {k: v for k, v in row.items() if not k.startswith("_")}
        if self.style == "verl":
            gt = cols.get("ground_truth")
            if gt is None and isinstance(cols.get("reward_model"), dict):
                gt = cols["reward_model"].get("ground_truth")
            if gt is None:
                gt = cols.get("answer")
            extra = cols.get("extra_info")
            extra = {**extra, "index": row.get("_row")} if isinstance(extra, dict) else {"index": row.get("_row")}
            kw = {"data_source": cols.get("data_source", "mixrl"), "solution_str": completion,
                  "ground_truth": gt, "extra_info": extra}
            return {k: v for k, v in kw.items() if k in self.params or self.var_kw}
        kw = {k: [v] for k, v in cols.items() if k != row.get("_prompt_key")}
        kw.update({"completions": [completion], "prompts": [prompt]})
        return kw if self.var_kw else {k: v for k, v in kw.items() if k in self.params}

    async def score(self, completion: str, prompt: Any, row: dict[str, Any], *, count: bool = True) -> float:
        """The function's reward for one completion; raises ``RewardFailed`` on an exception or a non-finite value
        (``count=False``: neither counted nor logged, the caller reports it)."""
        try:
            out = self.fn(**self._call_args(completion, prompt, row))
            if inspect.isawaitable(out):
                out = await out
            if self.style == "verl":
                value = out.get("score") if isinstance(out, dict) else out
            else:
                if not isinstance(out, list | tuple) or len(out) != 1:
                    raise TypeError(f"expected a list of 1 float, got {str(out)[:60]}")
                value = out[0]
            if value is None:
                raise ValueError("returned None")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
            return value
        except Exception as e:
            if not count:
                raise RewardFailed(f"reward function {self.spec!r} failed on row {row.get('_row')}: "
                                   f"{type(e).__name__}: {e}") from e
            self.failures += 1
            if self.failures == 1:
                log.error("reward function %s failed on row %s (first failure; later ones are only counted):\n%s",
                          self.spec, row.get("_row"), traceback.format_exc())
            raise RewardFailed(f"reward function {self.spec!r} failed on row {row.get('_row')}: "
                               f"{type(e).__name__}: {e}") from None


class Rewards:
    """The configured reward functions; ``await rewards.score(completion, prompt, row)``."""

    def __init__(self, specs: list[str], weights: list[float] | None = None, on_error: str = "fail") -> None:
        ws = weights if weights is not None else [1.0] * len(specs)
        self.functions = [RewardFunction.load(s, w) for s, w in zip(specs, ws, strict=True)]
        self.on_error = on_error  # reward.on_error: "fail" | "skip" (rollout.failures)

    def __bool__(self) -> bool:
        return bool(self.functions)

    def check_columns(self, columns: list[str]) -> None:
        """Refuse reward functions that ask for a column the dataset lacks."""
        for f in self.functions:
            f.check_columns(columns)

    async def score(self, completion: str, prompt: Any, row: dict[str, Any]) -> float:
        """The weighted sum of every function's reward for one completion."""
        total = 0.0
        for f in self.functions:
            total += f.weight * await f.score(completion, prompt, row)
        return total

    def try_rows(self, rows: list[tuple[Any, dict[str, Any]]], split: str) -> None:
        """Call every function on each ``(prompt, row)`` with an empty and a short reply; a failure
        raises ``RewardError`` (one line: the function, the split and row, the error)."""
        async def run() -> None:
            for prompt, row in rows:
                for reply in PROBE_REPLIES:
                    for f in self.functions:
                        try:
                            await f.score(reply, prompt, row, count=False)
                        except RewardFailed as e:
                            c = e.__cause__
                            raise RewardError(f"reward function {f.spec!r} failed on {split} row {row.get('_row')} "
                                              f"(reply {reply!r}): {type(c).__name__}: {c}") from c

        asyncio.run(run())

    def failures(self) -> dict[str, int]:
        """Failed calls per function spec."""
        return {f.spec: f.failures for f in self.functions}
