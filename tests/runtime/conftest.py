"""A tiny policy (bundled tokenizer, 1-layer Qwen3, hidden 32) for fast runtime tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mixrl.envs.base import Env

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import tiny_config
    from mixrl.models.tokenizer import save_tokenizer

    path = tmp_path_factory.mktemp("policy") / "tiny"
    tok = save_tokenizer(path)
    torch.manual_seed(0)
    cfg = tiny_config(len(tok), layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, max_positions=256,
                      pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


class ParityEnv(Env):
    """A two-turn test task whose reward a random tiny policy earns about half the time.

    Turn 1 gets a user follow-up; after turn 2 the reward is 1 when most generated
    ids are even. Reward variance inside every group gives non-zero advantages,
    so the trained weights depend on exactly which tokens were sampled.
    """

    def __init__(self, task, chat, **_):  # type: ignore[no-untyped-def]
        self.task, self.chat = task, chat
        self.stop_ids = chat.stop_ids
        self.gen: list[int] = []

    async def reset(self) -> list[int]:
        return self.chat.prompt(self.task.data["question"])

    async def step(self, generated, finish_reason):  # type: ignore[no-untyped-def]
        from mixrl.envs.base import StepResult

        self.gen += list(generated)
        close = [] if generated and generated[-1] in self.stop_ids else [self.chat.end_of_turn_id]
        if len(self.gen) == len(generated):  # first turn
            return StepResult(close + self.chat.user_turn("more"), False)
        even = sum(1 for t in self.gen if t % 2 == 0)
        return StepResult(close, True, float(even * 2 > len(self.gen)), "ok")

    async def close(self) -> None:
        pass


def _parity_task(seed: int, split: str, index: int):  # type: ignore[no-untyped-def]
    from mixrl.records.task import Task

    return Task(prompt_id=f"parity/{split}/s{seed}/{index}", family="parity", split=split,
                data={"question": f"Say {index % 7}"})


@pytest.fixture(scope="session", autouse=True)
def parity_family() -> None:
    from mixrl.envs.registry import register_family

    register_family("parity", _parity_task, ParityEnv, heldout_size=16)
