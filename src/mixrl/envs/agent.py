"""Agents as environments: ordinary async code against the ``openai`` client, trained exactly.

    env.name = "openai_agent:examples/openai_agent/agent.py:run"

    async def run(client: openai.AsyncOpenAI, row: dict) -> float | tuple[float, dict]:
        reply = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...
        return reward                       # or (reward, info)

mixrl runs G copies of ``run`` per row concurrently, each with its own client
pointed at the in-run endpoint (``serve/endpoint.py``) under its own session
id. What trains is the endpoint's *record* of that session, never text the
agent sends back: prompt and tool tokens from the chat template (loss mask 0),
replies exactly as generated (per-token behaviour log-prob, version, group and
candidates). If the agent rewrote its history, only the last segment trains
and ``info["history_rewrites"]`` counts the others.

The run's sampling settings hold for every request (temperature, top-p, top-k
and candidate recording come from the run; an agent's own values are ignored,
``max_tokens`` is capped by ``rollout.max_new_tokens``), so the trainer's
corrections see the distribution that was really sampled.

Episode outcomes:

- ``run`` returns a finite reward: status ``ok``;
- the conversation outgrew ``rollout.max_total_tokens``: ``truncated``, reward 0
  (the model was too long), whatever the agent did next;
- ``run`` raises, times out (``env.options.timeout_s``), returns no usable
  reward, or never called the endpoint: ``agent_failed``, reward ``None`` —
  left out of advantages and counted, never a reward of 0.

Agent episodes are not replayed on resume: an episode cut by a checkpoint
starts again from its row.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import traceback
from collections.abc import Callable
from typing import Any

from mixrl.envs.base import Env, StepResult
from mixrl.envs.family import Family
from mixrl.envs.plugins import load_attr
from mixrl.records.generation import GenerationRequest, GenerationResult, SamplingParams
from mixrl.records.task import Task
from mixrl.records.trajectory import Trajectory
from mixrl.serve.endpoint import InRunEndpoint

PREFIX = "openai_agent:"


def load_agent(spec: str) -> Callable[..., Any]:
    """``path/to/agent.py:fn`` or ``package.module:fn`` -> the function (ValueError naming what is wrong)."""

    fn = load_attr(spec, what=f"env.name {PREFIX + spec!r}")
    if len(inspect.signature(fn).parameters) < 2:
        raise ValueError(f"env.name {PREFIX + spec!r}: {spec.rpartition(':')[2]}(client, row) must take two arguments")
    return fn  # type: ignore[no-any-return]


def _reward(out: Any) -> tuple[float | None, dict[str, Any]]:
    reward, info = (out if isinstance(out, tuple) and len(out) == 2 else (out, {}))
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return None, {"error": f"the agent returned {type(reward).__name__} {reward!r}, not a finite reward"}
    return float(reward), dict(info) if isinstance(info, dict) else {"agent_info": repr(info)[:200]}


class EndpointEnv(Env):
    """An episode played by code that samples through the in-run endpoint (``play``).

    The session runner calls ``run_episode`` instead of reset/step; the record of the
    episode's session is the trajectory."""

    def __init__(self, task: Task, chat: Any, *, timeout_s: float = 300.0, model: str = "policy",
                 max_body_mib: float = 4.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"env.options.timeout_s must be > 0, got {timeout_s}")
        if not max_body_mib > 0:  # the endpoint's request body limit (the first episode's starts it)
            raise ValueError(f"env.options.max_body_mib must be > 0, got {max_body_mib}")
        self.task, self.chat, self.timeout_s, self.model = task, chat, timeout_s, model
        self.max_body = int(max_body_mib * (1 << 20))

    async def play(self, base_url: str, api_key: str, session: str) -> Any:
        """Run the episode against the endpoint; return ``reward`` or ``(reward, info)``."""
        raise NotImplementedError

    async def reset(self) -> list[int]:
        raise TypeError("an endpoint episode is driven by run_episode, not reset/step")

    async def step(self, generated: list[int], finish_reason: str) -> StepResult:
        raise TypeError("an endpoint episode is driven by run_episode, not reset/step")

    async def run_episode(self, generate: Callable[[GenerationRequest], Any], params: SamplingParams, *,
                          prompt_id: str, sample_idx: int, max_total_tokens: int,
                          resume: Trajectory | None = None) -> Trajectory:

        ep = await InRunEndpoint.get(self.chat, max_total_tokens=max_total_tokens, record=params.record,
                                     model=self.model, max_body=self.max_body)
        turn = 0

        def adapt(requested: SamplingParams) -> SamplingParams:
            # the run's distribution (temperature, top-p/k, candidates); the agent's length and stops
            return dataclasses.replace(params, max_new_tokens=min(requested.max_new_tokens, params.max_new_tokens),
                                       stop_ids=requested.stop_ids, seed=requested.seed)

        async def run_params(req: GenerationRequest) -> GenerationResult:
            nonlocal turn
            turn += 1
            rid = f"{prompt_id}#{sample_idx}/agent{turn}/{req.request_id.rsplit('/', 1)[-1]}"
            return await generate(GenerationRequest(req.prompt_ids, req.params, request_id=rid))

        run_params.adapt = adapt  # type: ignore[attr-defined]
        status, reward, info = "ok", None, {}
        with ep.episode(run_params) as (session, base_url, api_key):
            try:
                out = await asyncio.wait_for(self.play(base_url, api_key, session), timeout=self.timeout_s)
                reward, info = _reward(out)
                status = "ok" if reward is not None else "agent_failed"
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                status, info = "agent_failed", {"error": f"the agent did not finish within {self.timeout_s} s"}
            except Exception as e:  # noqa: BLE001 - the agent's own failure: an episode error, never reward 0
                status = "agent_failed"
                info = {"error": f"{type(e).__name__}: {e}"[:500],
                        "traceback": "".join(traceback.format_exception(e))[-2000:]}
            truncated = ep.core.sessions.state(session).truncated
            traj, earlier = ep.core.sessions.finish(session)
        if traj is None:
            traj = Trajectory(prompt_id=prompt_id, sample_idx=sample_idx)
            if status == "ok":
                status, info = "agent_failed", {"error": "the agent never called the endpoint"}
        if truncated:
            status, reward = "truncated", 0.0
        traj.prompt_id, traj.sample_idx, traj.task = prompt_id, sample_idx, self.task.family
        traj.status = status
        traj.reward = reward if status in ("ok", "truncated") else None
        traj.info.update(info, history_rewrites=earlier)
        return traj

    async def close(self) -> None:
        pass


class OpenAIAgentEnv(EndpointEnv):
    """``agent(client, row)`` with an ``openai.AsyncOpenAI`` client of its own."""

    def __init__(self, task: Task, chat: Any, *, agent: Callable[..., Any], timeout_s: float = 300.0,
                 model: str = "policy", max_body_mib: float = 4.0) -> None:
        super().__init__(task, chat, timeout_s=timeout_s, model=model, max_body_mib=max_body_mib)
        self.agent = agent

    async def play(self, base_url: str, api_key: str, session: str) -> Any:
        import openai

        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=self.timeout_s,
                                    default_headers={"X-Session-ID": session})
        try:
            row = {k: v for k, v in self.task.data.items() if not k.startswith("_")}  # the dataset's columns
            return await self.agent(client, row)
        finally:
            await client.close()


def family(name: str, env_options: dict[str, Any] | None = None) -> Any:
    """The registry's family for ``env.name = "openai_agent:SPEC"``: rows come from ``[data]``
    (the options reach each env through ``make_env``)."""
    try:
        make_env = make_agent_family(name)
    except ValueError as e:
        raise ValueError(str(e)) from None
    return Family(name, None, make_env, 0)


def make_agent_family(name: str) -> Callable[..., OpenAIAgentEnv]:
    """``make_env(task, chat, **options)`` for ``env.name = "openai_agent:SPEC"``."""
    agent = load_agent(name[len(PREFIX):])

    def make_env(task: Task, chat: Any, timeout_s: float = 300.0, max_body_mib: float = 4.0) -> OpenAIAgentEnv:
        return OpenAIAgentEnv(task, chat, agent=agent, timeout_s=timeout_s, max_body_mib=max_body_mib)

    return make_env
