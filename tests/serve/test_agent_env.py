"""Agent episodes: plain ``openai`` client code run against the in-run endpoint (real HTTP, uvicorn)."""

from __future__ import annotations

import asyncio
import math
import textwrap
import time

import pytest
import torch

from mixrl.records.task import Task

torch.set_num_threads(1)
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

AGENT = textwrap.dedent('''
    import asyncio

    TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {
        "type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]

    async def run(client, row):
        msgs = [{"role": "user", "content": row["question"]}]
        for _ in range(2):
            r = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS, max_tokens=8)
            msgs.append(r.choices[0].message.model_dump(exclude_none=True))
            msgs.append({"role": "tool", "tool_call_id": "c", "content": "42"})
        return 1.0 if row["question"].startswith("a") else 0.0, {"turns": 2}

    async def boom(client, row):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        raise RuntimeError("agent bug")

    async def hang(client, row):
        await asyncio.sleep(60)

    async def idle(client, row):
        return 1.0

    async def nan(client, row):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        return float("nan")

    async def long(client, row):
        msgs = [{"role": "user", "content": "y" * 100}]
        while True:
            r = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=30)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more " * 10}]
''')


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    from mixrl.models.chat import ChatFormat

    agent = tmp_path_factory.mktemp("agent") / "agent.py"
    agent.write_text(AGENT)
    return tiny, agent, ChatFormat(AutoTokenizer.from_pretrained(str(tiny)))


def _episodes(setup, fn: str | list[str], rows: list[dict], *, timeout_s: float = 30.0, max_total_tokens: int = 300):
    from mixrl.envs.agent import make_agent_family
    from mixrl.records.generation import SamplingParams
    from mixrl.sampling.batching import BatchingSampler
    from mixrl.sampling.factory import make_engine
    from mixrl.serve.endpoint import InRunEndpoint

    path, agent_file, chat = setup
    fns = [fn] * len(rows) if isinstance(fn, str) else fn
    makers = [make_agent_family(f"openai_agent:{agent_file}:{f}") for f in fns]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, record="support")

    async def main():
        sampler = BatchingSampler(make_engine(str(path), "fp32", "fp32", seed=0, max_batch=8), max_batch=8)
        envs = [makers[i](Task(f"p{i}", "agent", "train", row), chat, timeout_s=timeout_s)
                for i, row in enumerate(rows)]
        t0 = time.monotonic()
        done_at: dict[int, float] = {}

        async def one(i, env):
            traj = await env.run_episode(sampler.generate, params, prompt_id=f"p{i}", sample_idx=i,
                                         max_total_tokens=max_total_tokens)
            done_at[i] = time.monotonic() - t0
            return traj

        trajs = await asyncio.gather(*(one(i, e) for i, e in enumerate(envs)))
        ep = await InRunEndpoint.get(chat, max_total_tokens=max_total_tokens)
        await ep.close()
        await sampler.close()
        return trajs, done_at

    return asyncio.run(main())


def test_agent_episodes_train_on_the_exact_record(setup) -> None:
    from transformers import AutoModelForCausalLM

    trajs, _ = _episodes(setup, "run", [{"question": "a 2+3"}, {"question": "b 4*5"}])
    assert [t.status for t in trajs] == ["ok", "ok"]
    assert [t.reward for t in trajs] == [1.0, 0.0]
    model = AutoModelForCausalLM.from_pretrained(str(setup[0]), torch_dtype=torch.float32).eval()
    for t in trajs:
        t.validate()
        assert t.turns == 2 and t.info["history_rewrites"] == 0 and t.info["turns"] == 2
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([t.tokens])).logits[0].double(), -1)
        ratios = [math.exp(lp[j - 1, t.tokens[j]].item() - q)
                  for j, (m, q) in enumerate(zip(t.loss_mask, t.sampler_logprobs, strict=True)) if m]
        assert ratios and max(abs(r - 1) for r in ratios) < 1e-5  # FP32 identity: every ratio 1 within 1e-5
        assert len(t.cand_offsets) == sum(t.loss_mask) + 1 and t.cand_kind == "support"
        # the run's parameters, not the agent's, are what sampled every reply, and are recorded
        assert t.info["sampling"] == [{"temperature": 1.0, "top_p": 1.0, "top_k": 0}] * t.turns


def test_agent_failures_are_episode_errors_not_zero_reward(setup) -> None:
    for fn, why in (("boom", "agent bug"), ("nan", "finite reward"), ("idle", "never called")):
        (traj,), _ = _episodes(setup, fn, [{"question": "q"}])
        assert traj.status == "agent_failed" and traj.reward is None, fn
        assert why in traj.info["error"], traj.info


def test_a_hanging_agent_times_out_without_blocking_the_others(setup) -> None:
    trajs, done_at = _episodes(setup, ["hang", "run", "run"], [{"question": "q"}, {"question": "a"}, {"question": "b"}],
                               timeout_s=6.0)
    assert trajs[0].status == "agent_failed" and "did not finish" in trajs[0].info["error"]
    assert [t.status for t in trajs[1:]] == ["ok", "ok"]
    assert max(done_at[1], done_at[2]) < done_at[0]  # the others did not wait for the hanging one


def test_too_long_is_truncated_with_reward_zero(setup) -> None:
    (traj,), _ = _episodes(setup, "long", [{"question": "q"}], max_total_tokens=200)
    assert traj.status == "truncated" and traj.reward == 0.0
    assert len(traj.tokens) <= 200
