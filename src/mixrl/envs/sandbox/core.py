"""A bubblewrap sandbox for tool calls: one per episode, one ``bwrap`` per command.

    sb = await Sandbox.create(repo_dir, SandboxLimits())   # private copy of repo_dir
    res = await sb.run("python -m pytest -q", timeout=30)   # ExecResult
    patch = await sb.diff()                                 # diff -ruN vs the snapshot
    await sb.close()                                        # removes the copy

Layout and why it stays safe
----------------------------
Each episode owns a private host directory ``<tmp>/mixrl-sb-XXXX`` (mode 0711, owned by the
host user) holding ``snapshot/`` (the pristine copy, read only inside) and ``work/`` (the
episode's repository). Every command is a new ``bwrap`` with fresh user, pid, network, ipc,
uts and cgroup namespaces; ``work/`` is bound read-write at ``/testbed``, the only writable
host path. We keep a host directory (not one long-lived sandbox process) so that no process
of the model outlives its command (the pid namespace dies with its command, taking
``&``-backgrounded children with it), nothing in the sandbox can tamper with a supervisor,
and every command starts from the same known state except ``/testbed``. The host never
follows anything the model wrote: ``diff`` runs in a sandbox, cleanup is ``shutil.rmtree``
(which does not follow symlinks), and the disk check uses ``lstat``.

Inside: ``/usr`` (and the ``/bin``, ``/lib*`` links) read-only, no ``/etc`` and no ``/home``
or ``/root``, a private ``/proc`` (new pid namespace: no host process is visible), a minimal
read-only ``/dev``, size-capped tmpfs ``/tmp`` and ``/dev/shm`` (per command), the root
read-only, a clean environment, no capabilities, nested user namespaces disabled. The
network namespace has only its own loopback, so neither external hosts nor the host's
``127.0.0.1`` or abstract unix sockets are reachable.

Limits: when the host user is root, ``bwrap`` runs as an unprivileged host uid
(``SANDBOX_UID``, ``nobody``) — root's processes are exempt from ``RLIMIT_NPROC``, so a fork
bomb could not be stopped otherwise. ``prlimit`` inside then sets CPU seconds, address
space, processes, file size, open files and no core dumps. ``RLIMIT_NPROC`` is counted per
user namespace (Linux >= 5.14 ucounts), so one sandbox's fork bomb does not starve
another's. Wall time: the ``bwrap`` process group is killed; its init dies with it (``--die-
with-parent``) and the kernel kills the whole pid namespace. Output (stdout and stderr
merged) is read in chunks; at most ``output_bytes`` are kept, the rest is drained and
dropped.

Python: ``python``/``python3`` is the system interpreter when it has the host's major.minor
version (else the host's base interpreter, bound read only at its own path because of its
rpath), and ``pytest`` with its pure-Python dependencies is bound read only under
``/opt/pysite`` (on ``PYTHONPATH``).

Disk: ``RLIMIT_FSIZE`` bounds each file, and the size of ``/testbed`` is checked (by
``lstat``) every ``DISK_POLL_S`` while a command runs and once after it; past ``disk_bytes``
the command is killed (``killed_by == "disk"``). Between two polls a command can still
overshoot by what it writes in that time. For a hard bound, put the episodes (``tmp_root``)
on a size-limited filesystem; a tmpfs such as ``/dev/shm`` also makes create/close much
faster than a busy disk, at the price of memory.

Host paths bound read only (``/usr``, pytest under the venv, the grader's files) must be
readable by the sandbox uid, or every command fails with ``SandboxError``.

Failures of ours (``bwrap`` missing, a mount that fails) raise ``SandboxError``: the
environment turns them into ``infra_failed``, never a reward of 0. Anything the model can
cause (a crash, a timeout, a full disk, unreadable files) is reported in the result instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
SANDBOX_UID = 65534  # host uid the sandbox runs as when we are root (nobody)
INNER_UID = 1000  # uid seen inside the sandbox
WORKDIR = "/testbed"  # the repository inside the sandbox
PYSITE = "/opt/pysite"  # pytest and its dependencies, read only
PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py", "exceptiongroup", "tomli")
# Never part of an episode's diff: caches the model's own runs leave behind.
DISK_POLL_S = 0.25  # how often a running command's /testbed size is checked
SMALL_TREE = 2000  # entries up to which copies, size checks and cleanup run inline
DIFF_EXCLUDES = ("__pycache__", "*.pyc", ".pytest_cache", ".git", ".hypothesis", "*.egg-info")


class SandboxError(RuntimeError):
    """The sandbox could not start or run: an infrastructure failure, never the model's."""


class DiffError(ValueError):
    """The episode's diff cannot be taken because of what the model did (too large, unreadable)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-command limits. Every field has a bound; bad values raise naming the field."""

    cpu_seconds: int = 10  # RLIMIT_CPU per process (SIGXCPU, then SIGKILL)
    memory_bytes: int = 1 << 30  # RLIMIT_AS per process
    max_procs: int = 64  # RLIMIT_NPROC within the sandbox's user namespace
    file_size_bytes: int = 16 << 20  # RLIMIT_FSIZE: largest file a process may write
    open_files: int = 256  # RLIMIT_NOFILE
    wall_seconds: float = 30.0  # default timeout of one command
    output_bytes: int = 16 << 10  # output kept per command (the rest is dropped)
    tmp_bytes: int = 64 << 20  # size of the private /tmp and /dev/shm tmpfs
    disk_bytes: int = 64 << 20  # size of /testbed after a command before the episode is stopped
    diff_bytes: int = 1 << 20  # largest diff taken

    def __post_init__(self) -> None:
        bounds = {
            "cpu_seconds": (1, 3600), "memory_bytes": (64 << 20, 1 << 40), "max_procs": (4, 4096),
            "file_size_bytes": (1 << 10, 1 << 34), "open_files": (16, 65536),
            "wall_seconds": (0.1, 3600.0), "output_bytes": (256, 1 << 26), "tmp_bytes": (1 << 20, 1 << 34),
            "disk_bytes": (1 << 20, 1 << 36), "diff_bytes": (1 << 10, 1 << 28),
        }
        for f in fields(self):
            lo, hi = bounds[f.name]
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ValueError(f"SandboxLimits.{f.name} must be a number in [{lo}, {hi}], got {v!r}")


@dataclass
class ExecResult:
    exit_code: int  # the command's exit status (128+N when killed by signal N); -1 when we killed it
    output: str  # stdout and stderr merged, at most output_bytes (utf-8, invalid bytes replaced)
    truncated: bool  # output was longer than output_bytes
    timed_out: bool  # the wall-clock limit killed it
    killed_by: str | None = None  # "timeout", "SIGXCPU", "SIGKILL", ..., "disk" or None
    info: dict[str, int] = field(default_factory=dict)  # bwrap's namespace ids (pid-namespace, ...)


@dataclass(frozen=True)
class _Runtime:
    bwrap: str
    python: str  # interpreter path inside the sandbox
    binds: tuple[tuple[str, str], ...]  # read-only (host, inside) binds besides /usr
    links: tuple[tuple[str, str], ...]  # (target, path) symlinks to create


@functools.lru_cache(maxsize=1)
def _runtime() -> _Runtime:
    """Discover bwrap, the interpreter and pytest once per process."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxError("bubblewrap (bwrap) is not installed; apt-get install bubblewrap")
    binds: list[tuple[str, str]] = []
    links: list[tuple[str, str]] = []
    for d in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/") / d
        if p.is_symlink():
            links.append((os.readlink(p), str(p)))
        elif p.is_dir():
            binds.append((str(p), str(p)))
    want = f"{sys.version_info.major}.{sys.version_info.minor}"
    python = "/usr/bin/python3"
    try:
        got = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        got = ""
    if got != want:  # use the host's own interpreter, bound at its own path (rpath)
        prefix = os.path.realpath(sys.base_prefix)
        if not prefix.startswith("/usr/"):
            binds.append((prefix, prefix))
        python = os.path.join(prefix, "bin", f"python{want}")
    import importlib.util

    for name in PYTEST_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        src = spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin
        binds.append((src, f"{PYSITE}/{os.path.basename(src)}"))
    links += [(python, "/opt/bin/python"), (python, "/opt/bin/python3")]
    return _Runtime(bwrap, python, tuple(binds), tuple(links))


def _signal_name(code: int) -> str | None:
    if code > 128:
        try:
            return signal.Signals(code - 128).name
        except ValueError:
            return None
    return None


def _tree_size(root: str) -> tuple[int, int]:
    """(bytes, entries) under ``root`` by lstat (never follows a symlink the model made)."""
    total = entries = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for n in filenames + dirnames:
            entries += 1
            with contextlib.suppress(OSError):  # vanished or unreadable: not counted
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
    return total, entries


async def _maybe_thread(small: bool, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` inline when the tree is small (a thread hop costs more than the work under
    load), else in a worker thread so a large tree does not stall the event loop."""
    return fn(*args) if small else await asyncio.to_thread(fn, *args)


def _rmtree(path: str) -> None:
    def retry(func: Callable[[str], object], p: str, _exc: object) -> None:
        # The model may have removed write permission from its own directories.
        try:
            os.chmod(os.path.dirname(p), 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)


class Sandbox:
    """One episode's sandbox; see the module docstring. Not shared between episodes."""

    def __init__(self, root: str, limits: SandboxLimits, uid: int | None) -> None:
        self.root = root  # private host directory of the episode
        self.snapshot = os.path.join(root, "snapshot")
        self.work = os.path.join(root, "work")
        self.limits = limits
        self.uid = uid  # host uid bwrap runs as (None: ours)
        self.closed = False
        self._entries = 0  # entries in work/ after the last command (how to clean up)

    @classmethod
    async def create(cls, repo_dir: str | os.PathLike[str], limits: SandboxLimits | None = None,
                     tmp_root: str | None = None) -> Sandbox:
        """Copy ``repo_dir`` into a new private episode directory; raises ``SandboxError``."""
        limits = limits or SandboxLimits()
        _runtime()  # fail early (SandboxError) when bwrap is missing
        src = Path(repo_dir)
        if not src.is_dir():
            raise SandboxError(f"Sandbox.create: repo_dir {str(src)!r} is not a directory")
        uid = SANDBOX_UID if os.geteuid() == 0 else None
        small = sum(len(d) + len(f) for _, d, f in os.walk(src)) <= SMALL_TREE
        return await _maybe_thread(small, cls._prepare, str(src), limits, uid, tmp_root)

    @classmethod
    def _prepare(cls, src: str, limits: SandboxLimits, uid: int | None, tmp_root: str | None) -> Sandbox:
        root = tempfile.mkdtemp(prefix="mixrl-sb-", dir=tmp_root)
        try:
            os.chmod(root, 0o711)  # the sandbox uid may traverse, not list
            sb = cls(root, limits, uid)
            # Version-control history never enters an episode (it could hold the fix).
            skip = shutil.ignore_patterns(".git", ".hg", ".svn")
            shutil.copytree(src, sb.snapshot, symlinks=True, ignore=skip)
            shutil.copytree(src, sb.work, symlinks=True, ignore=skip)
            for top, owner in ((sb.snapshot, None), (sb.work, uid)):
                for dirpath, dirnames, filenames in os.walk(top):
                    for n in [""] + dirnames + filenames:
                        p = os.path.join(dirpath, n) if n else dirpath
                        st = os.lstat(p)
                        if stat.S_ISLNK(st.st_mode):
                            continue
                        os.chmod(p, (st.st_mode & 0o700) | 0o755 if stat.S_ISDIR(st.st_mode)
                                 else (st.st_mode & 0o700) | 0o644)
                        if owner is not None:
                            os.chown(p, owner, owner)
            return sb
        except BaseException:
            _rmtree(root)
            raise

    # -- running ------------------------------------------------------------------------
    def _argv(self, inner: list[str], binds: list[tuple[str, str, bool]], cwd: str) -> tuple[list[str], list[str]]:
        """(bwrap options, command). The options travel through ``--args FD`` so that the
        sandbox's pid 1 (bwrap's init) shows no host path in its ``/proc/1/cmdline``."""
        rt = _runtime()
        lim = self.limits
        a = ["--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
             "--new-session", "--uid", str(INNER_UID), "--gid", str(INNER_UID), "--hostname", "sandbox",
             "--ro-bind", "/usr", "/usr"]
        for target, path in rt.links:
            a += ["--symlink", target, path]
        for host, inside in rt.binds:
            a += ["--ro-bind", host, inside]
        a += ["--proc", "/proc", "--dev", "/dev", "--size", str(lim.tmp_bytes), "--tmpfs", "/tmp",
              "--size", str(lim.tmp_bytes), "--tmpfs", "/dev/shm"]
        for host, inside, writable in binds:
            a += ["--bind" if writable else "--ro-bind", host, inside]
        a += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", cwd, "--clearenv"]
        env = {"PATH": "/opt/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
               "TERM": "dumb", "PYTHONPATH": PYSITE, "PYTHONDONTWRITEBYTECODE": "1", "USER": "sandbox"}
        for k, v in env.items():
            a += ["--setenv", k, v]
        a += ["--json-status-fd", "{STATUS_FD}"]
        limits = ["/usr/bin/prlimit", f"--cpu={lim.cpu_seconds}:{lim.cpu_seconds + 1}", f"--as={lim.memory_bytes}",
                  f"--nproc={lim.max_procs}", f"--fsize={lim.file_size_bytes}", f"--nofile={lim.open_files}",
                  "--core=0", "--"]
        return a, limits + inner

    async def _exec(self, inner: list[str], binds: list[tuple[str, str, bool]], cwd: str,
                    timeout: float, cap: int, disk_dir: str | None = None) -> ExecResult:
        """Run ``inner`` in a fresh sandbox; raises ``SandboxError`` if bwrap could not start it.

        With ``disk_dir``, its size is polled while the command runs and the command is
        killed (``killed_by == "disk"``) once it passes ``disk_bytes``.
        """
        opts, command = self._argv(inner, binds, cwd)
        rfd, wfd = os.pipe()  # bwrap's JSON status (child pid, namespaces, exit code)
        args_r, args_w = os.pipe()  # bwrap's options, NUL-separated
        data = b"".join(x.replace("{STATUS_FD}", str(wfd)).encode() + b"\0" for x in opts)
        try:
            if len(data) > 60000:  # must fit in the pipe buffer: written before bwrap reads it
                raise SandboxError(f"bwrap options too long ({len(data)} bytes)")
            os.write(args_w, data)
            os.close(args_w)
            args_w = -1
            # env={}: bwrap's init (pid 1 inside) keeps bwrap's environment, readable in /proc/1/environ.
            proc = await asyncio.create_subprocess_exec(
                _runtime().bwrap, "--args", str(args_r), *command, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                pass_fds=(wfd, args_r), env={}, user=self.uid, group=self.uid,
                extra_groups=[] if self.uid is not None else None)
        except OSError as e:
            os.close(rfd)
            raise SandboxError(f"cannot start bwrap: {e}") from e
        except BaseException:
            os.close(rfd)
            raise
        finally:
            os.close(wfd)
            os.close(args_r)
            if args_w != -1:
                os.close(args_w)
        kept = bytearray()
        total = 0

        async def pump() -> None:
            nonlocal total
            assert proc.stdout is not None
            while chunk := await proc.stdout.read(1 << 16):
                total += len(chunk)
                if len(kept) < cap:
                    kept.extend(chunk[: cap - len(kept)])
            await proc.wait()

        over_disk = False

        async def watchdog(path: str) -> None:
            nonlocal over_disk
            while True:
                await asyncio.sleep(DISK_POLL_S)
                size, _ = await asyncio.to_thread(_tree_size, path)
                if size > self.limits.disk_bytes:
                    over_disk = True
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    return

        dog = asyncio.create_task(watchdog(disk_dir)) if disk_dir is not None else None
        timed_out = False
        try:
            await asyncio.wait_for(pump(), timeout)
        except TimeoutError:
            timed_out = True
        finally:
            if dog is not None:
                dog.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await dog
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # bwrap; its pid namespace dies with it
            # Drain to EOF: asyncio's wait() returns only once the pipe is closed, and an unread
            # pipe (reading paused on a full buffer) would never report that.
            try:
                await asyncio.wait_for(_drain_and_wait(proc), 30)
            except TimeoutError:
                os.close(rfd)
                raise SandboxError("sandbox did not exit 30 s after SIGKILL") from None
            status = _read_available(rfd)
        docs = [json.loads(line) for line in status.splitlines() if line.strip().startswith("{")]
        info = {k: int(v) for d in docs for k, v in d.items() if isinstance(v, int)}
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

        ``binds`` adds (host, inside, writable) mounts — the grader's files; the
        host paths must be readable by the sandbox uid.
        """
        if self.closed:
            raise SandboxError("Sandbox.run after close")
        t = self.limits.wall_seconds if timeout is None else float(timeout)
        res = await self._exec(["/bin/bash", "-c", cmd], [(self.work, WORKDIR, True), *binds], WORKDIR, t,
                               self.limits.output_bytes, disk_dir=self.work)
        size, self._entries = await _maybe_thread(self._entries <= SMALL_TREE, _tree_size, self.work)
        if size > self.limits.disk_bytes:
            res.killed_by = "disk"
        return res

    async def diff(self) -> str:
        """Unified diff of the episode's regular text files vs its snapshot (``a/...``, ``b/...``).

        Runs inside a sandbox with both trees read only (the host never reads
        a file the model wrote). Symlinks, fifos, devices, binary and
        unreadable files and ``DIFF_EXCLUDES`` are left out: a patch carries
        text edits only. Raises ``DiffError`` when the diff is over
        ``diff_bytes`` or times out (the model's doing), ``SandboxError`` on ours.
        """
        res = await self._exec([_runtime().python, "-I", "-S", "-c", _TREEDIFF, ",".join(DIFF_EXCLUDES)],
                               [(self.snapshot, "/d/a", False), (self.work, "/d/b", False)], "/d",
                               self.limits.wall_seconds, self.limits.diff_bytes + 1)
        if res.timed_out or res.truncated or len(res.output) > self.limits.diff_bytes:
            raise DiffError(f"cannot diff the episode's files (timed_out={res.timed_out}, "
                            f"over {self.limits.diff_bytes} bytes={res.truncated})")
        if res.exit_code != 0:
            raise SandboxError(f"diff failed with exit {res.exit_code}: {res.output[-300:]}")
        return res.output

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await _maybe_thread(self._entries <= SMALL_TREE, _rmtree, self.root)


async def _drain_and_wait(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    while await proc.stdout.read(1 << 16):
        pass
    await proc.wait()


def _read_available(fd: int) -> str:
    """bwrap's status lines, read without blocking: once bwrap has exited they are all in the
    pipe (after a kill its init may hold the pipe a moment longer; we only miss the exit code,
    which a killed command does not have)."""
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


# Run inside the diff sandbox (cwd holds a/ = snapshot, b/ = work), by the
# sandbox's Python with -I -S. Walks both trees without following links and asks
# GNU diff for each changed regular text file; stderr is discarded.
_TREEDIFF = r"""
import fnmatch, os, stat, subprocess, sys
pats = sys.argv[1].split(",")
def files(root):
    out = {}
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not any(fnmatch.fnmatch(x, p) for p in pats)
                         and not os.path.islink(os.path.join(d, x)))
        for n in names:
            p = os.path.join(d, n)
            if any(fnmatch.fnmatch(n, q) for q in pats) or not stat.S_ISREG(os.lstat(p).st_mode):
                continue
            out[os.path.relpath(p, root)] = p
    return out
def text(p):
    if p is None:
        return b""
    try:
        with open(p, "rb") as f:
            data = f.read()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return None if b"\0" in data else data
a, b = files("a"), files("b")
for rel in sorted(set(a) | set(b)):
    ta, tb = text(a.get(rel)), text(b.get(rel))
    if ta is None or tb is None or ta == tb or "\n" in rel or "\t" in rel:
        continue
    sys.stdout.flush()
    subprocess.run(["diff", "-u", "--label", "a/" + rel, "--label", "b/" + rel,
                    a.get(rel, "/dev/null"), b.get(rel, "/dev/null")], stderr=subprocess.DEVNULL)
"""
