"""The episode's filesystem: a size- and inode-limited tmpfs per episode, removed by unmounting.

    fs = EpisodeFS.create(src, limits, uid)   # <root>/mixrl-sb-XXXX, a fresh tmpfs
    fs.full()                                  # statvfs: no free block or inode left
    fs.teardown()                              # umount + rmdir; never walks the tree

Inside the mount: ``snapshot/`` (the pristine copy, owned by us, read only to the sandbox),
``work/`` (the episode's repository, owned by the sandbox uid) and, for grading,
``results/``. The kernel enforces the disk bound (``size=``) and the file-count bound
(``nr_inodes=``): a command past either gets ``ENOSPC``; nothing has to walk the model's
tree to measure it (a walk is what long names, deep trees and 190k empty files defeat).
The pages are charged to the memory cgroup of the process that writes them, so an
episode's files count against its memory cap too.

Removal never reads what the model wrote: the processes are killed first (``core.py``),
then the tmpfs is unmounted (lazily when still busy) and the now empty mount point removed.
No link is followed, no mode is changed, nothing above the episode root is touched; a
failure is logged and counted in ``FAILURES``, never retried on a parent.

Needs ``CAP_SYS_ADMIN`` in the host's mount namespace (root, or a container that grants
it); without it ``create`` raises ``SandboxError`` naming the disk limit.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import stat
import tempfile
from collections import Counter
from dataclasses import dataclass

from mixrl.envs.sandbox.limits import HOST, SandboxError, SandboxLimits

log = logging.getLogger(__name__)
FAILURES: Counter[str] = Counter()  # "umount", "rmdir": cleanups that could not complete
PAGE = 4096
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2
_libc = ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(target: str, size: int, inodes: int) -> None:
    opts = f"size={size},nr_inodes={inodes},mode=0711".encode()
    if _libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _umount(target: str, flags: int = 0) -> int:
    return 0 if _libc.umount2(target.encode(), flags) == 0 else ctypes.get_errno()


def _tree_cost(src: str) -> tuple[int, int]:
    """(bytes in pages, entries) of a trusted source tree (iterative)."""
    total, entries, stack = 0, 0, [src]
    while stack:
        d = stack.pop()
        with os.scandir(d) as it:
            for e in it:
                entries += 1
                st = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
                else:
                    total += -(-st.st_size // PAGE) * PAGE
    return total, entries


def _fix_modes(top: str, owner: int | None) -> None:
    """Modes the sandbox uid can use (trusted copy, just made by us)."""
    stack = [top]
    while stack:
        d = stack.pop()
        st = os.lstat(d)
        os.chmod(d, (st.st_mode & 0o700) | 0o755)
        if owner is not None:
            os.chown(d, owner, owner)
        with os.scandir(d) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
                elif not stat.S_ISLNK(st.st_mode):
                    os.chmod(e.path, (st.st_mode & 0o700) | 0o644)
                    if owner is not None:
                        os.chown(e.path, owner, owner)
                elif owner is not None:
                    os.chown(e.path, owner, owner, follow_symlinks=False)


@dataclass
class EpisodeFS:
    root: str  # the mount point (private episode directory)
    mounted: bool = False

    @property
    def snapshot(self) -> str:
        return os.path.join(self.root, "snapshot")

    @property
    def work(self) -> str:
        return os.path.join(self.root, "work")

    @classmethod
    def create(cls, src: str, limits: SandboxLimits, uid: int | None, base: str | None = None) -> EpisodeFS:
        """Mount a fresh tmpfs under ``base`` and copy ``src`` in twice; raises ``SandboxError``."""
        skip = shutil.ignore_patterns(".git", ".hg", ".svn")  # history could hold the fix
        cost, entries = _tree_cost(src)
        base = base or HOST.episode_root()
        try:
            root = tempfile.mkdtemp(prefix="mixrl-sb-", dir=base)
        except OSError as e:
            raise SandboxError(f"sandbox root {base!r}: cannot create an episode directory ({e})") from e
        fs = cls(root)
        try:
            try:
                _mount_tmpfs(root, limits.disk_bytes + cost + 16 * PAGE, limits.max_inodes + entries + 16)
            except OSError as e:
                raise SandboxError(f"disk limit: cannot mount a size-limited tmpfs for the episode at {root} "
                                   f"({e}; needs CAP_SYS_ADMIN); the disk and file-count limits cannot be "
                                   "enforced") from e
            fs.mounted = True
            shutil.copytree(src, fs.snapshot, symlinks=True, ignore=skip)
            shutil.copytree(src, fs.work, symlinks=True, ignore=skip)
            _fix_modes(fs.snapshot, None)
            _fix_modes(fs.work, uid)
            return fs
        except BaseException:
            fs.teardown()
            raise

    def mkdir(self, name: str, mode: int) -> str:
        """A directory of ours on the episode's tmpfs (grading results)."""
        p = os.path.join(self.root, name)
        os.mkdir(p)
        os.chmod(p, mode)
        return p

    def restore_work_mode(self) -> None:
        """The model may ``chmod 000 /testbed``; we put it back. ``work`` itself cannot be a
        link: it sits in the tmpfs root, which only we can write (mode 0711, ours)."""
        os.chmod(self.work, 0o755)

    def full(self) -> bool:
        """No free block or inode left on the episode's tmpfs (O(1), no walk)."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < PAGE or st.f_favail == 0

    def used(self) -> tuple[int, int]:
        """(bytes, inodes) in use on the tmpfs."""
        st = os.statvfs(self.root)
        return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree

    def teardown(self) -> bool:
        """Unmount and remove the mount point; False (logged, counted) if it could not."""
        ok = True
        if self.mounted:
            err = _umount(self.root)
            if err == errno.EBUSY:  # a straggler still has it open: detach now, freed when it closes
                err = _umount(self.root, MNT_DETACH)
            if err not in (0, errno.EINVAL):
                FAILURES["umount"] += 1
                log.error("sandbox cleanup: cannot unmount %s: %s", self.root, os.strerror(err))
                return False
            self.mounted = False
        try:
            os.rmdir(self.root)
        except FileNotFoundError:
            pass
        except OSError as e:
            FAILURES["rmdir"] += 1
            log.error("sandbox cleanup: cannot remove %s: %s", self.root, e)
            ok = False
        return ok
