"""Reaping the sandbox's orphans: this process is a child subreaper.

When a command is killed, bwrap's monitor (our child) and the sandbox's init (its child)
die together; the init is then an orphan, and without a subreaper it would become a
zombie of the host's init (which, in a container, may never reap it). With
``PR_SET_CHILD_SUBREAPER`` it is reparented to us instead, and ``reap`` collects exactly
the init pids bwrap reported (``child-pid``) — never ``waitpid(-1)``, which would steal the
exit status of children that asyncio or ``subprocess`` are waiting for.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

PR_SET_CHILD_SUBREAPER = 36
_pending: set[int] = set()
ACTIVE: set[int] = set()  # pids of running bwrap monitors (asyncio waits for those itself)
_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def enable() -> bool:
    """Make this process a child subreaper (once); False if the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(comm, state, parent pid) of ``pid``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    head, _, tail = data.rpartition(")")
    fields = tail.split()
    return head.partition("(")[2], fields[0], int(fields[1])


def reap(pids: tuple[int, ...] = ()) -> int:
    """Collect the orphaned inits among ``pids`` and earlier ones; returns how many are left."""
    me = os.getpid()
    with _lock:
        _pending.update(pids)
        for pid in list(_pending):
            st = _stat(pid)
            if st is None:  # gone: reaped by bwrap's monitor
                _pending.discard(pid)
            elif st[2] != me or pid in ACTIVE:
                continue
            elif st[0] != "bwrap":  # the pid was reused by something not ours
                _pending.discard(pid)
            elif st[1] != "Z":  # still dying
                continue
            else:
                try:
                    got, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    got = pid
                if got == pid:
                    _pending.discard(pid)
        return len(_pending)
