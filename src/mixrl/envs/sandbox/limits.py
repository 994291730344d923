"""What a sandbox may use, what a command returns, and the process-wide host settings.

``SandboxLimits`` is per episode (every command of one sandbox); ``HostConfig`` is per
process: where episode directories live and the memory cap shared by all episodes at
once (``configure(root=..., total_memory_bytes=..., grading_memory_bytes=...)`` or the
``MIXRL_SANDBOX_ROOT`` / ``MIXRL_SANDBOX_TOTAL_MEMORY`` variables), of which graders get
their own reserved part (``pool.py``).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field, fields


class SandboxError(RuntimeError):
    """The sandbox could not start or run: an infrastructure failure, never the model's."""


class DiffError(ValueError):
    """The episode's diff cannot be taken because of what the model did (too large, unreadable)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-episode limits. Every field has a bound; bad values raise naming the field."""

    cpu_seconds: int = 10  # RLIMIT_CPU per process (SIGXCPU, then SIGKILL)
    memory_bytes: int = 1 << 30  # RLIMIT_AS per process
    max_procs: int = 64  # RLIMIT_NPROC in the user ns, and the episode cgroup's pids.max
    file_size_bytes: int = 16 << 20  # RLIMIT_FSIZE: largest file a process may write
    open_files: int = 256  # RLIMIT_NOFILE
    wall_seconds: float = 30.0  # default timeout of one command
    output_bytes: int = 16 << 10  # output kept per command (the rest is dropped)
    tmp_bytes: int = 64 << 20  # size of the private /tmp and /dev/shm tmpfs (per command)
    disk_bytes: int = 64 << 20  # size of the episode's /testbed filesystem (tmpfs, hard bound)
    max_inodes: int = 20_000  # files + directories the episode's filesystem may hold
    diff_bytes: int = 1 << 20  # largest diff taken
    cgroup_memory_bytes: int = 1 << 30  # all processes of the episode plus its files, together
    cpus: float = 1.0  # CPU bandwidth of the episode (cgroup CPU quota), in cores

    def __post_init__(self) -> None:
        bounds = {
            "cpu_seconds": (1, 3600), "memory_bytes": (64 << 20, 1 << 40), "max_procs": (4, 4096),
            "file_size_bytes": (1 << 10, 1 << 34), "open_files": (16, 65536),
            "wall_seconds": (0.1, 3600.0), "output_bytes": (256, 1 << 26), "tmp_bytes": (1 << 20, 1 << 34),
            "disk_bytes": (1 << 20, 1 << 36), "max_inodes": (64, 1 << 24), "diff_bytes": (1 << 10, 1 << 28),
            "cgroup_memory_bytes": (64 << 20, 1 << 40), "cpus": (0.05, 1024.0),
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


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 8 << 30


@dataclass
class HostConfig:
    """Process-wide settings (one instance, ``HOST``)."""

    root: str | None = None  # where episode directories are created (None: MIXRL_SANDBOX_ROOT or temp dir)
    total_memory_bytes: int | None = None  # cap over all episodes at once (None: env or half of RAM)
    grading_memory_bytes: int | None = None  # part of it reserved for graders (None: see grading_memory)

    def episode_root(self) -> str:
        return self.root or os.environ.get("MIXRL_SANDBOX_ROOT") or tempfile.gettempdir()

    def total_memory(self) -> int:
        if self.total_memory_bytes is not None:
            return self.total_memory_bytes
        env = os.environ.get("MIXRL_SANDBOX_TOTAL_MEMORY")
        if env:
            try:
                v = int(env)
            except ValueError:
                raise SandboxError(f"MIXRL_SANDBOX_TOTAL_MEMORY must be an integer byte count, got {env!r}") from None
            if v < 64 << 20:
                raise SandboxError(f"MIXRL_SANDBOX_TOTAL_MEMORY must be >= {64 << 20}, got {v}")
            return v
        return min(16 << 30, _mem_total() // 2)

    def grading_memory(self) -> int:
        """The graders' reserved budget: a quarter of the total, at least 1 GiB while that
        leaves the episodes half; never the whole total."""
        total = self.total_memory()
        if self.grading_memory_bytes is not None:
            if not 0 < self.grading_memory_bytes < total:
                raise SandboxError(f"grading_memory_bytes must be in (0, total_memory {total}), "
                                   f"got {self.grading_memory_bytes}")
            return self.grading_memory_bytes
        return max(total // 4, min(1 << 30, total // 2))


HOST = HostConfig()


def configure(root: str | None = None, total_memory_bytes: int | None = None,
              grading_memory_bytes: int | None = None) -> None:
    """Set where episodes live, the shared memory cap and the graders' part of it; applies to
    sandboxes created after.

    Changing the cap while sandboxes run takes effect for the next cgroup parent (a fresh
    one is made whenever the setting changed)."""
    if total_memory_bytes is not None and (isinstance(total_memory_bytes, bool) or total_memory_bytes < 64 << 20):
        raise ValueError(f"configure: total_memory_bytes must be >= {64 << 20}, got {total_memory_bytes!r}")
    if grading_memory_bytes is not None and (isinstance(grading_memory_bytes, bool) or grading_memory_bytes < 64 << 20
                                             or (total_memory_bytes is not None
                                                 and grading_memory_bytes >= total_memory_bytes)):
        raise ValueError(f"configure: grading_memory_bytes must be >= {64 << 20} and below total_memory_bytes, "
                         f"got {grading_memory_bytes!r}")
    HOST.root = root
    HOST.total_memory_bytes = total_memory_bytes
    HOST.grading_memory_bytes = grading_memory_bytes
