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

Adding a family (the hook ``envs/coding`` uses): give your module

    def family(name) -> Family(name, make_task=fn(seed, split, index) -> Task,
                               make_env=fn(task, chat, **cfg) -> Env, heldout_size=N)

and add ``name -> module`` to ``LAZY_FAMILIES``: the registry imports it and
calls ``family`` on first use (``"coding" -> "mixrl.envs.coding"`` is there
already); ``register_family`` adds one directly. ``make_env`` passes only the ``cfg`` keys that the family's
factory accepts, so one config can serve a mix of families; ``check_env``
(run at ``--dry-run``) rejects a key no part accepts, naming the valid ones.

Your own environment, without touching this file: ``env.name =
"package.module:MyEnv"`` (an ``Env`` or ``MessageEnv`` subclass, built as
``MyEnv(task, chat, **env.options)``), or an entry point in the ``mixrl.envs``
group (``[project.entry-points."mixrl.envs"] myenv = "pkg.mod:MyEnv"``).
With ``[data]`` configured (``activate(cfg)``, called by the runtime), tasks
come from the dataset rows (``mixrl.data``) whatever the environment, and
``env.name = "dataset"`` scores replies with the ``[reward]`` functions.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import json
from collections.abc import Callable, Iterator
from typing import Any

from mixrl.data import has_heldout, open_split
from mixrl.envs import calc, dataset, reverse, upper
from mixrl.envs.base import Env
from mixrl.envs.family import Active, Family
from mixrl.envs.plugins import load_module
from mixrl.envs.rewards import Rewards
from mixrl.models.chat import ChatFormat
from mixrl.records.task import Task

SPLITS = ("train", "heldout")
TRAIN_SIZE = 10**9  # train sources are effectively endless


FAMILIES: dict[str, Family] = {}
_PREFIXED_BUILT: dict[tuple[str, str], Family] = {}  # (name, env options) -> family
LAZY_FAMILIES: dict[str, str] = {"coding": "mixrl.envs.coding"}
# Environments named by a prefix, built by a module imported on first use (its ``family(name)``):
# ``openai_agent:PATH.py:FUNCTION`` runs agent code written against the openai client.
# ``verifiers:MODULE`` runs a verifiers environment (its dataset, rollout and rubric).
PREFIXED: dict[str, str] = {"openai_agent:": "mixrl.envs.agent", "verifiers:": "mixrl.envs.verifiers"}
MIXES: dict[str, tuple[str, ...]] = {"mix": ("calc", "upper")}


def register_family(
    name: str,
    make_task: Callable[[int, str, int], Task] | None,
    make_env: Callable[..., Env],
    heldout_size: int = 200,
) -> None:
    """Register (or replace) a task family under ``name``."""
    FAMILIES[name] = Family(name, make_task, make_env, heldout_size)


register_family("calc", calc.make_task, calc.CalcEnv, heldout_size=200)
register_family("upper", upper.make_task, upper.UpperEnv, heldout_size=200)
register_family("reverse", reverse.make_task, reverse.ReverseEnv, heldout_size=200)


register_family("dataset", None, dataset.DatasetEnv, heldout_size=0)
ENTRY_POINT_GROUP = "mixrl.envs"


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def known_names() -> list[str]:
    """Every environment name ``env.name`` accepts (besides ``package.module:Class``)."""
    return sorted(set(FAMILIES) | set(LAZY_FAMILIES) | set(MIXES) | set(_entry_points()))


def _plugin(name: str, target: Any) -> Family:
    make_task = getattr(target, "make_task", None)
    family = Family(name, make_task if callable(make_task) else None, target,
                    int(getattr(target, "heldout_size", 0) or 0))
    FAMILIES[name] = family
    return family


def _import_target(name: str) -> Any:
    """``package.module:Class`` or ``path/to/file.py:Class`` -> the class (or factory)."""
    mod, _, attr = name.rpartition(":")
    obj: Any = load_module(mod, what=f"env.name {name!r}")
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"env.name {name!r}: {mod} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"env.name {name!r}: {attr} is not a class or factory")
    return obj


def _env_classes(path: str) -> str:
    """The Env subclasses a file defines, for the line that refuses the bare file ('Class' if none)."""
    try:
        module = load_module(path, what=f"env.name {path!r}")
    except ValueError:
        return "Class"
    names = [k for k, v in vars(module).items()
             if isinstance(v, type) and issubclass(v, Env) and v.__module__ == module.__name__]
    return "|".join(names) or "Class"


def get_family(name: str, options: dict[str, Any] | None = None) -> Family:
    """The family ``name``; a prefixed one (``verifiers:``, ``openai_agent:``) is built for the run's
    env ``options`` (its tasks may depend on them), once per (name, options)."""
    if name not in FAMILIES and name in LAZY_FAMILIES:
        FAMILIES[name] = importlib.import_module(LAZY_FAMILIES[name]).family(name)
    for prefix, module in PREFIXED.items():
        if name not in FAMILIES and name.startswith(prefix):
            key = (name, json.dumps(options or {}, sort_keys=True, default=str))
            if key not in _PREFIXED_BUILT:
                _PREFIXED_BUILT[key] = importlib.import_module(module).family(name, dict(options or {}))
            return _PREFIXED_BUILT[key]
    if name not in FAMILIES and ":" in name:
        return _plugin(name, _import_target(name))
    if name not in FAMILIES and name.endswith(".py"):
        load_module(name, what=f"env.name {name!r}")  # not found / does not import: that line
        raise ValueError(f"env.name {name!r} is a file: name the environment class in it, as "
                         f"'{name}:{_env_classes(name)}'")
    if name not in FAMILIES:
        eps = _entry_points()
        if name in eps:
            return _plugin(name, eps[name].load())
        raise ValueError(f"unknown task family {name!r}; known: {known_names()} (or an Env class as 'package.module:Class')")
    return FAMILIES[name]


def _accepted(factory: Callable[..., Any]) -> frozenset[str] | None:
    """Option names ``factory(task, chat, **options)`` accepts (None: any, it takes **kwargs)."""
    try:  # asked once per session: the signature does not change
        return _accepted_cached(factory)
    except TypeError:  # an unhashable callable
        return _signature_options(factory)


@functools.lru_cache(maxsize=256)
def _accepted_cached(factory: Callable[..., Any]) -> frozenset[str] | None:
    return _signature_options(factory)


def _signature_options(factory: Callable[..., Any]) -> frozenset[str] | None:
    params = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(n for n, p in list(params.items())[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_env(name: str, options: dict[str, Any], has_data: bool) -> None:
    """Raise ``ValueError`` (one line, with the valid choices) for a bad name or option."""
    try:
        fams = [get_family(n, options) for n in MIXES.get(name, (name,))]
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith("env.name") else f"env.name: {e}") from None
    if not has_data and any(f.make_task is None for f in fams):
        raise ValueError(f"env.name {name!r} takes its prompts from a dataset: set data.train")
    for f in fams:  # a family's own check (one that takes any options checks them itself)
        check = getattr(f.make_env, "check_options", None)
        if callable(check):
            check(options)
    valid: set[str] = set()
    for f in fams:
        acc = _accepted(f.make_env)
        if acc is None:
            return
        valid |= acc
    bad = sorted(set(options) - valid)
    if bad:
        raise ValueError(f"env.options: unknown option(s) {bad} for environment {name!r}; valid: {sorted(valid)}")


def activate(cfg: Any) -> Active:
    """``cfg``'s ``[data]``, ``[reward]`` and ``env.options``, checked, for the caller to pass to
    ``make_task_source`` and ``make_env``.

    Raises ``ValueError`` / ``DataError`` / ``RewardError`` (user errors, one line).
    """

    has_data = cfg.data.train is not None
    check_env(cfg.env.name, dict(cfg.env.options), has_data)
    rewards = Rewards(cfg.reward.specs(), cfg.reward.weights, cfg.reward.on_error) if cfg.reward.specs() else None
    if cfg.env.name == "dataset" and rewards is None:
        raise ValueError('env.name "dataset" scores replies with reward functions: set reward.function')
    active = Active((cfg.data if has_data else None), rewards, dict(cfg.env.options), cfg.runtime.seed)
    if has_data:
        src = open_split(cfg.data, "train", cfg.runtime.seed, cfg.env.name, active.split_seed)
        if rewards is not None:
            rewards.check_columns(src.columns)
    return active


def try_rewards(cfg: Any, active: Active, rows: int = 2) -> None:
    """Call the run's reward functions on its first ``rows`` train rows and first held-out row
    (``Rewards.try_rows``); raises ``RewardError`` (one line) when one fails."""

    if active.rewards is None or active.data is None:
        return
    for split, n in (("train", rows), ("heldout", 1)):
        if split == "heldout" and not has_heldout(active.data):
            continue
        src = open_split(active.data, split, cfg.runtime.seed, cfg.env.name, active.split_seed)
        tasks = [src.task(i) for i in range(min(n, len(src)))]
        active.rewards.try_rows([(t.data[src.prompt_key], t.data) for t in tasks], split)


class TaskSource:
    """Tasks of one family (or a mix) and split, indexable, with a cursor.

    ``source[i]`` is deterministic in (name, split, seed, i). ``next()``
    returns ``source[cursor]`` and advances; ``state_dict()`` /
    ``load_state_dict()`` save and restore the cursor, so a resumed run neither
    skips nor repeats a task. Held-out sources are finite (``len``), train
    sources endless; iteration starts at the cursor and advances it.
    """

    def __init__(self, name: str, split: str, seed: int, size: int | None = None,
                 options: dict[str, Any] | None = None) -> None:
        if split not in SPLITS:
            raise ValueError(f"TaskSource.split must be one of {SPLITS}, got {split!r}")
        self.name, self.split, self.seed = name, split, seed
        self.parts = [get_family(n, options) for n in MIXES.get(name, (name,))]
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
        assert fam.make_task is not None  # checked in make_task_source
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


def make_task_source(name: str, split: str, seed: int = 0, size: int | None = None,
                     active: Active | None = None) -> Any:
    """A ``TaskSource`` for a family name or a mix (``"mix"``); the dataset's rows when the run's
    inputs (``active``, from ``activate``) have one."""
    active = active or Active()
    if active.data is not None:
        return open_split(active.data, split, seed, name, active.split_seed)
    if name not in MIXES and get_family(name, active.options).make_task is None:
        raise ValueError(f"environment {name!r} takes its prompts from a dataset: set data.train")
    return TaskSource(name, split, seed, size, active.options)


def make_env(task: Task, chat: ChatFormat, active: Active | None = None, **cfg: Any) -> Env:
    """The environment of ``task``'s family with the run's env options and reward functions
    (``active``); ``cfg`` overrides options; unknown keys are ignored per family."""
    active = active or Active()
    factory = get_family(task.family, active.options).make_env
    cfg = {**(active.options or {}), **cfg}
    acc = _accepted(factory)
    if acc is not None:
        cfg = {k: v for k, v in cfg.items() if k in acc}
    env = factory(task, chat, **cfg)
    if active.rewards is not None and getattr(env, "rewards", None) is None:
        env.rewards = active.rewards  # type: ignore[attr-defined]
    return env
