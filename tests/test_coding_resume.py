"""A resumed coding episode whose tool output differs on replay (a command with random
output) is restarted from its prompt by the sessions, counted, never ``infra_failed``."""

from __future__ import annotations

import asyncio

import pytest
from sandbox_tables import needs_bwrap

from mixrl.envs.coding import CodingEnv, bundled_tasks
from mixrl.models.chat import ChatFormat
from mixrl.models.tokenizer import build_tokenizer
from mixrl.records.generation import GenerationRequest, GenerationResult, SamplingParams
from mixrl.records.trajectory import Trajectory
from mixrl.rollout.buffer import RolloutBuffer
from mixrl.rollout.session import run_episode
from mixrl.runtime.sessions import Sessions

pytest_plugins = ("sandbox_tables",)  # private_root: each test's own episode root
pytestmark = [pytest.mark.sandbox, needs_bwrap, pytest.mark.usefixtures("private_root")]

FIX = "sed -i 's/len(text) < width/len(text) <= width/' textkit/truncate.py"
REPLIES = ["<bash>od -An -N8 -tx8 /dev/urandom</bash>", f"<bash>{FIX}</bash>", "<submit/>"]
PARAMS = SamplingParams(max_new_tokens=256)


class ScriptedFleet:
    """The fleet's session interface, answering turn k (from the request id) with REPLIES[k]."""

    def __init__(self, chat: ChatFormat) -> None:
        self.chat, self.requests = chat, 0

    async def generate(self, sid: str, req: GenerationRequest, min_version: int = -1) -> GenerationResult:
        self.requests += 1
        ids = self.chat.assistant(REPLIES[int(req.request_id.rsplit("/", 1)[1])])[: req.params.max_new_tokens]
        n = len(ids)
        return GenerationResult(ids, [0.0] * n, [0] * (n + 1), [], [], "none", 0, "scripted", "stop")

    def end_session(self, sid: str) -> None:
        pass


def _after_first_tool_turn(full: Trajectory) -> Trajectory:
    """The record a checkpoint holds after turn 1 (its command's output included)."""
    mask = full.loss_mask
    first_gen_end = mask.index(1) + mask[mask.index(1):].index(0)
    n = first_gen_end + mask[first_gen_end:].index(1)  # up to the second generated turn
    part = Trajectory.from_dict({**full.to_dict(), "info": {"finish_reasons": ["stop"]}})
    for f in ("tokens", "loss_mask", "sampler_logprobs", "versions", "groups"):
        setattr(part, f, getattr(part, f)[:n])
    part.cand_offsets = part.cand_offsets[: sum(part.loss_mask) + 1]
    part.turns, part.status, part.reward = 1, "ok", None
    return part


def test_resumed_episode_with_random_tool_output_restarts():
    chat = ChatFormat(build_tokenizer())
    task = next(t for t in sum(bundled_tasks(), ()) if t.data["instance_id"] == "textkit-truncate")
    fleet = ScriptedFleet(chat)

    async def gen(req: GenerationRequest) -> GenerationResult:
        return await fleet.generate("s", req)

    full = asyncio.run(run_episode(CodingEnv(task, chat), gen, PARAMS, prompt_id=task.prompt_id, sample_idx=0,
                                   max_total_tokens=30_000))
    assert (full.status, full.reward) == ("ok", 1.0)
    part = _after_first_tool_turn(full)
    # the runner alone flags it (the replayed command printed other random bytes) ...
    again = asyncio.run(run_episode(CodingEnv(task, chat), gen, PARAMS, prompt_id=task.prompt_id, sample_idx=0,
                                    max_total_tokens=30_000, resume=part))
    assert again.status == "infra_failed" and again.info["error"].startswith("resume: env tokens differ")

    # ... the sessions restart it from its prompt, counted
    async def through_sessions():  # type: ignore[no-untyped-def]
        buf = RolloutBuffer(1)
        s = Sessions(fleet, buf, lambda t: CodingEnv(t, chat), PARAMS, max_total_tokens=30_000, seed=0)
        s.issue(task, resume={0: part})
        await asyncio.gather(*list(s.tasks.values()))
        return s, buf

    s, buf = asyncio.run(through_sessions())
    assert not s.errors and s.resume_restarts == 1 and s.finished == 1
    taken = buf.take(1, trainer_version=0)
    assert taken is not None
    ((traj,),), _ = taken
    assert (traj.status, traj.reward, traj.turns, traj.info["resume_restarted"]) == ("ok", 1.0, 3, 1)
    assert traj.tokens[: len(part.tokens)] != part.tokens  # a new episode, with its own random output
