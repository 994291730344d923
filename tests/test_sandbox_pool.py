"""Episode admission: memory caps never add up past the parent cap, graders have their own
budget, and memory-hungry episodes cannot make a correct fix score 0."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from sandbox_tables import needs_bwrap, record, register
from test_coding_tasks import BY_ID

from mixrl.envs import sandbox as sbmod
from mixrl.envs.coding.grade import GRADE_LIMITS, grade_sandbox
from mixrl.envs.sandbox import Sandbox, SandboxError, SandboxLimits
from mixrl.envs.sandbox.cgroup import hierarchy
from mixrl.envs.sandbox.pool import MemoryPool

pytest_plugins = ("sandbox_tables",)  # private_root: each test's own episode root

MIB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def _table(request):  # type: ignore[no-untyped-def]
    register(request)


@pytest.fixture
def small_host(private_root):  # type: ignore[no-untyped-def]
    """A 768 MiB parent cap, 256 MiB of it for graders (restored afterwards)."""
    sbmod.configure(root=private_root, total_memory_bytes=768 * MIB, grading_memory_bytes=256 * MIB)
    yield private_root
    sbmod.configure(root=private_root)


def test_admission_by_hand(small_host):  # type: ignore[no-untyped-def]
    """Budget 512 MiB for episodes: three 200 MiB caps cannot be live together; the third
    waits (counted) until one is released; first come, first served; graders apart."""
    pool = MemoryPool()
    assert pool.budgets() == {"episode": 512 * MIB, "grading": 256 * MIB}

    async def go() -> list[str]:
        order: list[str] = []
        await pool.acquire("episode", 200 * MIB)
        await pool.acquire("episode", 200 * MIB)

        async def later(name: str, n: int) -> None:
            await pool.acquire("episode", n)
            order.append(name)

        third = asyncio.create_task(later("third", 200 * MIB))
        await asyncio.sleep(0.1)
        small = asyncio.create_task(later("small", 50 * MIB))  # would fit, but queues behind the third
        await pool.acquire("grading", 256 * MIB)  # the graders' budget is not the episodes'
        await asyncio.sleep(0.1)
        assert order == [] and pool.used["episode"] == 400 * MIB and pool.waits["episode"] == 2
        pool.release("episode", 200 * MIB)
        await asyncio.gather(third, small)
        assert pool.used["episode"] == 450 * MIB and pool.live["episode"] == 3
        return order

    assert asyncio.run(go()) == ["third", "small"]
    with pytest.raises(SandboxError, match="exceeds the whole grading budget"):
        asyncio.run(pool.acquire("grading", 300 * MIB))

    async def cancelled() -> None:  # a waiter that gives up leaves no ticket behind
        t = asyncio.create_task(pool.acquire("episode", 500 * MIB))
        await asyncio.sleep(0.05)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await pool.acquire("episode", 60 * MIB)

    asyncio.run(cancelled())
    assert pool.queued("episode") == 0 and pool.stats()["pool/episode_waits"] == 3


HUNGRY = ("python3 -c \"\nb = []\nwhile True:\n    b.append(bytearray(8 << 20))\n\"; "
          "python3 -c \"\nb = []\nwhile True:\n    b.append(bytearray(8 << 20))\n\"; echo hungry done")
FIX = "sed -i 's/len(text) < width/len(text) <= width/' textkit/truncate.py"


@pytest.mark.sandbox
@needs_bwrap
def test_hungry_episodes_cannot_zero_a_correct_fix(small_host):  # type: ignore[no-untyped-def]
    """N = 6 episodes each allocating until their own 128 MiB cap kills them, beside one
    episode with the correct fix, 3 rounds: the fix scores 1.0 every time, the caps of the
    live sandboxes never add up past the 768 MiB parent cap, and episodes waited."""
    from mixrl.envs.sandbox.pool import POOL

    data = BY_ID["textkit-truncate"].data
    ep = SandboxLimits(cgroup_memory_bytes=128 * MIB, memory_bytes=1 << 30, wall_seconds=30.0)
    grade_lim = dataclasses.replace(GRADE_LIMITS, cgroup_memory_bytes=128 * MIB)
    peak_caps = [0]

    async def watch(stop: asyncio.Event) -> None:
        while not stop.is_set():
            peak_caps[0] = max(peak_caps[0], POOL.used["episode"] + POOL.used["grading"])
            await asyncio.sleep(0.01)

    async def hungry() -> str:
        sb = await Sandbox.create(data["repo_dir"], ep)
        try:
            return (await sb.run(HUNGRY)).output
        finally:
            await sb.close()

    async def round_() -> tuple[float, list[str]]:
        stop = asyncio.Event()
        w = asyncio.create_task(watch(stop))
        fix = await Sandbox.create(data["repo_dir"], ep)
        try:
            eaters = [asyncio.create_task(hungry()) for _ in range(6)]
            await asyncio.sleep(0.3)  # the first admitted ones are allocating
            assert (await fix.run(FIX)).exit_code == 0
            g = await grade_sandbox(data, fix, grade_lim)
        finally:
            await fix.close()
        outs = await asyncio.gather(*eaters)
        stop.set()
        await w
        return g.reward, outs

    waits0 = POOL.waits["episode"]
    rewards, outs = [], []
    for _ in range(3):
        r, o = asyncio.run(round_())
        rewards.append(r)
        outs += o
    waited = POOL.waits["episode"] - waits0
    peak = hierarchy().memory_peak()
    ok = (rewards == [1.0] * 3 and peak_caps[0] <= 768 * MIB and waited > 0
          and all("hungry done" in o for o in outs) and POOL.used["episode"] == POOL.used["grading"] == 0)
    record("6 memory-hungry episodes beside a correct fix (x3)", "admission: caps sum <= parent cap", ok,
           f"fix rewards {rewards}, admitted caps peak {peak_caps[0] >> 20} MiB of 768, {waited} waits, "
           f"parent memory peak {peak >> 20} MiB")
