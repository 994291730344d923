"""The same orchestrator on the Ray backend: actors for replicas and trainer, a replica killed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mixrl.runtime.run import train

from .test_run import B, G, assert_complete_and_unique, metrics, tiny_cfg

pytestmark = pytest.mark.ray


def test_ray_run_survives_a_killed_replica_actor(tiny_policy: Path, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    killed: list[str] = []

    async def hook(orch: Any) -> None:
        assert type(orch.backend).__name__ == "RayBackend"

        async def chaos() -> None:
            while orch.step < 1:
                await asyncio.sleep(0.01)
            orch.backend.kill("fp32/0")  # ray.kill: the actor process is gone
            killed.append("fp32/0")

        asyncio.ensure_future(chaos())

    cfg = tiny_cfg(tiny_policy, tmp_path, runtime={"steps": 3, "backend": "ray", "checkpoint_every": 2})
    s = train(cfg, evaluate=False, hook=hook)
    assert s["steps"] == 3 and killed == ["fp32/0"]
    assert_complete_and_unique(tmp_path, 3)
    ms = metrics(tmp_path)
    assert ms[-1]["fleet/replica_failures"] >= 1
    assert sum(m["rollout/infra_failed"] for m in ms) == 0
    assert sum(m["rollout/episodes"] for m in ms) == 3 * B * G
    assert (tmp_path / "policy" / "config.json").exists()  # written by the trainer actor
