"""The bubblewrap sandbox: functions, limits, and attacks that must stay contained.

Every attack records a row (attack, mechanism, contained, detail); the table
is printed in pytest's terminal summary (also without ``-s``); every test runs
under its own private episode root (``sandbox_tables.private_root``).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from sandbox_tables import needs_bwrap, record, register

from mixrl.envs import sandbox as sbmod
from mixrl.envs.sandbox import DiffError, Sandbox, SandboxError, SandboxLimits
from mixrl.envs.sandbox import runtime as rtmod

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
    (d / "README").write_text("hello\n")
    (d / ".git").mkdir()  # history must not reach an episode
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    os.chmod(d, 0o755)
    return d


def arun(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def _one(repo: Path, cmd: str, timeout: float | None = None, **lim) -> sbmod.ExecResult:  # type: ignore[no-untyped-def]
    sb = await Sandbox.create(repo, SandboxLimits(**lim))
    try:
        return await sb.run(cmd, timeout=timeout)
    finally:
        await sb.close()


def _pids_in_ns(inode: int, wait: float = 3.0) -> list[int]:
    """Host pids still in pid namespace ``inode`` once ``wait`` seconds passed (teardown is async)."""
    deadline = time.monotonic() + wait
    while True:
        out = []
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    if os.readlink(f"/proc/{p}/ns/pid") == f"pid:[{inode}]":
                        out.append(int(p))
                except OSError:
                    pass
        if not out or time.monotonic() > deadline:
            return out
        time.sleep(0.05)


# -- functions -----------------------------------------------------------------------------
def test_run_persist_diff_close(repo):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        sb = await Sandbox.create(repo)
        r = await sb.run("echo out; echo err >&2; exit 3")
        assert (r.exit_code, r.output, r.truncated, r.timed_out, r.killed_by) == (3, "out\nerr\n", False, False, None)
        await sb.run("sed -i 's/x = 1/x = 2/' pkg/a.py && echo new > pkg/b.py && rm README && "
                     "python -c 'import pkg.a' && mkdir -p q/__pycache__ && echo c > q/__pycache__/z.pyc")
        assert (await sb.run("cat pkg/b.py")).output == "new\n"  # files persist between commands
        assert (await sb.run("ls -A")).output.split() == ["pkg", "q"]  # no .git copied
        d = await sb.diff()
        assert "--- a/pkg/a.py\n+++ b/pkg/a.py\n" in d and "-x = 1\n+x = 2\n" in d
        assert "+++ b/pkg/b.py" in d and "--- a/README" in d and "pycache" not in d
        assert (repo / "pkg" / "a.py").read_text() == "x = 1\n"  # the source snapshot is untouched
        root = sb.root
        await sb.close()
        assert not os.path.exists(root)
        with pytest.raises(SandboxError):
            await sb.run("true")

    arun(go())


def test_python_and_pytest_inside(repo):  # type: ignore[no-untyped-def]
    r = arun(_one(repo, "python -c 'import sys; print(sys.version_info[:2])'; python -m pytest --version"))
    assert r.exit_code == 0, r.output
    assert f"({sys.version_info.major}, {sys.version_info.minor})" in r.output and "pytest" in r.output


def test_startup_failure_is_sandbox_error(repo, monkeypatch):  # type: ignore[no-untyped-def]
    async def bad_bind():  # type: ignore[no-untyped-def]
        sb = await Sandbox.create(repo)
        try:
            await sb.run("true", binds=[("/nonexistent-mixrl-path", "/x", False)])
        finally:
            await sb.close()

    with pytest.raises(SandboxError, match="bwrap failed"):
        arun(bad_bind())
    monkeypatch.setattr(rtmod.shutil, "which", lambda name: None)
    rtmod.runtime.cache_clear()
    try:
        with pytest.raises(SandboxError, match="not installed"):
            arun(Sandbox.create(repo))
    finally:
        monkeypatch.undo()
        rtmod.runtime.cache_clear()


def test_limits_validation():
    with pytest.raises(ValueError, match="SandboxLimits.max_procs"):
        SandboxLimits(max_procs=0)
    with pytest.raises(ValueError, match="SandboxLimits.wall_seconds"):
        SandboxLimits(wall_seconds=-1)


def test_32_concurrent_episodes_do_not_interfere(repo):  # type: ignore[no-untyped-def]
    n = 32

    async def episode(i: int) -> tuple[int, str, str, str]:
        sb = await Sandbox.create(repo)
        try:
            await sb.run(f"echo {i} > mine_{i}.txt && sed -i 's/x = 1/x = {i + 100}/' pkg/a.py")
            await asyncio.sleep(0.01 * (i % 4))  # interleave the episodes
            seen = (await sb.run("ls; cat mine_*.txt; cat pkg/a.py")).output
            return i, seen, await sb.diff(), sb.root
        finally:
            await sb.close()

    async def go():  # type: ignore[no-untyped-def]
        return await asyncio.gather(*(episode(i) for i in range(n)))

    t0 = time.perf_counter()
    results = arun(go())
    dt = time.perf_counter() - t0
    for i, seen, diff, _ in results:
        assert seen.splitlines() == ["README", f"mine_{i}.txt", "pkg", str(i), f"x = {i + 100}"], seen
        assert f"+x = {i + 100}\n" in diff and f"+++ b/mine_{i}.txt" in diff
        assert diff.count("+++ ") == 2
    assert len({r[3] for r in results}) == n
    record("32 concurrent episodes", "private copy per episode", True, f"each saw only its own files ({dt:.1f}s)")


# -- attacks ---------------------------------------------------------------------------------
def test_read_host_files(repo):  # type: ignore[no-untyped-def]
    host_repo = str(Path(__file__).resolve().parents[1])
    paths = ["/etc/shadow", "/etc/passwd", "/root", "/home", host_repo, str(repo), sys.prefix,
             tempfile.gettempdir() + "/" + os.listdir(tempfile.gettempdir())[0]]
    cmd = "for p in " + " ".join(f"'{p}'" for p in paths) + '; do test -e "$p" && echo "VISIBLE $p"; done; '
    cmd += "test -e /testbed/pkg/a.py && echo OWN-OK"
    r = arun(_one(repo, cmd))
    assert "OWN-OK" in r.output  # positive control: the episode's own files are there
    record("read host files (/etc/shadow, /root, host repo, venv, /tmp)", "not mounted",
           "VISIBLE" not in r.output, r.output.replace("OWN-OK", "").strip() or "none visible")


def test_write_outside_workdir(repo):  # type: ignore[no-untyped-def]
    probe = f"mixrl-probe-{os.getpid()}-{time.time_ns()}"

    async def go():  # type: ignore[no-untyped-def]
        sb = await Sandbox.create(repo)
        try:
            a = await sb.run(
                "for p in /x /usr/x /opt/x /bin/x /proc/x /dev/x /testbed/../x; do "
                'touch "$p" 2>/dev/null && echo "WROTE $p"; done; '
                f"echo s > /tmp/{probe} && echo s > /dev/shm/{probe} && echo TMP-OK")
            b = await sb.run(f"ls /tmp/{probe} /dev/shm/{probe} 2>/dev/null; true")
            return a.output, b.output
        finally:
            await sb.close()

    a, b = arun(go())
    assert "TMP-OK" in a  # /tmp is writable scratch ...
    leaked = os.path.exists(f"/tmp/{probe}") or os.path.exists(f"/dev/shm/{probe}") or b.strip()
    record("write outside /testbed", "read-only root, private tmpfs /tmp",
           "WROTE" not in a and not leaked, "no write reached the host; /tmp not kept between commands")


def test_network_external_and_loopback(repo):  # type: ignore[no-untyped-def]
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    name = f"mixrl-abstract-{os.getpid()}"
    usrv = socket.socket(socket.AF_UNIX)
    usrv.bind("\0" + name)
    usrv.listen(1)
    hits: list[str] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
                hits.append("tcp")
                c.close()
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    code = (
        "import socket\n"
        "def tcp(h, p):\n"
        "    try: socket.create_connection((h, p), timeout=2); return 'CONNECTED'\n"
        "    except OSError as e: return type(e).__name__\n"
        f"print('loopback', tcp('127.0.0.1', {port}))\n"
        "print('external', tcp('1.1.1.1', 80))\n"
        "try: socket.getaddrinfo('pypi.org', 443); print('dns RESOLVED')\n"
        "except OSError as e: print('dns', type(e).__name__)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"try: s.connect('\\0{name}'); print('abstract CONNECTED')\n"
        "except OSError as e: print('abstract', type(e).__name__)\n"
    )
    try:
        r = arun(_one(repo, f"python3 -c \"{code}\"; ls /sys/class/net 2>/dev/null; ip -o link 2>/dev/null | wc -l"))
    finally:
        stop.set()
        t.join()
        srv.close()
        usrv.close()
    ok = "CONNECTED" not in r.output and "RESOLVED" not in r.output and not hits
    assert "loopback" in r.output and "external" in r.output, r.output
    record("network: host loopback, external, DNS, abstract unix socket", "own network namespace", ok,
           " ".join(r.output.split()[:8]))


def test_fork_bomb(repo):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        bomb = asyncio.create_task(_one(repo, "f(){ f|f& }; f; sleep 20", timeout=3.0, max_procs=32))
        await asyncio.sleep(1.0)
        t0 = time.perf_counter()
        other = await _one(repo, "echo alive")  # another episode during the bomb
        lat = time.perf_counter() - t0
        host = subprocess.run(["true"], timeout=5).returncode
        return await bomb, other, lat, host

    t0 = time.perf_counter()
    r, other, lat, host = arun(go())
    dt = time.perf_counter() - t0
    left = _pids_in_ns(r.info["pid-namespace"]) if "pid-namespace" in r.info else ["?"]
    ok = r.timed_out and dt < 8 and other.output == "alive\n" and host == 0 and not left
    record("fork bomb", "pids.max + RLIMIT_NPROC + wall kill", ok,
           f"limit hit={'Resource temporarily unavailable' in r.output}, other episode ok in {lat:.2f}s, "
           f"{len(left)} left")


def test_memory_bomb(repo):  # type: ignore[no-untyped-def]
    cmd = ("python3 -c 'b = bytearray(8 << 30)' 2>&1 | tail -1; "
           "python3 -c 'x = []\nwhile True: x.append(bytearray(64 << 20))' 2>&1 | tail -1")
    t0 = time.perf_counter()
    r = arun(_one(repo, cmd, timeout=20, memory_bytes=512 << 20))
    dt = time.perf_counter() - t0
    record("memory bomb", "RLIMIT_AS 512 MiB", r.output.count("MemoryError") == 2 and dt < 15,
           f"{r.output.strip()!r} in {dt:.1f}s")


def test_infinite_loop_wall_and_cpu(repo):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    r = arun(_one(repo, "while :; do :; done", timeout=1.0))
    dt = time.perf_counter() - t0
    record("infinite loop (wall)", "episode cgroup SIGKILLed", r.timed_out and r.killed_by == "timeout" and dt < 4,
           f"killed after {dt:.1f}s")
    t0 = time.perf_counter()
    r = arun(_one(repo, "python3 -c 'while True: pass'", timeout=30, cpu_seconds=1))
    dt = time.perf_counter() - t0
    record("infinite loop (cpu)", "RLIMIT_CPU 1 s", not r.timed_out and r.killed_by in ("SIGXCPU", "SIGKILL")
           and dt < 25, f"{r.killed_by} after {dt:.1f}s")


def test_background_process_dies_with_command(repo):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    r = arun(_one(repo, "sleep 100 & (sleep 200 &) ; echo started"))
    dt = time.perf_counter() - t0
    left = _pids_in_ns(r.info["pid-namespace"])
    record("background process outliving its command", "pid namespace torn down",
           r.output == "started\n" and dt < 5 and not left, f"returned in {dt:.2f}s, {len(left)} left")


def test_huge_output(repo):  # type: ignore[no-untyped-def]
    r = arun(_one(repo, "head -c 50000000 /dev/zero | tr '\\0' x", output_bytes=4096))
    r2 = arun(_one(repo, "yes", timeout=1.5, output_bytes=4096))
    ok = len(r.output) == 4096 and r.truncated and not r.timed_out and len(r2.output) == 4096 and r2.timed_out
    record("huge output (50 MB, endless yes)", "capped read, rest drained", ok,
           f"kept {len(r.output)} of 50000000 bytes")


def test_huge_file_and_disk(repo):  # type: ignore[no-untyped-def]
    r = arun(_one(repo, "head -c 100000000 /dev/zero > big; echo rc=$?; stat -c %s big",
                  file_size_bytes=1 << 20))
    size = int(r.output.split()[-1])
    record("huge file", "RLIMIT_FSIZE 1 MiB", size <= 1 << 20 and "rc=0" not in r.output, f"file stopped at {size} B")
    r = arun(_one(repo, "for i in $(seq 30); do head -c 200000 /dev/zero > f$i; done", disk_bytes=2 << 20))
    record("disk filling with many files", "tmpfs size= per episode", r.killed_by == "disk", f"killed_by={r.killed_by}")

    async def endless():  # type: ignore[no-untyped-def]
        sb = await Sandbox.create(repo, SandboxLimits(disk_bytes=4 << 20))
        try:
            t0 = time.perf_counter()
            r = await sb.run("i=0; while :; do i=$((i+1)); head -c 500000 /dev/zero > f$i; done", timeout=30)
            return r, time.perf_counter() - t0, sb.fs.used()[0]
        finally:
            await sb.close()

    r, dt, size = arun(endless())
    record("disk filling, endless writer", "tmpfs full -> killed", r.killed_by == "disk" and not r.timed_out
           and dt < 15 and size < 256 << 20, f"killed after {dt:.1f}s at {size >> 20} MiB (limit 4 MiB)")


def test_symlink_escape(repo, tmp_path):  # type: ignore[no-untyped-def]
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET\n")
    os.chmod(tmp_path, 0o755)
    os.chmod(secret, 0o644)

    async def go():  # type: ignore[no-untyped-def]
        sb = await Sandbox.create(repo)
        try:
            r = await sb.run(f"ln -s {secret} s; ln -s {tmp_path} d; ln -s / rootlink; "
                             "cat s d/secret.txt 2>&1; ls rootlink/ | tr '\\n' ' '; echo TOPSECRET-probe > /dev/null")
            d = await sb.diff()
            return r.output, d
        finally:
            await sb.close()  # rmtree must not follow the links

    out, d = arun(go())
    ok = "TOPSECRET" not in out and "TOPSECRET" not in d and secret.read_text() == "TOPSECRET\n"
    record("symlink escape (read via link, diff, cleanup)", "links resolve inside; host never follows", ok,
           "host file unread and intact")


def test_proc_and_environment(repo, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MIXRL_PROBE_SECRET", "hunter2")
    r = arun(_one(repo, f"ls /proc | grep -cE '^[0-9]+$'; cat /proc/*/cmdline /proc/*/environ 2>/dev/null | "
                        f"tr '\\0' ' '; test -e /proc/{os.getpid()}/cmdline && cat /proc/{os.getpid()}/cmdline; env"))
    lines = r.output.splitlines()
    n = int(lines[0])
    assert "ulimit" in r.output and "PATH=/opt/bin" in r.output  # positive control: it could read its own
    ok = n <= 6 and "pytest" not in r.output and "hunter2" not in r.output and "site-packages" not in r.output
    record("host processes, environment, paths via /proc", "private pid ns, clean env, --args", ok,
           f"{n} pids visible, no host process or variable")


def test_privilege_and_userns(repo):  # type: ignore[no-untyped-def]
    r = arun(_one(repo, "grep CapEff /proc/self/status; unshare -Ur true 2>/dev/null && echo USERNS; "
                        "kill -9 -1; echo after"))
    sb_ok = arun(_one(repo, "echo next"))
    ok = "0000000000000000" in r.output and "USERNS" not in r.output and sb_ok.output == "next\n"
    record("capabilities, nested user ns, kill -9 -1", "no caps, --disable-userns, own pid ns", ok,
           "only the sandbox's processes died")


def test_diff_too_large_is_the_models_doing(repo):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        sb = await Sandbox.create(repo, SandboxLimits(diff_bytes=4096))
        try:
            await sb.run("seq 10000 > many.txt")
            await sb.diff()
        finally:
            await sb.close()

    with pytest.raises(DiffError):
        arun(go())
