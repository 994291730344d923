"""The session runner: token in, token out, every termination path, resume.

``Scripted`` is a deterministic generator with the ``generate`` signature
(request -> result) that replays fixed assistant turns, honouring the
request's token limit and stop ids like an engine does, so each path of the
runner can be driven exactly. The real engine is exercised in test_eval.py.
"""

from __future__ import annotations

import asyncio

import pytest

from mixrl.envs.base import Env, StepResult
from mixrl.envs.calc import CalcEnv
from mixrl.envs.registry import make_task_source
from mixrl.models.chat import ChatFormat
from mixrl.models.tokenizer import build_tokenizer
from mixrl.records.generation import GenerationRequest, GenerationResult, SamplingParams
from mixrl.records.task import Task
from mixrl.records.trajectory import Trajectory
from mixrl.rollout.session import run_episode

CHAT = ChatFormat(build_tokenizer())
TASK = Task("calc/t/0", "calc", "train", {"question": "What is 12*7+3?", "expr": "12*7+3", "answer": 87})
PARAMS = SamplingParams(max_new_tokens=32)


class Scripted:
    """Replays ``turns`` (texts); per call: version = call index, group alternating."""

    def __init__(self, turns: list[str], finish: str | None = None, raise_at: int = -1) -> None:
        self.turns = [CHAT.encode(t) + [CHAT.end_of_turn_id] for t in turns]
        self.finish, self.raise_at = finish, raise_at
        self.requests: list[GenerationRequest] = []

    async def __call__(self, req: GenerationRequest) -> GenerationResult:
        k = len(self.requests)
        self.requests.append(req)
        if k == self.raise_at:
            raise RuntimeError("replica gone")
        ids = self.turns[min(k, len(self.turns) - 1)]
        cut = next((i + 1 for i, t in enumerate(ids) if t in req.params.stop_ids), len(ids))
        ids = ids[: min(cut, req.params.max_new_tokens)]
        fin = self.finish or ("stop" if ids[-1] in req.params.stop_ids else "length")
        n = len(ids)
        lp = [-0.1 * (k + 1) - 0.01 * j for j in range(n)]
        # candidates: 2 per token (the sampled id and id 0), ragged across turns
        offs = [2 * j for j in range(n + 1)]
        cids = [x for t in ids for x in (t, 0)]
        clp = [x for v in lp for x in (v, -5.0)]
        return GenerationResult(ids, lp, offs, cids, clp, "support", version=10 + k,
                                group=f"g{k % 2}", finish_reason=fin, num_nonfinite=3 if fin == "numerical_error" else 0)


def episode(env: Env, gen: Scripted, max_total: int = 200, resume: Trajectory | None = None, params=PARAMS):
    return asyncio.run(run_episode(env, gen, params, prompt_id=env.task.prompt_id, sample_idx=2,
                                   max_total_tokens=max_total, resume=resume))


def test_token_in_token_out_invariant() -> None:
    gen = Scripted(["<calc>12*7+3</calc>", "<answer>87</answer>"])
    tr = episode(CalcEnv(TASK, CHAT), gen)
    tr.validate()
    prompt = CHAT.prompt("What is 12*7+3?")
    g1, g2 = gen.turns
    tool = CHAT.tool_result("87")
    assert tr.tokens == prompt + g1 + tool + g2
    assert tr.loss_mask == [0] * len(prompt) + [1] * len(g1) + [0] * len(tool) + [1] * len(g2)
    assert (tr.status, tr.reward, tr.turns, tr.sample_idx, tr.task) == ("ok", 1.0, 2, 2, "calc")
    gen_pos = [i for i, m in enumerate(tr.loss_mask) if m]
    assert [tr.versions[i] for i in gen_pos] == [10] * len(g1) + [11] * len(g2)
    assert [tr.groups[i] for i in gen_pos] == ["g0"] * len(g1) + ["g1"] * len(g2)
    assert [round(tr.sampler_logprobs[i], 6) for i in gen_pos[:2]] == [-0.1, -0.11]
    off = [i for i, m in enumerate(tr.loss_mask) if not m]
    assert all(tr.versions[i] == -1 and tr.groups[i] == "" and tr.sampler_logprobs[i] == 0.0 for i in off)
    # ragged candidates: one offset per generated token, ids follow the generated tokens
    assert tr.cand_kind == "support" and tr.cand_offsets == [2 * j for j in range(len(gen_pos) + 1)]
    assert tr.cand_ids[0::2] == [tr.tokens[i] for i in gen_pos]
    # each request carries the whole prefix and the env's stop id
    assert gen.requests[0].prompt_ids == prompt
    assert gen.requests[1].prompt_ids == prompt + g1 + tool
    assert CHAT.end_of_turn_id in gen.requests[0].params.stop_ids


def test_wrong_answer_is_zero_ok() -> None:
    tr = episode(CalcEnv(TASK, CHAT), Scripted(["<answer>86</answer>"]))
    assert (tr.status, tr.reward, tr.turns) == ("ok", 0.0, 1)


def test_format_error_and_max_turns_through_runner() -> None:
    tr = episode(CalcEnv(TASK, CHAT), Scripted(["hello"]))
    assert (tr.status, tr.reward, tr.turns) == ("format_error", 0.0, 3)
    tr = episode(CalcEnv(TASK, CHAT, max_turns=3), Scripted(["<calc>1/0</calc>"]))
    assert (tr.status, tr.reward, tr.turns, tr.num_malformed) == ("max_turns", 0.0, 3, 3)
    tr.validate()


def test_truncated_by_total_budget() -> None:
    prompt_len = len(CHAT.prompt("What is 12*7+3?"))
    for budget in (prompt_len + 5, prompt_len + 12, prompt_len + 17):
        tr = episode(CalcEnv(TASK, CHAT), Scripted(["<calc>12*7+3</calc>", "<answer>87</answer>"]), budget)
        assert (tr.status, tr.reward) == ("truncated", 0.0), budget
        assert len(tr.tokens) <= budget
        tr.validate()
    tr = episode(CalcEnv(TASK, CHAT), Scripted(["<calc>12*7+3</calc>", "<answer>87</answer>"]), prompt_len)
    assert tr.status == "truncated" and tr.num_generated == 0


def test_turn_length_limit_is_not_truncation() -> None:
    """A turn cut by max_new_tokens goes to the env (which closes the turn), not 'truncated'."""
    params = SamplingParams(max_new_tokens=5)
    tr = episode(CalcEnv(TASK, CHAT), Scripted(["<calc>1+1</calc> extra", "<answer>87</answer>"]), params=params)
    assert tr.status == "ok" and tr.reward == 1.0
    assert tr.info["finish_reasons"] == ["length", "stop"]
    i = tr.loss_mask.index(1) + 5
    assert tr.tokens[i] == CHAT.end_of_turn_id and tr.loss_mask[i] == 0  # closed by the env


@pytest.mark.parametrize("finish", ["numerical_error", "error", "context_exceeded"])
def test_sampler_failures_are_infra_failed_never_zero(finish: str) -> None:
    tr = episode(CalcEnv(TASK, CHAT), Scripted(["<calc>1+1</calc>"], finish=finish))
    assert (tr.status, tr.reward) == ("infra_failed", None)
    assert finish in tr.info["error"] and tr.num_generated == 0
    tr.validate()


def test_generate_raising_is_infra_failed() -> None:
    tr = episode(CalcEnv(TASK, CHAT), Scripted(["<calc>1+1</calc>", "<answer>2</answer>"], raise_at=1))
    assert (tr.status, tr.reward, tr.turns) == ("infra_failed", None, 1)
    assert "replica gone" in tr.info["error"]


class Broken(Env):
    def __init__(self, where: str) -> None:
        self.task, self.where, self.closed = TASK, where, False
        self.stop_ids = CHAT.stop_ids

    async def reset(self) -> list[int]:
        if self.where == "reset":
            raise OSError("sandbox did not start")
        return CHAT.prompt("q")

    async def step(self, generated: list[int], finish_reason: str) -> StepResult:
        if self.where == "step":
            raise KeyError("bug")
        if self.where == "infra":
            return StepResult([], True, 0.0, "infra_failed", info={"error": "tool timeout"})
        return StepResult(CHAT.tool_result("x"), False)

    async def close(self) -> None:
        self.closed = True
        if self.where == "close":
            raise RuntimeError("close failed")


@pytest.mark.parametrize("where", ["reset", "step", "infra"])
def test_env_failures_are_infra_failed(where: str) -> None:
    env = Broken(where)
    tr = episode(env, Scripted(["<answer>1</answer>"]))
    assert (tr.status, tr.reward) == ("infra_failed", None)
    assert tr.info["error"] and env.closed


def test_env_that_never_ends_is_truncated_and_close_errors_recorded() -> None:
    env = Broken("close")
    tr = episode(env, Scripted(["<calc>1</calc>"]), max_total=120)
    assert tr.status == "truncated" and len(tr.tokens) <= 120 and "close failed" in tr.info["close_error"]


def test_resume_mid_turn_keeps_versions_and_matches_uninterrupted() -> None:
    turns = ["<calc>12*7+3</calc>", "<answer>87</answer>"]
    full = episode(CalcEnv(TASK, CHAT), Scripted(turns))
    # Interrupt: the first turn cut after 3 tokens by the total budget (a lost replica looks alike).
    prompt_len = len(CHAT.prompt("What is 12*7+3?"))
    part = episode(CalcEnv(TASK, CHAT), Scripted(turns), max_total=prompt_len + 3)
    assert part.status == "truncated" and part.num_generated == 3
    part.info.pop("done")  # as a record of a prompt in flight
    gen = Scripted(turns[:0] + [CHAT.decode(CHAT.encode(turns[0])[3:]), turns[1]])
    tr = episode(CalcEnv(TASK, CHAT), gen, resume=part)
    tr.validate()
    assert tr.tokens == full.tokens and tr.loss_mask == full.loss_mask
    assert (tr.status, tr.reward, tr.turns) == ("ok", 1.0, 2)
    gen_versions = [v for v, m in zip(tr.versions, tr.loss_mask, strict=True) if m]
    assert gen_versions[:3] == [10] * 3 and gen_versions[3] == 10 and gen_versions[-1] == 11
    assert gen.requests[0].prompt_ids == part.tokens  # continued from the whole prefix
    assert gen.requests[0].params.max_new_tokens == PARAMS.max_new_tokens - 3


def test_resume_after_completed_turns_replays_env() -> None:
    turns = ["<calc>12*7+3</calc>", "<answer>87</answer>"]
    full = episode(CalcEnv(TASK, CHAT), Scripted(turns))
    n_first = len(CHAT.prompt("What is 12*7+3?")) + len(CHAT.encode(turns[0])) + 1 + len(CHAT.tool_result("87"))
    part = Trajectory.from_dict({**full.to_dict(), "info": {"finish_reasons": ["stop"]}})
    for f in ("tokens", "loss_mask", "sampler_logprobs", "versions", "groups"):
        setattr(part, f, getattr(part, f)[:n_first])
    gen = Scripted(turns[1:])
    tr = episode(CalcEnv(TASK, CHAT), gen, resume=part)
    assert tr.tokens == full.tokens and (tr.status, tr.reward, tr.turns) == ("ok", 1.0, 2)
    # a record whose env tokens disagree with the env is ours to flag, not the model's
    bad = Trajectory.from_dict(part.to_dict())
    bad.tokens = bad.tokens[:-2] + [5, 5]
    tr = episode(CalcEnv(TASK, CHAT), Scripted(turns[1:]), resume=bad)
    assert (tr.status, tr.reward) == ("infra_failed", None)
    # a finished record comes back unchanged
    assert episode(CalcEnv(TASK, CHAT), Scripted(turns), resume=full) is full


def test_single_turn_family() -> None:
    t = make_task_source("reverse", "train", 0)[0]
    from mixrl.envs.reverse import ReverseEnv

    tr = episode(ReverseEnv(t, CHAT), Scripted([f"<answer>{t.data['answer']}</answer>"]))
    assert (tr.status, tr.reward, tr.turns) == ("ok", 1.0, 1)


def _cut(tr: Trajectory, n: int) -> Trajectory:
    part = Trajectory.from_dict({**tr.to_dict(), "info": {}})
    for f in ("tokens", "loss_mask", "sampler_logprobs", "versions", "groups"):
        setattr(part, f, getattr(part, f)[:n])
    n_gen = sum(part.loss_mask)
    part.cand_offsets = part.cand_offsets[: n_gen + 1]
    part.cand_ids = part.cand_ids[: part.cand_offsets[-1]]
    part.cand_logprobs = part.cand_logprobs[: part.cand_offsets[-1]]
    return part


def test_resume_finished_turn_not_yet_answered_by_env() -> None:
    """A last run ending with a stop id is a whole turn: stepped, not continued."""
    turns = ["<calc>12*7+3</calc>", "<answer>87</answer>"]
    full = episode(CalcEnv(TASK, CHAT), Scripted(turns))
    n1 = len(CHAT.prompt("What is 12*7+3?")) + len(CHAT.encode(turns[0])) + 1
    gen = Scripted(turns[1:])
    tr = episode(CalcEnv(TASK, CHAT), gen, resume=_cut(full, n1))
    tr.validate()
    assert tr.tokens == full.tokens and (tr.status, tr.reward, tr.turns) == ("ok", 1.0, 2)
    assert len(gen.requests) == 1 and gen.requests[0].prompt_ids == full.tokens[: n1 + len(CHAT.tool_result("87"))]
    # the final answer already generated: the episode ends without a new request
    gen = Scripted(turns)
    tr = episode(CalcEnv(TASK, CHAT), gen, resume=_cut(full, len(full.tokens)))
    assert (tr.status, tr.reward, tr.turns, len(gen.requests)) == ("ok", 1.0, 2, 0)
