"""A bubblewrap sandbox for tool calls: one per episode, one ``bwrap`` per command.

    sb = await Sandbox.create(repo_dir, SandboxLimits())   # private copy of repo_dir
    res = await sb.run("python -m pytest -q", timeout=30)   # ExecResult
    patch = await sb.diff()                                 # diff -ruN vs the snapshot
    await sb.close()                                        # kills, unmounts, removes

Modules: ``core.py`` (``Sandbox``: how a command starts and ends), ``runtime.py`` (bwrap's
mount table, the interpreter, pytest), ``cgroup.py`` (memory/pids/CPU caps per episode and
in total), ``fs.py`` (the episode's size- and inode-limited tmpfs, removal by unmount),
``seccomp.py`` (the BPF filter), ``reaper.py`` (orphaned inits), ``treediff.py`` (the diff,
computed inside), ``limits.py`` (limits, results, host settings), ``pool.py`` (admission:
the memory caps of live sandboxes never add up past the parent cap).

Layout and why it stays safe
----------------------------
Each episode owns a private host directory ``<root>/mixrl-sb-XXXX`` (``configure(root=...)``,
``MIXRL_SANDBOX_ROOT`` or the temp dir), a tmpfs mounted just for it, holding ``snapshot/``
(the pristine copy, read only inside) and ``work/`` (the episode's repository), and its own
cgroup. Every command is a new ``bwrap`` with fresh user, pid, network, ipc, uts and cgroup
namespaces; ``work/`` is bound read-write at ``/testbed``, the only writable host path. No
process of the model outlives its command (the pid namespace dies with it, and the cgroup is
swept), nothing in the sandbox can tamper with a supervisor, and every command starts from
the same known state except ``/testbed``. The host never reads or follows anything the
model wrote: ``diff`` runs in a sandbox, disk use is ``statvfs``, cleanup is an unmount.

Inside: ``/usr`` (and the ``/bin``, ``/lib*`` links) read-only, no ``/etc``, ``/home`` or
``/root``, a private ``/proc`` with ``/proc/cmdline`` masked, a minimal read-only ``/dev``,
size-capped tmpfs ``/tmp`` and ``/dev/shm`` (per command), the root read-only, a clean
environment, no capabilities, nested user namespaces disabled, a seccomp filter (no ptrace,
process_vm_*, perf_event_open, userfaultfd, keyctl, mounting ...). The network namespace
has only its own loopback.

Limits, each enforced by the kernel:

=================  =====================================================================
memory (total)     cgroup ``memory`` per episode (processes and their tmpfs files) under
                   one parent capped at ``HostConfig.total_memory`` for all episodes; a
                   sandbox starts only while the live caps fit (``pool.py``, graders
                   have their own budget): one episode's OOM never reaches another
processes          cgroup ``pids.max`` per episode, plus ``RLIMIT_NPROC`` per user ns
CPU                cgroup CPU quota (``cpus``), plus ``RLIMIT_CPU`` per process
disk, inodes       the episode's tmpfs ``size=`` and ``nr_inodes=``; a command that fills
                   it is killed (``killed_by == "disk"``)
per process        ``ulimit``: address space, file size, open files, no core dumps
wall time          the cgroup is SIGKILLed
=================  =====================================================================

When we are root, ``bwrap`` runs as an unprivileged host uid (``SANDBOX_UID``, ``nobody``):
root's processes are exempt from ``RLIMIT_NPROC``. Host paths bound read only (``/usr``,
pytest under the venv, the grader's files) must be readable by that uid.

Kernel features used, and a host without them: user namespaces (bwrap; without them every
command fails: ``SandboxError``); cgroup v2 with ``memory``+``pids`` delegated, else v1
``memory`` and ``pids`` hierarchies (neither: ``Sandbox.create`` raises ``SandboxError``
naming the limit; v1 ``cpu`` missing only loses the CPU quota); tmpfs mounts with
``CAP_SYS_ADMIN`` (missing: ``SandboxError`` naming the disk limit); seccomp BPF (bwrap
fails without it: ``SandboxError``); ``PR_SET_CHILD_SUBREAPER`` (missing: orphaned inits are
left to the host's init). Failures of ours raise ``SandboxError``: the environment turns
them into ``infra_failed``, never a reward of 0. Anything the model can cause (a crash, a
timeout, a full disk, unreadable files, a mode change, a huge command) is reported in the
result instead.
"""

from mixrl.envs.sandbox.core import SANDBOX_UID, Sandbox
from mixrl.envs.sandbox.fs import FAILURES
from mixrl.envs.sandbox.limits import (
           HOST,
           DiffError,
           ExecResult,
           SandboxError,
           SandboxLimits,
           configure,
)
from mixrl.envs.sandbox.runtime import INNER_UID, PYSITE, WORKDIR
from mixrl.envs.sandbox.treediff import DIFF_EXCLUDES

__all__ = ["DIFF_EXCLUDES", "FAILURES", "HOST", "INNER_UID", "PYSITE", "SANDBOX_UID", "WORKDIR", "DiffError",
           "ExecResult", "Sandbox", "SandboxError", "SandboxLimits", "configure"]
