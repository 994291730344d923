"""Faults in a real run on the embedded backend (sampler worker processes, FSDP2 ranks).

- a sampler worker process SIGKILLed while it holds requests: every one of them is
  retried on another replica; the run completes, no prompt lost or trained twice;
- the same with retries off (``runtime.max_session_retries = 0``): the requests the dead
  worker held end ``infra_failed`` with reward None (never 0) and no loss; still
  nothing lost or duplicated;
- a trainer rank process killed (``trainer.world_size = 2``): the run stops with
  ``RankFailure`` within seconds (never a hang), the last checkpoint is intact, and
  ``--resume`` from it completes the run with every prompt trained exactly once;
- async mode with ``max_staleness = 0``: the share of generated groups dropped.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mixrl.runtime.run import train

from .test_run import B, assert_complete_and_unique, batches, metrics, tiny_cfg

ONE_GROUP = {"groups": [{"name": "fp32", "profile": "fp32", "replicas": 2, "min_replicas": 1, "max_replicas": 3}]}


def _bounded(fn: Any, limit_s: float) -> Any:
    """``fn()`` in a thread; fails the test (rather than hanging it) past ``limit_s``."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            out["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"the run did not end within {limit_s} s (a hang)"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _kill_busy_worker(orch: Any, killed: dict[str, int], name: str = "fp32/0") -> None:
    async def chaos() -> None:
        info = orch.fleet.router.replicas[name]
        while orch.step < 1 or info.inflight == 0:  # kill it while it holds requests
            await asyncio.sleep(0.002)
        killed["inflight"] = info.inflight
        killed["pid"] = orch.backend.samplers[name].pid
        os.kill(killed["pid"], signal.SIGKILL)

    asyncio.ensure_future(chaos())


def _spy_trainer(orch: Any, seen: list[tuple[Any, float]]) -> None:
    step = orch.trainer.step

    async def spy(trajs: list[Any], adv: list[float]) -> Any:
        seen.extend(zip(trajs, adv, strict=True))
        return await step(trajs, adv)

    orch.trainer.step = spy


def test_worker_killed_holding_requests_they_are_retried(tiny_policy: Path, tmp_path: Path) -> None:
    killed: dict[str, int] = {}

    async def hook(orch: Any) -> None:
        assert orch.backend.workers == "process"
        _kill_busy_worker(orch, killed)

    cfg = tiny_cfg(tiny_policy, tmp_path, runtime={"steps": 4}, fleet=ONE_GROUP)
    s = _bounded(lambda: train(cfg, evaluate=False, hook=hook), 900)
    assert s["steps"] == 4 and killed["inflight"] >= 1
    assert_complete_and_unique(tmp_path, 4)
    ms = metrics(tmp_path)
    assert ms[-1]["fleet/replica_failures"] >= 1
    assert ms[-1]["fleet/retried_requests"] >= killed["inflight"]  # each held request asked again elsewhere
    assert sum(m["rollout/infra_failed"] for m in ms) == 0
    print(f"killed pid {killed['pid']} holding {killed['inflight']} requests; "
          f"retried {ms[-1]['fleet/retried_requests']:.0f}")


def test_worker_killed_without_retries_gives_infra_failures_never_reward_0(tiny_policy: Path, tmp_path: Path) -> None:
    killed: dict[str, int] = {}
    seen: list[tuple[Any, float]] = []

    async def hook(orch: Any) -> None:
        _spy_trainer(orch, seen)
        _kill_busy_worker(orch, killed)

    cfg = tiny_cfg(tiny_policy, tmp_path, runtime={"steps": 4, "max_session_retries": 0}, fleet=ONE_GROUP)
    s = _bounded(lambda: train(cfg, evaluate=False, hook=hook), 900)
    assert s["steps"] == 4
    assert_complete_and_unique(tmp_path, 4)  # a failed episode still completes its group: not lost
    failed = [(t, a) for t, a in seen if t.status == "infra_failed"]
    assert failed, "the killed worker's requests should have failed (no retries)"
    assert all(t.reward is None and a == 0.0 for t, a in failed)  # never reward 0, no advantage
    assert all("failed" in t.info.get("error", "") for t, _ in failed)
    assert sum(m["rollout/infra_failed"] for m in metrics(tmp_path)) == len(failed)
    statuses = [s for r in batches(tmp_path) for g in r["status"] for s in g]
    assert statuses.count("infra_failed") == len(failed)
    print(f"killed holding {killed['inflight']} requests; {len(failed)} episodes infra_failed (reward None)")


def test_killed_trainer_rank_stops_with_a_resumable_checkpoint(tiny_policy: Path, tmp_path: Path,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    from mixrl.runtime.ranks import RankFailure
    from mixrl.train.checkpoint import load_latest

    at: dict[str, float] = {}

    async def hook(orch: Any) -> None:
        async def chaos() -> None:
            while orch.step < 2:
                await asyncio.sleep(0.005)
            at["t"], at["step"] = time.perf_counter(), orch.step
            orch.trainer.procs[1].kill()  # rank 1 dies between (or inside) two updates

        asyncio.ensure_future(chaos())

    fleet = {"groups": [{"name": "fp32", "profile": "fp32", "replicas": 1, "min_replicas": 1, "max_replicas": 1}]}
    cfg = tiny_cfg(tiny_policy, tmp_path, trainer={"world_size": 2}, fleet=fleet,
                   runtime={"steps": 5, "checkpoint_every": 1, "mode": "sync"})
    with pytest.raises(RankFailure, match="rank 1"):
        _bounded(lambda: train(cfg, evaluate=False, hook=hook), 900)
    took = time.perf_counter() - at["t"]
    print(f"RankFailure {took:.1f} s after killing rank 1 at step {at['step']:.0f}")
    assert took < 60
    deadline = time.monotonic() + 30
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()  # clean stop: no rank or sampler worker left behind
    ck = load_latest(tmp_path)
    assert ck is not None
    saved = int(ck["orchestrator"]["step"])
    # the newest complete checkpoint: the kill's step, or the one before when it hit the save itself
    assert saved in (at["step"] - 1, at["step"]) and saved >= 1
    assert f"continue from its newest checkpoint (step {saved}) with --resume {tmp_path}" in capfd.readouterr().err
    s = _bounded(lambda: train(cfg, resume=True, evaluate=False), 900)
    assert s["steps"] == 5 and not s["interrupted"]
    assert_complete_and_unique(tmp_path, 5)  # nothing lost or trained twice across the failure


def test_async_max_staleness_0_dropped_share(tiny_policy: Path, tmp_path: Path) -> None:
    cfg = tiny_cfg(tiny_policy, tmp_path, runtime={"steps": 6, "mode": "async", "max_staleness": 0})
    s = _bounded(lambda: train(cfg, evaluate=False), 900)
    ms = metrics(tmp_path)
    dropped = ms[-1]["rollout/dropped_groups"]
    trained = 6 * B
    print(f"max_staleness=0 async: {dropped:.0f} groups dropped of {dropped + trained:.0f} completed "
          f"({dropped / (dropped + trained):.1%}); samples/s {s['samples_per_s']:.2f}; "
          f"staleness_max {max(m['rollout/staleness_max'] for m in ms):.0f}")
    assert dropped == 0 and max(m["rollout/staleness_max"] for m in ms) == 0
    assert_complete_and_unique(tmp_path, 6)
