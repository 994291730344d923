"""The sandbox bounded in total: cgroup memory/pids per episode and across episodes, the
episode's tmpfs (bytes and inodes, whatever the path names), and the refusal to start on a
host that offers neither. Rows go to the attack table (``sandbox_tables``)."""

from __future__ import annotations

import asyncio
import errno
import os
import time

import pytest
from sandbox_tables import needs_bwrap, record, register

from mixrl.envs import sandbox as sbmod
from mixrl.envs.sandbox import Sandbox, SandboxError, SandboxLimits
from mixrl.envs.sandbox import cgroup as cgmod
from mixrl.envs.sandbox import fs as fsmod

pytest_plugins = ("sandbox_tables",)  # private_root: each test's own episode root
pytestmark = [pytest.mark.sandbox, needs_bwrap, pytest.mark.usefixtures("private_root")]
MiB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def _table(request):  # type: ignore[no-untyped-def]
    register(request)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("repo")
    (d / "a.py").write_text("x = 1\n")
    return d


async def _one(repo, cmd: str, timeout: float = 30.0, **lim):  # type: ignore[no-untyped-def]
    sb = await Sandbox.create(repo, SandboxLimits(**lim))
    try:
        return await sb.run(cmd, timeout=timeout), sb
    finally:
        await sb.close()


def test_episode_memory_is_one_cgroup(repo):  # type: ignore[no-untyped-def]
    """6 processes of 200 MiB each (each far under RLIMIT_AS) in one episode capped at 256 MiB."""
    cmd = ("for i in 1 2 3 4 5 6; do python3 -c 'import time; b = b\"x\" * (200 << 20); time.sleep(2)' & done; "
           "wait; echo done")

    async def go():  # type: ignore[no-untyped-def]
        sb = await Sandbox.create(repo, SandboxLimits(cgroup_memory_bytes=256 * MiB, memory_bytes=1 << 30))
        try:
            r = await sb.run(cmd, timeout=30)
            return r, sb.cg.memory_peak()
        finally:
            await sb.close()

    r, peak = asyncio.run(go())
    record("memory across processes (6 x 200 MiB)", "episode cgroup memory 256 MiB",
           r.output.strip().endswith("done") and peak <= 256 * MiB, f"peak {peak / MiB:.0f} MiB of 256")


def test_32_episodes_total_memory_bounded(repo):  # type: ignore[no-untyped-def]
    """32 episodes at once, each filling 48 MiB of its /dev/shm under its own 64 MiB cap, with
    a 512 MiB parent (256 MiB of it for episodes): admission keeps the caps of the live ones
    within the budget, so every episode keeps its file (none is starved by the others), the
    rest wait (counted), and the parent's memory stays under its cap."""
    from mixrl.envs.sandbox.pool import POOL

    cap = 512 * MiB
    old = sbmod.HOST.total_memory_bytes
    sbmod.configure(root=sbmod.HOST.root, total_memory_bytes=cap)  # a fresh parent cgroup with this cap
    lim = SandboxLimits(cgroup_memory_bytes=64 * MiB, tmp_bytes=64 * MiB, file_size_bytes=64 * MiB)
    live = [0]

    async def one(i: int):  # type: ignore[no-untyped-def]
        sb = await Sandbox.create(repo, lim)
        live[0] = max(live[0], POOL.live["episode"])
        try:
            return await sb.run("head -c 50000000 /dev/zero > /dev/shm/fill && sleep 1 && echo kept", timeout=30)
        finally:
            await sb.close()

    async def go():  # type: ignore[no-untyped-def]
        res = await asyncio.gather(*(one(i) for i in range(32)))
        return res, cgmod.hierarchy().memory_peak()

    waits = POOL.waits["episode"]
    try:
        budget = POOL.budgets()["episode"]
        res, peak = asyncio.run(go())
    finally:
        sbmod.configure(root=sbmod.HOST.root, total_memory_bytes=old)
    kept = sum(1 for r in res if "kept" in r.output)
    waited = POOL.waits["episode"] - waits
    record("32 concurrent episodes x 48 MiB", f"admission: caps within {budget // MiB} of 512 MiB", peak <= cap
           and kept == 32 and live[0] * 64 * MiB <= budget and waited > 0,
           f"peak {peak / MiB:.0f} MiB of {cap / MiB:.0f}; {kept}/32 kept their file; {live[0]} live at most, "
           f"{waited} waited")


def test_pids_cap_is_per_episode(repo):  # type: ignore[no-untyped-def]
    cmd = ("python3 -c \"\nimport os, time\nn = 0\nfor i in range(200):\n    try:\n        pid = os.fork()\n"
           "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(3)\n        os._exit(0)\n"
           "    n += 1\nprint(n)\n\"")

    async def go():  # type: ignore[no-untyped-def]
        sb = await Sandbox.create(repo, SandboxLimits(max_procs=16))
        try:
            with open(os.path.join(sb.cg.procs.rsplit("/", 1)[0], "pids.max")) as f:
                cap = int(f.read())
            return await sb.run(cmd, timeout=20), cap
        finally:
            await sb.close()

    r, cap = asyncio.run(go())
    n = int(r.output.split()[0])
    record("200 forks", f"pids.max={cap} + RLIMIT_NPROC=16", n <= 16 and cap == 20, f"{n} forks succeeded")


def test_long_names_do_not_escape_the_disk_bound(repo):  # type: ignore[no-untyped-def]
    """Files under directories whose paths exceed PATH_MAX: a walk would skip them, the tmpfs does not."""
    cmd = ("n=$(printf 'd%.0s' $(seq 250)); for i in $(seq 20); do mkdir $n && cd $n || break; done; "
           "for i in $(seq 40); do head -c 1000000 /dev/zero > f$i 2>/dev/null || break; done; echo wrote $i")

    async def go():  # type: ignore[no-untyped-def]
        sb = await Sandbox.create(repo, SandboxLimits(disk_bytes=8 * MiB))
        try:
            r = await sb.run(cmd, timeout=30)
            return r, sb.fs.used()[0]
        finally:
            await sb.close()

    r, used = asyncio.run(go())
    record("disk via paths longer than PATH_MAX", "tmpfs size= (no walk)", used <= 9 * MiB,
           f"{used / MiB:.1f} MiB on the tmpfs (limit 8 MiB); {r.output.strip()[-20:]}")


def test_inodes_are_bounded(repo):  # type: ignore[no-untyped-def]
    cmd = ("python3 -c \"\nimport os\nn = 0\ntry:\n    for i in range(50000):\n        open('e%d' % i, 'w').close()\n"
           "        n += 1\nexcept OSError as e:\n    print(n, e.strerror)\n\"")
    r, _ = asyncio.run(_one(repo, cmd, max_inodes=2000))
    n = int(r.output.split()[0])
    # the tmpfs holds max_inodes for the work tree plus the snapshot and 16 of ours
    record("50,000 empty files", "tmpfs nr_inodes=", n <= 2000 + 16 and "No space" in r.output, f"stopped at {n} files")


def test_cpu_quota(repo):  # type: ignore[no-untyped-def]
    cmd = "python3 -c 'import time\nt = time.time()\nwhile time.time() - t < 2: pass' & wait; cat /proc/self/stat >/dev/null"

    async def go():  # type: ignore[no-untyped-def]
        sb = await Sandbox.create(repo, SandboxLimits(cpus=0.25))
        try:
            t0 = time.process_time()
            r = await sb.run(f"{cmd}; times", timeout=20)
            return r, time.process_time() - t0
        finally:
            await sb.close()

    tree = cgmod.hierarchy()
    if tree.version == 1 and "cpu" not in tree.controllers:  # this host bounds CPU by RLIMIT_CPU alone
        r, _ = asyncio.run(_one(repo, "python3 -c 'while True: pass'", timeout=20, cpu_seconds=1))
        record("busy loop", "RLIMIT_CPU (no cgroup cpu controller here)", r.killed_by in ("SIGXCPU", "SIGKILL"),
               f"killed by {r.killed_by}")
        return
    r, _ = asyncio.run(go())
    # `times` prints the children's user+system time: at 0.25 CPU for 2 s wall, at most ~0.6 s.
    user, sys_ = r.output.split()[-2:]
    used = sum(float(x.split("m")[0]) * 60 + float(x.split("m")[1].rstrip("s")) for x in (user, sys_))
    record("busy loop for 2 s", "cgroup CPU quota 0.25 cores", used < 1.0, f"{used:.2f} CPU s in 2 s wall")


def test_refuses_without_cgroups_or_tmpfs(repo, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(cgmod, "_mounts", lambda: [])
    cgmod.hierarchy.cache_clear()
    try:
        with pytest.raises(SandboxError, match="no usable memory or pids controller"):
            asyncio.run(Sandbox.create(repo))
    finally:
        monkeypatch.undo()
        cgmod.hierarchy.cache_clear()

    def no_mount(*a):  # type: ignore[no-untyped-def]
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(fsmod, "_mount_tmpfs", no_mount)
    with pytest.raises(SandboxError, match="disk limit: cannot mount a size-limited tmpfs"):
        asyncio.run(Sandbox.create(repo))
