"""Interruptible turns (``rollout.interrupt_tokens``): a long turn continues under new weights.

- a turn generated in pieces on a real fp32 replica, with a new weights version
  published and loaded after its first piece: its tokens carry both versions, and
  each token's recorded log q equals the log-probability a float64 forward of the
  version that produced it gives (1e-5), and differs from the other version's;
  the trainer's batch carries those per-token log-probs and versions;
- a checkpoint taken in the middle of a cut turn (``Sessions`` shadow) resumes it:
  the pieces before and after form one turn, env stepped once;
- a run with interruptible turns in async mode: turns continued under newer
  weights happen (``rollout/mixed_version_turns``), nothing is lost or duplicated.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from mixrl.config import build_config
from mixrl.envs.base import Env, StepResult
from mixrl.fleet.fleet import Fleet, GroupSpec
from mixrl.records.generation import GenerationRequest, GenerationResult, SamplingParams
from mixrl.records.task import Task
from mixrl.records.trajectory import Trajectory
from mixrl.rollout.session import piece_id, run_episode
from mixrl.runtime.backends.embedded import EmbeddedBackend
from mixrl.runtime.episodes import mixed_version_turns
from mixrl.runtime.run import train
from mixrl.runtime.sessions import Shadow
from mixrl.weights.store import WeightStore, copy_state_dict

from .test_run import assert_complete_and_unique, metrics, tiny_cfg

PROMPT = [4, 20, 30, 5]


class OneTurn(Env):
    """One assistant turn, reward 1: the turn's tokens are the whole test."""

    def __init__(self) -> None:
        self.task = Task("p0", "test", "train")
        self.steps = 0

    async def reset(self) -> list[int]:
        return list(PROMPT)

    async def step(self, generated: list[int], finish_reason: str) -> StepResult:
        self.steps += 1
        return StepResult([], True, 1.0, "ok")


def _fleet(path: Path) -> tuple[Fleet, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    cfg = build_config({"fleet": {"groups": [{"name": "fp32", "profile": "fp32", "replicas": 1}]},
                        "runtime": {"sampler_workers": "thread"}})
    backend = EmbeddedBackend(cfg, str(path), None)
    fleet = Fleet([GroupSpec("fp32", 1.0, 1, 0, 2)], backend.make_sampler, WeightStore(), seed=0)
    return fleet, AutoModelForCausalLM.from_pretrained(str(path)).state_dict()


def _logq(path: Path, sd: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """log p(tokens[t] | tokens[:t]) for every t >= 1 under ``sd``, in float64 (temperature 1, full vocab)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path)).to(torch.float64)
    m.load_state_dict({k: v.to(torch.float64) for k, v in sd.items()})
    with torch.no_grad():
        logits = m(torch.tensor([tokens])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def test_a_turn_continues_under_new_weights(tiny_policy: Path) -> None:
    torch.manual_seed(0)
    fleet, sd0 = _fleet(tiny_policy)
    sd1 = {k: v + 0.05 * torch.randn_like(v) for k, v in sd0.items()}
    if "lm_head.weight" in sd1:  # tied embeddings: one tensor
        sd1["lm_head.weight"] = sd1["model.embed_tokens.weight"]
    params = SamplingParams(max_new_tokens=12, record="none", seed=None)
    pieces: list[tuple[GenerationRequest, GenerationResult]] = []

    async def main() -> Trajectory:
        fleet.publish(0, copy_state_dict(sd0))
        await fleet.start()

        async def generate(req: GenerationRequest) -> GenerationResult:
            req.params = SamplingParams(**{**req.params.__dict__, "seed": 7 + len(pieces)})
            res = await fleet.generate("s", req)
            pieces.append((req, res))
            if len(pieces) == 1:  # a new version arrives while the turn is being decoded
                fleet.publish(1, copy_state_dict(sd1))
                await fleet.wait_synced(1)
            return res

        try:
            return await run_episode(OneTurn(), generate, params, prompt_id="p0", sample_idx=0,
                                     max_total_tokens=64, chunk_tokens=4)
        finally:
            await fleet.close()

    t = asyncio.run(main())
    t.validate()
    assert t.status == "ok" and t.turns == 1
    assert [r.request_id for r, _ in pieces][:2] == ["p0/0/0~", "p0/0/0@4~"]
    assert all(r.params.max_new_tokens <= 4 for r, _ in pieces)
    gen = [i for i, m in enumerate(t.loss_mask) if m]
    assert len(gen) >= 8, f"the turn stopped after {len(gen)} tokens: two pieces are needed"
    versions = [t.versions[i] for i in gen]
    assert versions[:4] == [0] * 4 and set(versions[4:]) == {1}  # the turn spans two versions
    assert mixed_version_turns(t) == 1
    # every token's log q is the log-probability under the version that produced it
    ref = {v: _logq(tiny_policy, sd, t.tokens) for v, sd in ((0, sd0), (1, sd1))}
    got = torch.tensor([t.sampler_logprobs[i] for i in gen], dtype=torch.float64)
    own = torch.stack([ref[v][i - 1] for i, v in zip(gen, versions, strict=True)])
    other = torch.stack([ref[1 - v][i - 1] for i, v in zip(gen, versions, strict=True)])
    torch.testing.assert_close(got, own, rtol=0, atol=1e-5)
    assert (got - other).abs().max() > 1e-3  # a token labelled with the wrong version would fail
    # the trainer's corrections read exactly these per-token behaviour log-probs and versions
    from mixrl.train.batch import collate, prepare

    records, _ = prepare([t], [1.0], vocab_size=int(sd0["model.embed_tokens.weight"].shape[0]))
    tb = collate(records)
    assert tb.versions.tolist() == versions
    torch.testing.assert_close(tb.sampler_logprobs.double(), got, rtol=0, atol=1e-6)


def _res(ids: list[int], finish: str, version: int) -> GenerationResult:
    n = len(ids)
    return GenerationResult(ids, [-0.5] * n, [0] * (n + 1), [], [], "none", version, "fp32", finish)  # type: ignore[arg-type]


def test_a_checkpoint_inside_a_cut_turn_resumes_it(tiny_policy: Path) -> None:
    # The shadow after two cut pieces of turn 0 (4 tokens each, versions 0 and 1): no finish reason yet.
    sh = Shadow("p0", 0, "one")
    r1 = GenerationRequest(list(PROMPT), SamplingParams(max_new_tokens=4), piece_id("p0/0/0", 0, True))
    sh.turns.append((list(PROMPT), r1.params, _res([40, 41, 42, 43], "length", 0), True))
    sh.turns.append((PROMPT + [40, 41, 42, 43], r1.params, _res([44, 45, 46, 47], "length", 1), True))
    assert r1.request_id == "p0/0/0~"
    part = sh.partial()
    assert part is not None and part.info["finish_reasons"] == [] and part.versions[-8:] == [0] * 4 + [1] * 4
    env = OneTurn()
    seen: list[GenerationRequest] = []

    async def generate(req: GenerationRequest) -> GenerationResult:
        seen.append(req)
        return _res([48, 49], "stop", 2)

    t = asyncio.run(run_episode(env, generate, SamplingParams(max_new_tokens=12), prompt_id="p0", sample_idx=0,
                                max_total_tokens=64, resume=part, chunk_tokens=4))
    assert t.status == "ok" and env.steps == 1 and t.turns == 1  # one turn: env stepped once, at its end
    assert seen[0].prompt_ids == PROMPT + list(range(40, 48)) and seen[0].request_id == "p0/0/0@8"  # the last piece the turn may have
    assert seen[0].params.max_new_tokens == 4
    assert t.tokens == PROMPT + list(range(40, 50))
    assert t.versions[len(PROMPT):] == [0] * 4 + [1] * 4 + [2] * 2


def test_run_with_interruptible_turns(tiny_policy: Path, tmp_path: Path) -> None:
    cfg = tiny_cfg(tiny_policy, tmp_path, runtime={"steps": 4, "mode": "async"},
                   rollout={"max_new_tokens": 24, "max_total_tokens": 96, "interrupt_tokens": 3})
    train(cfg, evaluate=False)
    ms = metrics(tmp_path)
    assert_complete_and_unique(tmp_path, 4)
    assert sum(m["rollout/infra_failed"] for m in ms) == 0
    print("mixed_version_turns per step:", [m["rollout/mixed_version_turns"] for m in ms])
    assert sum(m["rollout/mixed_version_turns"] for m in ms) > 0

