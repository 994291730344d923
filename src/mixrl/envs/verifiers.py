"""``verifiers`` environments, run unchanged through the in-run endpoint.

    env.name = "verifiers:MODULE"           # a module (or path/to/env.py) defining load_environment
    env.options = { ... }                   # passed to load_environment(**options)

The environment brings its dataset (``get_dataset()`` for training, its eval
dataset for held-out evaluation), its rollout protocol (single-turn, multi-turn,
tools) and its rubric. mixrl hands it a client config pointing at the in-run
OpenAI-compatible endpoint (``api_base_url``, the run's API key, the episode's
``X-Session-ID`` header), calls ``run_rollout`` for each of the G samples of a
row, and trains on the endpoint's exact record of that session with the
rubric's reward. A rollout that errors (``output["error"]``) or raises is
``agent_failed``: counted, left out of advantages, never a reward of 0.

Rows of the training set are visited in a seeded shuffle per epoch.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import random
from typing import Any

from mixrl.envs.agent import EndpointEnv
from mixrl.envs.family import Family
from mixrl.envs.plugins import load_module
from mixrl.records.task import Task

PREFIX = "verifiers:"
KEY_VAR = "MIXRL_ENDPOINT_API_KEY"  # verifiers reads the key from an environment variable


def _module(spec: str) -> Any:

    return load_module(spec, what=f"env.name {PREFIX + spec!r}")


@functools.cache
def _load(spec: str, options_json: str) -> Any:
    if importlib.util.find_spec("verifiers") is None:
        raise ValueError(f"env.name {PREFIX + spec!r} needs the verifiers package (pip install verifiers)")
    load = getattr(_module(spec), "load_environment", None)
    if not callable(load):
        raise ValueError(f"env.name {PREFIX + spec!r}: the module has no load_environment(**options)")
    try:
        return load(**json.loads(options_json))
    except TypeError as e:
        raise ValueError(f"env.options for {PREFIX + spec!r}: load_environment rejected them: {e}") from None


def _env_of(spec: str, options: dict[str, Any]) -> Any:
    return _load(spec, json.dumps({k: v for k, v in options.items() if k != "timeout_s"}, sort_keys=True))


def _rows(vf_env: Any, split: str) -> list[dict[str, Any]]:
    if split == "train":
        ds = vf_env.get_dataset()
    else:
        try:
            ds = vf_env.get_eval_dataset()
        except ValueError:  # no eval dataset: the environment has no held-out split
            return []
    return [dict(r) for r in ds] if ds is not None else []


class VerifiersEnv(EndpointEnv):
    """One rollout of a verifiers environment, scored by its rubric."""

    def __init__(self, task: Task, chat: Any, *, vf_env: Any, timeout_s: float = 300.0) -> None:
        super().__init__(task, chat, timeout_s=timeout_s)
        self.vf_env = vf_env

    async def play(self, base_url: str, api_key: str, session: str) -> Any:
        from verifiers.types import ClientConfig

        os.environ[KEY_VAR] = api_key
        client = ClientConfig(api_base_url=base_url, api_key_var=KEY_VAR, extra_headers={"X-Session-ID": session},
                              max_retries=0, timeout=self.timeout_s)
        row = self.task.data
        rollout_input = {"prompt": row["prompt"], "example_id": int(row.get("example_id", 0)),
                         "answer": row.get("answer", ""), "info": row.get("info") or {}}
        if row.get("task") is not None:
            rollout_input["task"] = row["task"]
        out = await self.vf_env.run_rollout(rollout_input, client, self.model, {})
        if out.get("error"):
            raise RuntimeError(f"the verifiers rollout failed: {str(out['error'])[:300]}")
        metrics = {k: float(v) for k, v in (out.get("metrics") or {}).items() if isinstance(v, (int, float))}
        return out["reward"], {"rubric": metrics}


def family(name: str, env_options: dict[str, Any]) -> Any:
    """The registry's family for ``env.name = "verifiers:SPEC"``: tasks are the environment's rows
    (``load_environment(**env_options)``)."""

    spec = name[len(PREFIX):]
    if not spec:
        raise ValueError(f"env.name {name!r}: expected {PREFIX}MODULE or {PREFIX}path/to/env.py")
    _module(spec)  # fails now, at --dry-run, if the module is not there

    def options() -> dict[str, Any]:
        return dict(env_options)

    def make_task(seed: int, split: str, index: int) -> Task:
        rows = _rows(_env_of(spec, options()), split)
        if not rows:
            raise ValueError(f"{name}: the environment has no {split} rows")
        if split == "train":  # a seeded shuffle per epoch
            epoch, i = divmod(index, len(rows))
            order = list(range(len(rows)))
            random.Random(f"{seed}/{epoch}").shuffle(order)
            row, pid = rows[order[i]], f"{name}/train/e{epoch}/{order[i]}"
        else:
            row, pid = rows[index], f"{name}/{split}/{index}"
        return Task(prompt_id=pid, family=name, split=split, data=row)

    def make_env(task: Task, chat: Any, **opts: Any) -> VerifiersEnv:
        return VerifiersEnv(task, chat, vf_env=_env_of(spec, opts), timeout_s=float(opts.get("timeout_s", 300.0)))

    def check_options(opts: dict[str, Any]) -> None:
        _env_of(spec, opts)  # load_environment(**options) now: a bad option is one line at --dry-run

    make_env.check_options = check_options  # type: ignore[attr-defined]
    try:
        heldout = len(_rows(_env_of(spec, options()), "heldout"))
    except ValueError:
        heldout = 0
    return Family(name, make_task, make_env, heldout)
