"""What a sandboxed command runs with: bwrap, the interpreter, pytest, and bwrap's options.

``runtime()`` discovers once per process: ``bwrap``; ``python``/``python3`` (the system
interpreter when it has the host's major.minor version, else the host's base interpreter,
bound read only at its own path because of its rpath); pytest and its pure-Python
dependencies, bound read only under ``/opt/pysite``. ``bwrap_options`` writes the mount
table of one command (see the package docstring for what is inside and why).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from mixrl.envs.sandbox.limits import SandboxError, SandboxLimits

INNER_UID = 1000  # uid seen inside the sandbox
WORKDIR = "/testbed"  # the repository inside the sandbox
PYSITE = "/opt/pysite"  # pytest and its dependencies, read only
PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py", "exceptiongroup", "tomli")
ENV = {"PATH": "/opt/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "TERM": "dumb",
       "PYTHONPATH": PYSITE, "PYTHONDONTWRITEBYTECODE": "1", "USER": "sandbox",
       "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # no entry-point plugin from the repository


@dataclass(frozen=True)
class Runtime:
    bwrap: str
    python: str  # interpreter path inside the sandbox
    binds: tuple[tuple[str, str], ...]  # read-only (host, inside) binds besides /usr
    links: tuple[tuple[str, str], ...]  # (target, path) symlinks to create


@functools.lru_cache(maxsize=1)
def runtime() -> Runtime:
    """Discover bwrap, the interpreter and pytest once per process."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxError("bubblewrap (bwrap) is not installed; apt-get install bubblewrap")
    python, binds, links = _mounts()
    return Runtime(bwrap, python, binds, links)


def visible_host_paths() -> tuple[str, ...]:
    """Every host path a sandboxed command can read (besides what a caller binds itself):
    ``/usr``, the interpreter's prefix, pytest's packages, ``/bin`` and ``/lib*``."""
    _, binds, links = _mounts()
    paths = ["/usr", *(h for h, _ in binds), *(t for t, _ in links if t.startswith("/"))]  # relative: inside
    return tuple(dict.fromkeys(os.path.realpath(p) for p in paths))


def visible_in_sandbox(path: str) -> str | None:
    """The sandbox mount that makes host ``path`` readable inside, or None."""
    real = os.path.realpath(path)
    for m in visible_host_paths():
        if real == m or real.startswith(m.rstrip("/") + "/"):
            return m
    return None


@functools.lru_cache(maxsize=1)
def _mounts() -> tuple[str, tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """(interpreter path inside, read-only binds, symlinks) of every command; no bwrap needed."""
    binds: list[tuple[str, str]] = []
    links: list[tuple[str, str]] = []
    for d in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = "/" + d
        if os.path.islink(p):
            links.append((os.readlink(p), p))
        elif os.path.isdir(p):
            binds.append((p, p))
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
    for name in PYTEST_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        src = spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin
        binds.append((src, f"{PYSITE}/{os.path.basename(src)}"))
    links += [(python, "/opt/bin/python"), (python, "/opt/bin/python3")]
    return python, tuple(binds), tuple(links)


def bwrap_options(lim: SandboxLimits, binds: list[tuple[str, str, bool]], cwd: str) -> list[str]:
    """bwrap's options for one command (``{STATUS_FD}``/``{SECCOMP_FD}`` filled in by the caller).

    ``/proc/cmdline`` (the host kernel's command line) is masked by an empty file."""
    rt = runtime()
    a = ["--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
         "--new-session", "--uid", str(INNER_UID), "--gid", str(INNER_UID), "--hostname", "sandbox",
         "--ro-bind", "/usr", "/usr"]
    for target, path in rt.links:
        a += ["--symlink", target, path]
    for host, inside in rt.binds:
        a += ["--ro-bind", host, inside]
    a += ["--proc", "/proc", "--ro-bind", "/dev/null", "/proc/cmdline", "--dev", "/dev",
          "--size", str(lim.tmp_bytes), "--tmpfs", "/tmp", "--size", str(lim.tmp_bytes), "--tmpfs", "/dev/shm"]
    for host, inside, writable in binds:
        a += ["--bind" if writable else "--ro-bind", host, inside]
    a += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", cwd, "--clearenv"]
    for k, v in ENV.items():
        a += ["--setenv", k, v]
    a += ["--seccomp", "{SECCOMP_FD}", "--json-status-fd", "{STATUS_FD}"]
    return a


def ulimits(lim: SandboxLimits) -> str:
    """Per-process limits as bash ``ulimit`` calls (no ``prlimit`` exec: one process less per
    command); a limit that cannot be set stops the command (exit 125) instead of running it."""
    return (f"ulimit -c 0 -n {lim.open_files} -f {lim.file_size_bytes // 1024} -u {lim.max_procs} "
            f"-v {lim.memory_bytes // 1024} && ulimit -S -t {lim.cpu_seconds} && "
            f"ulimit -H -t {lim.cpu_seconds + 1} || exit 125")


def limited(lim: SandboxLimits, argv: list[str]) -> list[str]:
    """``argv`` run by bash after ``ulimits``."""
    return ["/bin/bash", "-c", f'{ulimits(lim)}; exec "$@"', "sandbox", *argv]
