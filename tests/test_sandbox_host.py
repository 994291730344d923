"""The host is never touched: cleanup, seccomp, /proc, zombies, the event loop, and model
actions that once looked like our failures. Rows go to the attack table (``sandbox_tables``)."""

from __future__ import annotations

import asyncio
import os
import stat
import time

import pytest
from sandbox_tables import needs_bwrap, record, register

from mixrl.envs import sandbox as sbmod
from mixrl.envs.sandbox import Sandbox, SandboxLimits, seccomp
from mixrl.envs.sandbox import fs as fsmod

pytest_plugins = ("sandbox_tables",)  # private_root: each test's own episode root
pytestmark = [pytest.mark.sandbox, needs_bwrap, pytest.mark.usefixtures("private_root")]


@pytest.fixture(scope="module", autouse=True)
def _table(request):  # type: ignore[no-untyped-def]
    register(request)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("repo")
    (d / "pkg").mkdir()
    (d / "pkg" / "a.py").write_text("x = 1\n")
    return d


def _mode(p: str) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_deep_tree_and_hostile_modes_cleanup(repo, private_root):  # type: ignore[no-untyped-def]
    """1,500 nested directories, a link to the root's parent, every mode removed: the diff and
    the cleanup finish, nothing above the episode is changed, no failure is counted."""
    parent_mode = _mode(private_root)
    cmd = ("python3 -c \"\nimport os\nfor i in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\n"
           "open('leaf', 'w').write('x')\n\"; ln -s .. up; ln -s / slash; chmod -R 000 d 2>/dev/null; "
           "chmod 000 pkg; echo made")

    async def go():  # type: ignore[no-untyped-def]
        sb = await Sandbox.create(repo, SandboxLimits(wall_seconds=20))
        t0 = time.perf_counter()
        r = await sb.run(cmd)
        d = await sb.diff()
        root = sb.root
        t1 = time.perf_counter()
        await sb.close()
        return r, d, root, t1 - t0, time.perf_counter() - t1

    fails = dict(+sbmod.FAILURES)
    r, d, root, dt, close_s = asyncio.run(go())
    ok = ("made" in r.output and not os.path.exists(root) and _mode(private_root) == parent_mode
          and dict(+sbmod.FAILURES) == fails and dt < 20 and close_s < 5)
    record("1,500-level tree, chmod 000, links up", "unmount (no walk), iterative diff", ok,
           f"command+diff {dt:.1f}s, cleanup {close_s:.2f}s, parent mode {oct(parent_mode)} kept")


def test_cleanup_failure_is_counted_not_retried_upward(private_root):  # type: ignore[no-untyped-def]
    """A root that cannot be removed stays; its parent keeps its mode; the failure is counted."""
    d = os.path.join(private_root, "stuck")
    os.mkdir(d)
    open(os.path.join(d, "file"), "w").close()
    before, mode = fsmod.FAILURES["rmdir"], _mode(private_root)
    ok = fsmod.EpisodeFS(d).teardown()
    counted = fsmod.FAILURES["rmdir"] - before
    fsmod.FAILURES["rmdir"] = before  # this failure is the test's own
    os.remove(os.path.join(d, "file"))
    os.rmdir(d)
    record("cleanup that cannot finish", "logged + counted, never retried upward",
           not ok and counted == 1 and _mode(private_root) == mode, f"counted {counted}, parent mode kept")


def test_seccomp_denies(repo):  # type: ignore[no-untyped-def]
    machine = os.uname().machine
    table = seccomp.TABLES[machine][1]
    names = ("ptrace", "process_vm_readv", "perf_event_open", "userfaultfd", "keyctl", "mount", "pivot_root",
             "unshare")
    nrs = {n: table[n] for n in names} | {"getpid": {"x86_64": 39, "aarch64": 172}[machine]}
    code = ("import ctypes\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            f"for name, nr in {nrs!r}.items():\n"
            "    ret = libc.syscall(nr, 0, 0, 0, 0, 0)\n"
            "    print(name, ret, ctypes.get_errno())\n")
    r = asyncio.run(_one(repo, f"python3 -c \"{code}\"; grep Seccomp: /proc/self/status"))
    rows = {ln.split()[0]: ln.split()[1:] for ln in r.output.splitlines() if len(ln.split()) == 3}
    denied = [n for n, (ret, err) in rows.items() if n != "getpid" and ret == "-1" and err == "1"]
    ok = len(denied) == len(names) and rows["getpid"][0] != "-1" and "Seccomp:\t2" in r.output
    record("ptrace, process_vm_readv, perf, userfaultfd, keyctl, mount", "seccomp filter (EPERM)", ok,
           f"{len(denied)}/{len(names)} denied, getpid allowed")


async def _one(repo, cmd: str, timeout: float | None = None, **lim):  # type: ignore[no-untyped-def]
    sb = await Sandbox.create(repo, SandboxLimits(**lim))
    try:
        return await sb.run(cmd, timeout=timeout)
    finally:
        await sb.close()


def test_proc_cmdline_masked(repo):  # type: ignore[no-untyped-def]
    with open("/proc/cmdline") as f:
        host = f.read().strip()
    r = asyncio.run(_one(repo, "cat /proc/cmdline 2>/dev/null; echo end"))
    record("read the host kernel command line", "/proc/cmdline masked", host not in r.output or not host,
           repr(r.output.strip()[:40]))


def _zombies() -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    data = f.read()
            except OSError:
                continue
            head, _, tail = data.rpartition(")")
            if head.endswith("(bwrap") and tail.split()[0] == "Z":
                out.append(int(p))
    return out


def test_killed_commands_leave_no_zombies(repo):  # type: ignore[no-untyped-def]
    before = set(_zombies())

    async def go():  # type: ignore[no-untyped-def]
        return await asyncio.gather(*(_one(repo, "sleep 30 & sleep 30", timeout=0.5) for _ in range(6)))

    res = asyncio.run(go())
    time.sleep(0.5)
    new = set(_zombies()) - before
    record("6 commands killed at their wall limit", "cgroup kill + subreaper", all(r.timed_out for r in res)
           and not new, f"{len(new)} zombie bwrap processes")


def test_big_commands_do_not_stall_other_episodes(repo):  # type: ignore[no-untyped-def]
    """A 200 KB command and a 15,000-file tree (made, diffed, removed) while a ticker runs."""
    big = "true " + "x" * 200_000 + "\necho big-ok"
    files = "python3 -c \"\nfor i in range(15000):\n    open('f%d' % i, 'w').close()\n\"; echo files-ok"

    async def go():  # type: ignore[no-untyped-def]
        lag = 0.0
        stop = False

        async def ticker() -> None:
            nonlocal lag
            while not stop:
                t = time.perf_counter()
                await asyncio.sleep(0.01)
                lag = max(lag, time.perf_counter() - t - 0.01)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        a, b = await asyncio.gather(_one(repo, big), _one(repo, files, max_inodes=20_000))
        stop = True
        await tick
        return a, b, lag

    a, b, lag = asyncio.run(go())
    ok = "big-ok" in a.output and "files-ok" in b.output and lag < 1.0
    record("200 KB command + 15,000 files beside other episodes", "stdin, blocking work in threads", ok,
           f"event loop lag at most {lag * 1e3:.0f} ms")


def test_model_actions_are_not_our_failures(repo):  # type: ignore[no-untyped-def]
    """chmod 000 /testbed, a 200 KB command, a PATH_MAX-long name: results, never SandboxError."""
    deep = ("n=$(printf 'n%.0s' $(seq 250)); for i in $(seq 25); do mkdir $n && cd $n || break; done; "
            "echo t > $n; cd /testbed; sed -i 's/1/2/' pkg/a.py")

    async def go():  # type: ignore[no-untyped-def]
        sb = await Sandbox.create(repo)
        try:
            a = await sb.run("chmod 000 /testbed; echo locked")
            b = await sb.run("echo after-chmod; ls")
            c = await sb.run("echo " + "y" * 200_000 + " | wc -c")
            d = await sb.run(deep)
            diff = await sb.diff()
            return a, b, c, d, diff
        finally:
            await sb.close()

    a, b, c, d, diff = asyncio.run(go())
    ok = ("after-chmod" in b.output and "pkg" in b.output and c.output.strip() == "200001" and "+x = 2" in diff)
    record("chmod 000 /testbed, 200 KB command, PATH_MAX name", "mode restored, stdin, guarded diff", ok,
           f"ls={b.output.split()[-1] if b.output.split() else ''} wc={c.output.strip()} diff ok={'+x = 2' in diff}")


def test_cancelled_create_leaves_nothing(repo, private_root):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        t = asyncio.create_task(Sandbox.create(repo))
        await asyncio.sleep(0.001)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await asyncio.sleep(0.2)

    asyncio.run(go())
    assert os.listdir(private_root) == []
