"""One cgroup per episode under one parent per process: memory, pids and CPU, bounded in total.

    tree = hierarchy()                    # v2 where usable, else v1 memory + pids (+ cpu)
    cg = tree.create(limits)              # <ours>/mixrl-<pid>/sb-<n>, caps written
    cg.join(pid)                          # before the process can fork (see core.py)
    cg.kill()                             # every process in it, until none is left
    cg.remove()

Layout: the parent ``mixrl-<pid>-<token>`` sits under the cgroup this process is in (read
from ``/proc/self/cgroup``, so several trainers on one host never share one) and holds the
cap over all episodes at once (``HostConfig.total_memory``); each episode's cgroup holds
its own caps: ``memory`` (processes and the files of its tmpfs, which are charged to the
writer's cgroup), ``pids`` (``max_procs`` plus bwrap's two), ``cpu`` quota (``cpus``). In
v1 the episodes' ``cpu`` cgroups sit directly beside our own (``<parent name>-sb-<n>``):
under a parent, 32 episodes would weigh like one task against the rest of the host and
crawl under contention; beside it each weighs like the one process it used to be, and
its quota caps it. (v2 has one tree: the parent gets one task's weight per core.)

Which kernel interface: cgroup v2 when its mount lists ``memory`` and ``pids`` in our
cgroup's ``cgroup.controllers`` and they can be enabled for the parent's children; else v1
with the ``memory`` and ``pids`` hierarchies mounted and writable (``cpu`` is used when
mounted, its absence only loses the CPU quota). Neither: ``SandboxError`` naming the
missing limit. Kill: v2 ``cgroup.kill``; v1 has none, so ``cgroup.procs`` is read and
every pid SIGKILLed until the list stays empty (``pids.max`` bounds how many can race).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass

from mixrl.envs.sandbox.limits import HOST, SandboxError, SandboxLimits

PERIOD_US = 100_000
BWRAP_PROCS = 4  # bwrap's monitor and init, bash, one spare: beyond the model's own processes


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read_pids(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _src, sopts = (right.split() + ["", "", ""])[:3]
            if fstype in ("cgroup", "cgroup2"):
                out.append((left.split()[4], fstype, set(sopts.split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """controller (or "" for v2) -> our cgroup path, from /proc/self/cgroup."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                out[c] = path
    return out


@dataclass
class Cgroup:
    dirs: tuple[str, ...]  # one per hierarchy (v2: one)
    procs: str  # the cgroup.procs file that lists every member
    kill_file: str | None  # v2 cgroup.kill
    memory_dir: str = ""  # the directory with the memory controller's files

    def join(self, pid: int) -> None:
        for d in self.dirs:
            _write(os.path.join(d, "cgroup.procs"), str(pid))

    def pids(self) -> list[int]:
        return _read_pids(self.procs)

    def memory_peak(self) -> int:
        """Highest memory use of the episode so far (bytes; processes and files)."""
        return _peak(self.memory_dir)

    def kill(self, deadline_s: float = 5.0) -> bool:
        """SIGKILL every member until none is left; False if some survived ``deadline_s``."""
        end = time.monotonic() + deadline_s
        while True:
            pids = self.pids()
            if not pids:
                return True
            if self.kill_file is not None:
                try:
                    _write(self.kill_file, "1")
                except OSError:
                    self.kill_file = None
            for p in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p, signal.SIGKILL)
            if time.monotonic() > end:
                return not self.pids()
            time.sleep(0.001)

    def remove(self) -> None:
        """rmdir each directory (a just-killed member can hold it a moment: short retries)."""
        for d in self.dirs:
            for i in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if i == 49:
                        raise
                    time.sleep(0.002)


class Hierarchy:
    """The parent cgroup(s) of this process's episodes; ``create`` makes one per episode."""

    def __init__(self, version: int, bases: dict[str, str]) -> None:
        self.version = version  # 1 or 2
        self.bases = bases  # controller -> our own cgroup directory (v2: {"": dir})
        self._lock = threading.Lock()
        self._n = 0
        self._parent: dict[str, str] = {}
        self._cap: int | None = None
        self._all: list[str] = []  # every parent directory made (removed at exit)
        self._pname = ""  # the current parent's name
        atexit.register(self.cleanup)

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(sorted(self.bases))

    def _parents(self) -> dict[str, str]:
        cap = HOST.total_memory()
        with self._lock:
            if self._parent and self._cap == cap:
                return self._parent
            name = f"mixrl-{os.getpid()}-{secrets.token_hex(3)}"
            if self.version == 2:  # our cgroup must hand the controllers down (OSError if it cannot)
                want = {"memory", "pids"} | ({"cpu"} & self._v2_ctrls(self.bases[""]))
                with open(os.path.join(self.bases[""], "cgroup.subtree_control")) as f:
                    missing = want - set(f.read().split())
                if missing:
                    _write(os.path.join(self.bases[""], "cgroup.subtree_control"),
                           " ".join(f"+{c}" for c in sorted(missing)))
            parents = {}
            self._pname = name
            for c, base in self.bases.items():
                if c == "cpu":  # v1: episodes sit beside us, each weighing like one task (see above)
                    parents[c] = base
                    continue
                d = os.path.join(base, name)
                os.mkdir(d)
                parents[c] = d
                self._all.append(d)
            if self.version == 2:
                _write(os.path.join(parents[""], "cgroup.subtree_control"), "+memory +pids" +
                       (" +cpu" if "cpu" in self._v2_ctrls(parents[""]) else ""))
                _write(os.path.join(parents[""], "memory.max"), str(cap))
                if os.path.exists(os.path.join(parents[""], "memory.swap.max")):
                    _write(os.path.join(parents[""], "memory.swap.max"), "0")
                if os.path.exists(os.path.join(parents[""], "cpu.weight")):
                    _write(os.path.join(parents[""], "cpu.weight"), str(min(10_000, 100 * (os.cpu_count() or 1))))
            else:
                _set_v1_memory(parents["memory"], cap)
            self._parent, self._cap = parents, cap
            return parents

    @staticmethod
    def _v2_ctrls(d: str) -> set[str]:
        with open(os.path.join(d, "cgroup.controllers")) as f:
            return set(f.read().split())

    def create(self, limits: SandboxLimits) -> Cgroup:
        """A new episode cgroup with ``limits`` written; raises ``SandboxError``."""
        try:
            parents = self._parents()
            with self._lock:
                self._n += 1
                name = f"sb-{self._n}"
            dirs = []
            try:
                for c, p in sorted(parents.items()):
                    d = os.path.join(p, f"{self._pname}-{name}" if c == "cpu" else name)
                    os.mkdir(d)
                    dirs.append(d)
                    self._limit(c, d, limits)
            except BaseException:
                Cgroup(tuple(dirs), "", None).remove()
                raise
        except OSError as e:
            raise SandboxError(f"cgroup: cannot create the episode's cgroup ({e}); the memory and "
                               "pids limits cannot be enforced") from e
        if self.version == 2:
            d = dirs[0]
            return Cgroup((d,), os.path.join(d, "cgroup.procs"), os.path.join(d, "cgroup.kill"), d)
        order = sorted(parents)
        return Cgroup(tuple(dirs), os.path.join(dirs[order.index("pids")], "cgroup.procs"), None,
                      dirs[order.index("memory")])

    def _limit(self, c: str, d: str, lim: SandboxLimits) -> None:
        procs = str(lim.max_procs + BWRAP_PROCS)
        quota = str(max(1000, int(lim.cpus * PERIOD_US)))
        if self.version == 2:
            _write(os.path.join(d, "memory.max"), str(lim.cgroup_memory_bytes))
            if os.path.exists(os.path.join(d, "memory.swap.max")):
                _write(os.path.join(d, "memory.swap.max"), "0")
            _write(os.path.join(d, "pids.max"), procs)
            if os.path.exists(os.path.join(d, "cpu.max")):
                _write(os.path.join(d, "cpu.max"), f"{quota} {PERIOD_US}")
        elif c == "memory":
            _set_v1_memory(d, lim.cgroup_memory_bytes)
        elif c == "pids":
            _write(os.path.join(d, "pids.max"), procs)
        elif c == "cpu":
            _write(os.path.join(d, "cpu.cfs_period_us"), str(PERIOD_US))
            _write(os.path.join(d, "cpu.cfs_quota_us"), quota)

    def memory_peak(self) -> int:
        """Highest memory use of all episodes together under the current parent (bytes)."""
        return _peak(self._parents()["memory" if self.version == 1 else ""])

    @property
    def memory_cap(self) -> int:
        return self._cap if self._cap is not None else HOST.total_memory()

    def cleanup(self) -> None:
        """Remove the parent directories (at exit; a parent with episodes left stays)."""
        with self._lock:
            for d in self._all:
                with contextlib.suppress(OSError):
                    os.rmdir(d)
            self._all, self._parent = [], {}


def _peak(d: str) -> int:
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        try:
            with open(os.path.join(d, name)) as f:
                return int(f.read())
        except OSError:
            continue
    raise SandboxError(f"cgroup: no memory peak counter in {d}")


def _set_v1_memory(d: str, cap: int) -> None:
    _write(os.path.join(d, "memory.limit_in_bytes"), str(cap))
    sw = os.path.join(d, "memory.memsw.limit_in_bytes")
    if os.path.exists(sw):  # memory + swap: no escape into swap
        _write(sw, str(cap))


def _v2(mounts: list[tuple[str, str, set[str]]], own: dict[str, str]) -> Hierarchy | None:
    for mnt, fstype, _ in mounts:
        if fstype != "cgroup2" or "" not in own:
            continue
        base = os.path.join(mnt, own[""].lstrip("/"))
        try:
            ctrls = Hierarchy._v2_ctrls(base)
        except OSError:
            continue
        if {"memory", "pids"} <= ctrls and os.access(base, os.W_OK):
            h = Hierarchy(2, {"": base})
            try:  # the no-internal-process rule may forbid controllers below our own cgroup
                h._parents()
                return h
            except OSError:
                h.cleanup()
    return None


@functools.lru_cache(maxsize=1)
def hierarchy() -> Hierarchy:
    """The cgroup interface this host offers (cached); raises ``SandboxError`` if none."""
    mounts, own = _mounts(), _own_paths()
    h = _v2(mounts, own)
    if h is not None:
        return h
    bases: dict[str, str] = {}
    for mnt, fstype, opts in mounts:
        for c in ("memory", "pids", "cpu"):
            if fstype == "cgroup" and c in opts and c in own and c not in bases:
                base = os.path.join(mnt, own[c].lstrip("/"))
                if os.access(base, os.W_OK):
                    bases[c] = base
    missing = [c for c in ("memory", "pids") if c not in bases]
    if missing:
        raise SandboxError(f"cgroup: no usable {' or '.join(missing)} controller (cgroup v2 with memory+pids "
                           "delegated, or writable v1 hierarchies); the sandbox's memory/process limits "
                           "cannot be enforced")
    return Hierarchy(1, bases)
