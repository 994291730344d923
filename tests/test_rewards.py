"""Reward functions: TRL and verl signatures, weights, and failures that are never reward 0."""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from pathlib import Path

import pytest

from mixrl.envs.dataset import DatasetEnv
from mixrl.envs.rewards import RewardError, RewardFailed, Rewards
from mixrl.models.chat import ChatFormat
from mixrl.models.tokenizer import build_tokenizer
from mixrl.records.task import Task

USER = '''
import math, re

def exact(completions, answer, **kwargs):
    return [1.0 if re.search(r"<answer>(.*?)</answer>", c) and re.search(r"<answer>(.*?)</answer>", c).group(1) == a
            else 0.0 for c, a in zip(completions, answer)]

async def length(completions, prompts, level):
    return [len(c) / 100 + level[0] for c in completions]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 2.0 if ground_truth in solution_str else 0.0, "index": extra_info["index"]}

def boom(completions, **kwargs):
    raise ZeroDivisionError("bad reward")

def nan(completions, **kwargs):
    return [math.nan]

def none(completions, **kwargs):
    return [None]

def needs_column(completions, solution):
    return [0.0]
'''
ROW = {"prompt": "What is 2+3?", "answer": "5", "level": 1, "_row": 7, "_prompt_key": "prompt"}


@pytest.fixture()
def user_file(tmp_path: Path) -> str:
    p = tmp_path / "reward.py"
    p.write_text(USER)
    return str(p)


def score(r: Rewards, completion: str) -> float:
    return asyncio.run(r.score(completion, ROW["prompt"], ROW))


def test_trl_verl_async_and_weights(user_file: str) -> None:
    assert score(Rewards([f"{user_file}:exact"]), "<answer>5</answer>") == 1.0
    assert score(Rewards([f"{user_file}:exact"]), "<answer>6</answer>") == 0.0
    assert math.isclose(score(Rewards([f"{user_file}:length"]), "abcd"), 1.04)  # async, columns by name
    verl = Rewards([f"{user_file}:compute_score"])
    assert verl.functions[0].style == "verl" and score(verl, "so 5") == 2.0  # ground_truth = answer column
    mixed = Rewards([f"{user_file}:exact", f"{user_file}:length"], [0.5, 2.0])
    assert math.isclose(score(mixed, "<answer>5</answer>"), 0.5 * 1.0 + 2.0 * (len("<answer>5</answer>") / 100 + 1))


def test_a_module_path_works(monkeypatch: pytest.MonkeyPatch, user_file: str) -> None:
    monkeypatch.syspath_prepend(str(Path(user_file).parent))
    sys.modules.pop("reward", None)
    assert score(Rewards(["reward:exact"]), "<answer>5</answer>") == 1.0


@pytest.mark.parametrize("name", ["boom", "nan", "none"])
def test_failures_raise_are_logged_once_with_the_row(user_file: str, name: str, caplog: pytest.LogCaptureFixture) -> None:
    r = Rewards([f"{user_file}:{name}"])
    with caplog.at_level(logging.ERROR, logger="mixrl.reward"):
        for _ in range(3):
            with pytest.raises(RewardFailed, match="on row 7"):
                score(r, "x")
    logged = [rec for rec in caplog.records if rec.name == "mixrl.reward"]
    assert len(logged) == 1 and "row 7" in logged[0].getMessage() and "Traceback" in logged[0].getMessage()
    assert r.failures() == {f"{user_file}:{name}": 3}


def test_bad_specs_are_user_errors(user_file: str, tmp_path: Path) -> None:
    with pytest.raises(RewardError, match="file nope.py not found"):
        Rewards(["nope.py:f"])
    with pytest.raises(RewardError, match="has no function 'missing'"):
        Rewards([f"{user_file}:missing"])
    with pytest.raises(RewardError, match="cannot import"):
        Rewards(["no_such_package_xyz.mod:f"])
    with pytest.raises(RewardError, match="expected 'file.py:function'"):
        Rewards(["just_a_name"])
    with pytest.raises(RewardError, match=r"needs \['solution'\]"):
        Rewards([f"{user_file}:needs_column"]).check_columns(["prompt", "answer"])


def _episode(rewards: Rewards, reply: str, tools: tuple[str, ...] = ()) -> list[object]:
    chat = ChatFormat(build_tokenizer())
    env = DatasetEnv(Task("data/train/e0/7", "dataset", "train", dict(ROW)), chat, tools=list(tools))
    env.rewards = rewards

    async def run() -> list[object]:
        await env.reset()
        out = []
        for text in reply.split("|"):
            out.append(await env.step(chat.assistant(text), "stop"))
        return out

    return asyncio.run(run())


def test_dataset_env_reward_failed_and_tool(user_file: str) -> None:
    (res,) = _episode(Rewards([f"{user_file}:boom"]), "<answer>5</answer>")
    assert res.done and res.status == "reward_failed" and res.reward is None  # never 0
    first, last = _episode(Rewards([f"{user_file}:exact"]), "<calc>2+3</calc>|<answer>5</answer>", ("calc",))
    assert not first.done and "5" in ChatFormat(build_tokenizer()).decode(first.tokens)
    assert last.done and last.status == "ok" and last.reward == 1.0


def test_the_documented_multi_turn_example_runs(tmp_path: Path, user_file: str) -> None:
    """docs/envs.md's ShopEnv, as written there: a tool call, a nudge, an answer scored by [reward]."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "envs.md").read_text()
    code = doc.split("## A multi-turn example")[1].split("```python\n")[1].split("```")[0]
    assert len(code.splitlines()) <= 30
    ns: dict[str, object] = {}
    exec(compile(code, "docs/envs.md", "exec"), ns)
    chat = ChatFormat(build_tokenizer())
    row = {"prompt": "What do 2 pens cost?", "answer": "4", "_row": 0, "_prompt_key": "prompt"}
    env = ns["ShopEnv"](Task("t", "x", "train", row), chat, hint=True)  # type: ignore[operator]
    env.rewards = Rewards([f"{user_file}:exact"])

    async def run() -> list[object]:
        ids = await env.reset()
        assert "<price>item</price>" in chat.decode(ids)
        return [await env.step(chat.assistant(t), "stop") for t in ("<price>pen</price>", "hmm", "<answer>4</answer>")]

    tool, nudge, end = asyncio.run(run())
    assert not tool.done and "2" in chat.decode(tool.tokens)
    assert not nudge.done and "Answer with" in chat.decode(nudge.tokens)
    assert end.done and end.reward == 1.0 and end.status == "ok"
