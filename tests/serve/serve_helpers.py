"""Helpers shared by the endpoint tests."""

from __future__ import annotations


def train_and_keep(cfg):
    """``train(cfg)`` with a hook that keeps every trajectory the trainer receives."""
    from mixrl.runtime.run import train

    seen: list = []

    async def spy(orch) -> None:
        step = orch.trainer.step

        async def recorded(trajs, adv):
            seen.extend(trajs)
            return await step(trajs, adv)

        orch.trainer.step = recorded

    return train(cfg, hook=spy, evaluate=False, progress=False), seen
