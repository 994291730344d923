"""``Sandbox``: one episode's cgroup, tmpfs and commands (one ``bwrap`` per command).

How one command starts, and why in this order:

1. the work dir's mode is restored (``chmod 000 /testbed`` by the model must not make the
   next ``bwrap --chdir`` fail as if it were ours);
2. ``bwrap --args FD`` is started as the sandbox uid; it blocks reading its options from
   the pipe, so it cannot have forked yet when
3. its pid is written into the episode's cgroup (every descendant is born inside), and
4. the options (with the seccomp program on another pipe) are written, then the command
   itself on stdin (not argv: a 200 KB command is fine; bash sources it from a pipe).

A running command's tmpfs is watched with ``statvfs`` (O(1)); once it is full the command
is killed (``killed_by == "disk"``). Timeout, disk or the end of the command: every process
left in the cgroup is SIGKILLed; the sandbox's init, orphaned when bwrap's monitor dies with
it, is reaped by us (``reaper.py``). Blocking host work (copies, kills, unmounts) runs in a
worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Sequence

from mixrl.envs.sandbox import reaper, seccomp
from mixrl.envs.sandbox.cgroup import Cgroup, hierarchy
from mixrl.envs.sandbox.fs import FAILURES, EpisodeFS, log
from mixrl.envs.sandbox.limits import HOST, DiffError, ExecResult, SandboxError, SandboxLimits
from mixrl.envs.sandbox.pool import POOL
from mixrl.envs.sandbox.runtime import WORKDIR, bwrap_options, limited, runtime, ulimits
from mixrl.envs.sandbox.treediff import DIFF_EXCLUDES, TREEDIFF

SANDBOX_UID = 65534  # host uid the sandbox runs as when we are root (nobody)
DISK_POLL_S = 0.1  # how often a running command's filesystem is checked for being full
# bash sets the limits, reads the whole command from stdin (up to EOF) before running any
# of it, then the command's own stdin is /dev/null.
READ_EVAL = "IFS= read -r -d '' __cmd; exec </dev/null; eval \"$__cmd\""


class Sandbox:
    """One episode's sandbox; see the package docstring. Not shared between episodes."""

    def __init__(self, fs: EpisodeFS, cg: Cgroup, limits: SandboxLimits, uid: int | None,
                 pool: str = "episode") -> None:
        self.fs = fs
        self.cg = cg
        self.root = fs.root  # private host directory of the episode (a tmpfs mount point)
        self.snapshot = fs.snapshot
        self.work = fs.work
        self.limits = limits
        self.uid = uid  # host uid bwrap runs as (None: ours)
        self.pool = pool  # the memory budget it was admitted to (pool.py)
        self.closed = False

    @classmethod
    async def create(cls, repo_dir: str | os.PathLike[str], limits: SandboxLimits | None = None,
                     tmp_root: str | None = None, pool: str = "episode") -> Sandbox:
        """Copy ``repo_dir`` into a new episode filesystem and cgroup; raises ``SandboxError``.

        Waits first until its memory cap fits in the ``pool`` budget (``"episode"`` or
        ``"grading"``, see ``pool.py``)."""
        limits = limits or SandboxLimits()
        runtime()  # fail early (SandboxError) when bwrap is missing
        seccomp.program()
        # discovery reads /proc and may mkdir: a thread the first time, cached after
        tree = hierarchy() if hierarchy.cache_info().currsize else await asyncio.to_thread(hierarchy)
        reaper.enable()
        src = os.fspath(repo_dir)
        if not os.path.isdir(src):
            raise SandboxError(f"Sandbox.create: repo_dir {src!r} is not a directory")
        uid = SANDBOX_UID if os.geteuid() == 0 else None
        await POOL.acquire(pool, limits.cgroup_memory_bytes)

        def prepare() -> Sandbox:
            cg = tree.create(limits)
            try:
                return cls(EpisodeFS.create(src, limits, uid, base=tmp_root or HOST.episode_root()), cg, limits, uid,
                           pool)
            except BaseException:
                cg.remove()
                raise

        task = asyncio.ensure_future(asyncio.to_thread(prepare))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:  # the copy still finishes in its thread: do not leak it
            try:
                sb = await task
            except Exception:
                POOL.release(pool, limits.cgroup_memory_bytes)
            else:
                with contextlib.suppress(Exception):
                    await sb.close()  # releases its budget
            raise
        except BaseException:
            POOL.release(pool, limits.cgroup_memory_bytes)
            raise

    # -- running ------------------------------------------------------------------------
    async def _spawn(self, inner: list[str], binds: list[tuple[str, str, bool]], cwd: str,
                     with_stdin: bool) -> tuple[asyncio.subprocess.Process, int]:
        """Start bwrap in this sandbox's cgroup: (the process, the read end of bwrap's status pipe)."""
        self.fs.restore_work_mode()
        opts = bwrap_options(self.limits, binds, cwd)
        rfd, wfd = os.pipe()  # bwrap's JSON status (child pid, namespaces, exit code)
        args_r, args_w = os.pipe()  # bwrap's options, NUL-separated
        sc_r, sc_w = os.pipe()  # the seccomp program
        data = b"".join(x.replace("{STATUS_FD}", str(wfd)).replace("{SECCOMP_FD}", str(sc_r)).encode() + b"\0"
                        for x in opts)
        try:
            if len(data) > 60000:  # must fit in the pipe buffer (written before bwrap reads it)
                raise SandboxError(f"bwrap options too long ({len(data)} bytes)")
            os.write(sc_w, seccomp.program())
            os.close(sc_w)
            sc_w = -1
            # env={}: bwrap's init (pid 1 inside) keeps bwrap's environment, readable in /proc/1/environ.
            proc = await asyncio.create_subprocess_exec(
                runtime().bwrap, "--args", str(args_r), *inner,
                stdin=asyncio.subprocess.PIPE if with_stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                pass_fds=(wfd, args_r, sc_r), env={}, user=self.uid, group=self.uid,
                extra_groups=[] if self.uid is not None else None)
            try:
                self.cg.join(proc.pid)  # bwrap is blocked reading its options: nothing forked yet
            except OSError as e:
                os.kill(proc.pid, signal.SIGKILL)
                await proc.wait()
                raise SandboxError(f"cgroup: cannot add the sandbox to its cgroup ({e})") from e
            os.write(args_w, data)
        except OSError as e:
            os.close(rfd)
            raise SandboxError(f"cannot start bwrap: {e}") from e
        except BaseException:
            os.close(rfd)
            raise
        finally:
            for fd in (wfd, args_r, sc_r, args_w, sc_w):
                if fd != -1:
                    os.close(fd)
        return proc, rfd

    async def _exec(self, inner: list[str], binds: list[tuple[str, str, bool]], cwd: str, timeout: float,
                    cap: int, stdin: bytes | None = None, watch_disk: bool = False) -> ExecResult:
        """Run ``inner`` in a fresh sandbox; raises ``SandboxError`` if bwrap could not start it."""
        proc, rfd = await self._spawn(inner, binds, cwd, stdin is not None)
        reaper.ACTIVE.add(proc.pid)
        kept = bytearray()
        total = 0

        async def feed() -> None:
            assert proc.stdin is not None and stdin is not None
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(stdin)
                await proc.stdin.drain()
                proc.stdin.close()

        async def pump() -> None:
            nonlocal total
            assert proc.stdout is not None
            while chunk := await proc.stdout.read(1 << 16):
                total += len(chunk)
                if len(kept) < cap:
                    kept.extend(chunk[: cap - len(kept)])
            await proc.wait()

        over_disk = False

        async def watchdog() -> None:
            nonlocal over_disk
            while True:
                await asyncio.sleep(DISK_POLL_S)
                if self.fs.full():
                    over_disk = True
                    await asyncio.to_thread(self.cg.kill)
                    return

        helpers = [asyncio.create_task(watchdog())] if watch_disk else []
        if stdin is not None:
            helpers.append(asyncio.create_task(feed()))
        timed_out = False
        try:
            await asyncio.wait_for(pump(), timeout)
        except TimeoutError:
            timed_out = True
        finally:
            for h in helpers:
                h.cancel()
                with contextlib.suppress(asyncio.CancelledError, BrokenPipeError, ConnectionResetError):
                    await h
            if proc.returncode is None or self.cg.pids():
                await asyncio.to_thread(self.cg.kill)
            # Drain to EOF: asyncio's wait() returns only once the pipe is closed.
            try:
                await asyncio.wait_for(_drain_and_wait(proc), 30)
            except TimeoutError:
                os.close(rfd)
                raise SandboxError("sandbox did not exit 30 s after SIGKILL") from None
            finally:
                reaper.ACTIVE.discard(proc.pid)
            status = _read_available(rfd)
        docs = [json.loads(line) for line in status.splitlines() if line.strip().startswith("{")]
        info = {k: int(v) for d in docs for k, v in d.items() if isinstance(v, int)}
        if "child-pid" in info:
            reaper.reap((info["child-pid"],))
        text = kept.decode("utf-8", errors="replace")
        if over_disk:
            return ExecResult(-1, text, total > cap, False, "disk", info)
        if timed_out:
            return ExecResult(-1, text, total > cap, True, "timeout", info)
        if "exit-code" not in info:  # bwrap failed before the command ran: ours
            raise SandboxError(f"bwrap failed to start the sandbox (rc={proc.returncode}): {text[:500]}")
        code = info.pop("exit-code")
        return ExecResult(code, text, total > cap, False, _signal_name(code), info)

    async def run(self, cmd: str, timeout: float | None = None, *,
                  binds: Sequence[tuple[str, str, bool]] = ()) -> ExecResult:
        """Run ``cmd`` with bash in ``/testbed``; the episode's files persist between calls.

        ``binds`` adds (host, inside, writable) mounts — the grader's files; the host paths
        must be readable by the sandbox uid.
        """
        if self.closed:
            raise SandboxError("Sandbox.run after close")
        t = self.limits.wall_seconds if timeout is None else float(timeout)
        script = cmd.encode("utf-8", errors="surrogateescape").replace(b"\0", b"")
        inner = ["/bin/bash", "-c", f"{ulimits(self.limits)}; {READ_EVAL}"]
        res = await self._exec(inner, [(self.work, WORKDIR, True), *binds], WORKDIR, t,
                               self.limits.output_bytes, stdin=script, watch_disk=True)
        if res.killed_by is None and self.fs.full():
            res.killed_by = "disk"
        return res

    async def diff(self) -> str:
        """Unified diff of the episode's regular text files vs its snapshot (``a/...``, ``b/...``).

        Runs inside a sandbox with both trees read only (the host never reads a file the
        model wrote). Symlinks, fifos, devices, binary and unreadable files, paths too long
        to open and ``DIFF_EXCLUDES`` (caches, packaging metadata, ``*.pth``) are left out:
        a patch carries text edits only. Raises ``DiffError`` when the diff is over
        ``diff_bytes``, times out or fails on the model's tree, ``SandboxError`` on ours.
        """
        res = await self._exec(limited(self.limits, [runtime().python, "-I", "-S", "-c", TREEDIFF,
                                                     ",".join(DIFF_EXCLUDES)]),
                               [(self.snapshot, "/d/a", False), (self.work, "/d/b", False)], "/d",
                               self.limits.wall_seconds, self.limits.diff_bytes + 1)
        if res.timed_out or res.truncated or len(res.output) > self.limits.diff_bytes:
            raise DiffError(f"cannot diff the episode's files (timed_out={res.timed_out}, "
                            f"over {self.limits.diff_bytes} bytes={res.truncated})")
        if res.exit_code != 0:  # the walker survives anything in the tree; a crash is the model's doing
            raise DiffError(f"diff failed with exit {res.exit_code}: {res.output[-300:]}")
        return res.output

    def results_dir(self) -> str:
        """A directory on the episode's tmpfs the sandbox may create files in but not list
        (mode 0733, owned by us): where the grader's runner writes its results."""
        return self.fs.mkdir("results", 0o733 if self.uid is not None else 0o700)

    async def close(self) -> None:
        """Kill every process of the episode, unmount its filesystem, remove its cgroup."""
        if not self.closed:
            self.closed = True
            try:
                await asyncio.to_thread(_teardown, self.cg, self.fs)
            finally:
                POOL.release(self.pool, self.limits.cgroup_memory_bytes)


def _teardown(cg: Cgroup, fs: EpisodeFS) -> None:

    if not cg.kill():
        FAILURES["kill"] += 1
        log.error("sandbox cleanup: processes survived SIGKILL in %s", cg.procs)
    fs.teardown()  # logs and counts its own failures
    try:
        cg.remove()
    except OSError as e:
        FAILURES["cgroup"] += 1
        log.error("sandbox cleanup: cannot remove cgroup %s: %s", cg.dirs, e)
    reaper.reap()


def _signal_name(code: int) -> str | None:
    if code > 128:
        try:
            return signal.Signals(code - 128).name
        except ValueError:
            return None
    return None


async def _drain_and_wait(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    while await proc.stdout.read(1 << 16):
        pass
    await proc.wait()


def _read_available(fd: int) -> str:
    """bwrap's status lines, read without blocking (after a kill its init may hold the pipe a
    moment longer; we only miss the exit code, which a killed command does not have)."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while True:
            try:
                b = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            if not b:
                break
            chunks.append(b)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")
