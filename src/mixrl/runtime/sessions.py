"""Rollout workers: the concurrent sessions of the prompts in flight.

``Sessions.issue(task)`` opens the prompt in the buffer and starts its G
sessions (asyncio tasks) with ``run_episode``; each finished trajectory is
screened once (``Trajectory.screen``: the verdict the advantages and the trainer
read) and goes into the buffer. Every turn goes through ``Fleet.generate`` (sticky routing,
retries across replicas), so a session lives through replica failures and
weight updates; each token keeps the version and group that produced it.

For checkpoints every session keeps a *shadow*: the turns it completed (the
request prefix, its sampling parameters and the result), grown into a partial
trajectory by the trajectory's own append methods. ``partials()`` turns the shadows into partial
trajectories at turn granularity, which ``run_episode(resume=...)`` replays
after a restart; a turn still being decoded at checkpoint time is decoded
again after resume. An environment whose replay gives other tokens than the
record (tools with timings or random output) restarts the episode from its
prompt: counted in ``resume_restarts`` and ``info["resume_restarted"]``.

Per-request seeds are derived from (run seed, request id): sampling does not
depend on which replica or batch serves a request, which makes sync runs
reproducible across a resume.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from mixrl.fleet.fleet import Fleet
from mixrl.records.generation import GenerationRequest, GenerationResult, SamplingParams
from mixrl.records.task import Task
from mixrl.records.trajectory import Trajectory
from mixrl.rollout.buffer import RolloutBuffer
from mixrl.rollout.session import SAMPLER_FAILURES, piece_cut, run_episode
from mixrl.system.seeds import stable_seed


def request_seed(run_seed: int, request_id: str) -> int:
    """A training request's sampling seed (``system.seeds.stable_seed`` of the run seed and request id)."""
    return stable_seed(run_seed, request_id)


def task_to_dict(task: Task) -> dict[str, Any]:
    return dataclasses.asdict(task)


def task_from_dict(d: dict[str, Any]) -> Task:
    return Task(**d)


@dataclasses.dataclass
class Shadow:
    prompt_id: str
    sample_idx: int
    task: str  # the task family
    base: Trajectory | None = None  # the partial this session was resumed from
    # (request prefix, its sampling params, result, whether the result is a cut piece of a turn that goes on)
    turns: list[tuple[list[int], SamplingParams, GenerationResult, bool]] = dataclasses.field(default_factory=list)

    def partial(self) -> Trajectory | None:
        """The completed turns as a partial trajectory (None before the first turn), grown by
        the trajectory's own append methods: what the session had built up to there."""
        if not self.turns:
            return self.base
        if self.base is not None:  # every later prefix extends the resumed tokens
            t = Trajectory.from_dict(self.base.to_dict())
        else:
            t = Trajectory(prompt_id=self.prompt_id, sample_idx=self.sample_idx, task=self.task)
        reasons = list(t.info.get("finish_reasons", []))
        for prefix, params, res, cut in self.turns:
            if prefix[: len(t.tokens)] != t.tokens:
                raise RuntimeError(f"session {self.prompt_id}#{self.sample_idx}: a request does not extend "
                                   "the tokens of the turns before it")
            t.append_env(prefix[len(t.tokens):])  # the prompt, or the env's answer to the last turn
            t.append_generated(res, params)
            if not cut:  # a cut piece has no finish reason of its own: its turn ends with a later piece
                reasons.append(res.finish_reason)
        t.turns = len(reasons)
        t.info["finish_reasons"] = reasons
        return t


class Sessions:
    def __init__(
        self,
        fleet: Fleet,
        buffer: RolloutBuffer,
        make_env: Callable[[Task], Any],
        params: SamplingParams,
        *,
        max_total_tokens: int,
        seed: int,
        on_complete: Callable[[str], None] | None = None,
        chunk_tokens: int = 0,
        check: tuple[int, str] | None = None,
    ):

        self._run_episode = run_episode
        self.fleet, self.buffer, self.make_env, self.params = fleet, buffer, make_env, params
        self.max_total_tokens, self.seed = max_total_tokens, seed
        self.on_complete = on_complete
        self.chunk_tokens = chunk_tokens  # > 0: interruptible turns (rollout.session.run_episode)
        self.check = check  # (vocab size, candidate kind): each trajectory is screened when complete
        self.tasks: dict[str, asyncio.Task[None]] = {}  # session id -> asyncio task
        self.shadows: dict[str, Shadow] = {}
        self.finished = 0  # sessions that delivered a trajectory
        self.resume_restarts = 0  # resumed episodes restarted because the env's replay differed
        self.errors: list[BaseException] = []

    def issue(self, task: Task, resume: dict[int, Trajectory] | None = None, *, min_version: int = -1) -> None:
        """Open ``task`` in the buffer and start its G sessions.

        ``min_version``: every turn is generated by a replica serving at least this
        weights version (the orchestrator's staleness admission sets it)."""
        self.buffer.open(task.prompt_id, task_to_dict(task))
        self.start_missing(task, resume or {}, min_version=min_version)

    def start_missing(self, task: Task, resume: dict[int, Trajectory], *, min_version: int = -1) -> None:
        """Start a session for every sample of an open prompt that has no trajectory."""
        for i in self.buffer.missing(task.prompt_id):
            sid = f"{task.prompt_id}#{i}"
            if sid in self.tasks:
                raise RuntimeError(f"session {sid} is already running")
            self.shadows[sid] = Shadow(task.prompt_id, i, task.family, base=resume.get(i))
            self.tasks[sid] = asyncio.ensure_future(self._session(task, i, sid, resume.get(i), min_version))

    async def _session(self, task: Task, idx: int, sid: str, resume: Trajectory | None, min_version: int) -> None:
        shadow = self.shadows[sid]

        async def generate(req: GenerationRequest) -> GenerationResult:
            # The seed depends only on the request id (prompt, sample, turn): replica-independent.
            req = dataclasses.replace(req, params=dataclasses.replace(req.params, seed=request_seed(self.seed, req.request_id)))
            res = await self.fleet.generate(sid, req, min_version)
            if res.finish_reason not in SAMPLER_FAILURES:  # a failed result ends the episode unrecorded
                shadow.turns.append((list(req.prompt_ids), req.params, res, piece_cut(req, res)))
            return res

        try:
            traj = await self._episode(task, idx, generate, resume)
            if resume is not None and traj.status == "infra_failed" and str(traj.info.get("error", "")).startswith(
                    "resume:"):
                # The environment gave other tokens on replay (its tools need not be
                # deterministic: timings, random output): the episode starts over from its
                # prompt, counted, rather than being lost as an infrastructure failure.
                self.resume_restarts += 1
                shadow.base, shadow.turns = None, []
                traj = await self._episode(task, idx, generate, None)
                traj.info["resume_restarted"] = 1
            reasons = traj.info.pop("finish_reasons", None) or []
            # cut by a limit: a reply at max_new_tokens, or the episode at its token budget
            traj.info["clipped"] = int(traj.status == "truncated" or "length" in reasons)
            if self.check is not None:  # the one check of the record (Trajectory.screen)
                traj.screen(*self.check)
            completed = self.buffer.add(traj)
            self.finished += 1
            if completed and self.on_complete is not None:
                self.on_complete(task.prompt_id)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a bug here must stop the run, not vanish in a task
            self.errors.append(e)
            if self.on_complete is not None:
                self.on_complete(task.prompt_id)
        finally:
            self.fleet.end_session(sid)
            self.tasks.pop(sid, None)
            self.shadows.pop(sid, None)

    async def _episode(self, task: Task, idx: int, generate: Callable[[GenerationRequest], Any],
                       resume: Trajectory | None) -> Trajectory:
        env = self.make_env(task)
        # An environment that drives its own episode (agent code sampling through the
        # in-run endpoint) has ``run_episode``; every other one is stepped by the runner.
        runner = getattr(env, "run_episode", None)
        if runner is not None:
            return await runner(generate, self.params, prompt_id=task.prompt_id, sample_idx=idx,
                                max_total_tokens=self.max_total_tokens, resume=resume)
        return await self._run_episode(
            env, generate, self.params, prompt_id=task.prompt_id, sample_idx=idx,
            max_total_tokens=self.max_total_tokens, resume=resume, chunk_tokens=self.chunk_tokens,
        )

    def inflight(self) -> int:
        return len(self.tasks)

    def partials(self) -> dict[str, dict[str, Any]]:
        """session id -> partial trajectory dict (sessions with at least one completed turn)."""
        out = {}
        for sid, sh in self.shadows.items():
            p = sh.partial()
            if p is not None:
                out[sid] = p.to_dict()
        return out

    async def cancel_all(self) -> None:
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
