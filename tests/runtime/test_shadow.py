"""A checkpoint's partial trajectory is the trajectory the session had built.

``Shadow`` keeps each completed request and result of a session and grows the
partial with the trajectory's own append methods. Resuming ``run_episode`` from
that partial must give, field by field, the trajectory of the uninterrupted
episode: tokens, per-token records, candidates, MoE routing, non-finite counts and
the per-result sampling records (timings aside). Checkpoints are taken after
every request, with whole turns and with turns cut into interruptible pieces.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from mixrl.envs.calc import CalcEnv
from mixrl.models.chat import ChatFormat
from mixrl.models.tokenizer import build_tokenizer
from mixrl.records.generation import GenerationRequest, GenerationResult, SamplingParams
from mixrl.records.task import Task
from mixrl.records.trajectory import Trajectory
from mixrl.rollout.session import piece_cut, run_episode
from mixrl.runtime.sessions import Shadow

CHAT = ChatFormat(build_tokenizer())
TASK = Task("calc/t/0", "calc", "train", {"question": "What is 12*7+3?", "expr": "12*7+3", "answer": 87})
TURNS = [CHAT.encode(t) + [CHAT.end_of_turn_id] for t in ("<calc>12*7+3</calc>", "<answer>87</answer>")]
PARAMS = SamplingParams(max_new_tokens=32, temperature=0.8)


async def engine(req: GenerationRequest) -> GenerationResult:
    """A deterministic engine: the result depends only on the request (turn and tokens so far)."""
    turn = int(req.request_id.split("/")[-1].split("@")[0].rstrip("~"))
    done = len(req.prompt_ids)  # distinct per piece: every piece gets its own records
    ids = TURNS[turn]
    start = int(req.request_id.split("@")[1].rstrip("~")) if "@" in req.request_id else 0
    ids = ids[start:start + req.params.max_new_tokens]
    n = len(ids)
    lp = [-0.05 - 0.01 * ((done + j) % 7) for j in range(n)]
    routed = [[[(done + j) % 4, (done + j + 1) % 4], [j % 4, (j + 2) % 4]] for j in range(n)]  # [n][2 layers][k=2]
    fin = "stop" if ids[-1] in req.params.stop_ids else "length"
    return GenerationResult(ids, lp, [2 * j for j in range(n + 1)], [x for t in ids for x in (t, 0)],
                            [x for v in lp for x in (v, -6.0)], "support", version=3 + turn, group=f"g{done % 2}",
                            finish_reason=fin, num_nonfinite=done % 3, routed_experts=routed)


def run(chunk: int, resume: Trajectory | None = None, snap_after: int = -1) -> tuple[Trajectory, Trajectory | None]:
    """The episode, and the shadow's partial taken after ``snap_after`` requests (as Sessions records them)."""
    shadow = Shadow(TASK.prompt_id, 1, TASK.family, base=resume)
    snap: list[Trajectory | None] = [None]

    async def generate(req: GenerationRequest) -> GenerationResult:
        res = await engine(req)
        shadow.turns.append((list(req.prompt_ids), req.params, res, piece_cut(req, res)))
        if len(shadow.turns) == snap_after:
            p = shadow.partial()
            snap[0] = Trajectory.from_dict(p.to_dict()) if p is not None else None  # as a checkpoint holds it
        return res

    tr = asyncio.run(run_episode(CalcEnv(TASK, CHAT), generate, PARAMS, prompt_id=TASK.prompt_id, sample_idx=1,
                                 max_total_tokens=200, resume=resume, chunk_tokens=chunk))
    return tr, snap[0]


@pytest.mark.parametrize("chunk", [0, 4])
def test_resumed_partial_equals_uninterrupted_field_by_field(chunk: int) -> None:
    full, _ = run(chunk)
    assert full.status == "ok" and full.reward == 1.0 and full.routed_experts is not None
    assert full.num_nonfinite > 0 and len(full.info["sampling"]) >= 2
    n_requests = len(full.info["sampling"])
    for k in range(1, n_requests):  # a checkpoint after every request but the last
        _, part = run(chunk, snap_after=k)
        assert part is not None and len(part.info["sampling"]) == k
        resumed, _ = run(chunk, resume=part)
        for f in dataclasses.fields(Trajectory):
            if f.name != "timings":
                assert getattr(resumed, f.name) == getattr(full, f.name), (k, f.name)
    # a shadow resumed from a partial grows it further, and checkpoints again the same way
    _, part = run(chunk, snap_after=1)
    _, again = run(chunk, resume=part, snap_after=1)
    assert again is not None and len(again.info["sampling"]) == 2
    resumed, _ = run(chunk, resume=again)
    assert resumed.tokens == full.tokens and resumed.routed_experts == full.routed_experts
    assert resumed.info["sampling"] == full.info["sampling"]
