"""The seccomp filter every sandboxed command runs under, as a classic-BPF program for
``bwrap --seccomp FD`` (generated here in pure Python: no libseccomp needed).

    prog = program()        # bytes: struct sock_filter[], native byte order

The filter denies (``EPERM``) the system calls a sandboxed command never needs and an
attacker would: ``ptrace``, ``process_vm_readv/writev``, ``kcmp``, ``pidfd_getfd`` (reading
or steering other processes); ``perf_event_open``, ``userfaultfd``, ``bpf``, ``io_uring_setup``
(kernel attack surface); ``keyctl``, ``add_key``, ``request_key`` (kernel keyrings); every
mounting call (``mount``, ``umount2``, ``pivot_root``, ``chroot``, the new mount API),
``unshare``/``setns``, module loading, ``kexec``, ``reboot``, swap, ``acct``, ``quotactl``,
``syslog`` and handle-based opens. Calls of another ABI (i386 via ``int 0x80``, x32) are
denied as a whole, since their numbers differ. bwrap installs the filter (with
``no_new_privs``) just before it executes the command, after its own mounts.

Layout of the program::

    ld  [arch]      ; jne NATIVE_ARCH -> deny
    ld  [nr]        ; (x86_64) jge 0x40000000 -> deny    (x32 ABI)
    jeq NR_1 -> deny ... jeq NR_n -> deny
    ret ALLOW
    deny: ret ERRNO(EPERM)

An architecture not listed here has no table: the sandbox refuses to start (``SandboxError``).
"""

from __future__ import annotations

import functools
import platform
import struct

from mixrl.envs.sandbox.limits import SandboxError

# BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h).
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_EPERM = 1
_X32_BIT = 0x40000000

DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "perf_event_open",
          "userfaultfd", "bpf", "io_uring_setup", "keyctl", "add_key", "request_key", "mount", "umount2",
          "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
          "mount_setattr", "unshare", "setns", "init_module", "finit_module", "delete_module", "kexec_load",
          "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog",
          "open_by_handle_at", "name_to_handle_at")

# (AUDIT_ARCH, {name: number}); numbers from arch/x86/entry/syscalls/syscall_64.tbl and
# include/uapi/asm-generic/unistd.h (arm64).
_NEW_MOUNT_API = {"open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
                  "fspick": 433, "pidfd_getfd": 438, "mount_setattr": 442, "io_uring_setup": 425}
TABLES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "perf_event_open": 298,
        "userfaultfd": 323, "bpf": 321, "keyctl": 250, "add_key": 248, "request_key": 249, "mount": 165,
        "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308, "init_module": 175,
        "finit_module": 313, "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320, "reboot": 169,
        "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179, "syslog": 103,
        "open_by_handle_at": 304, "name_to_handle_at": 303, **_NEW_MOUNT_API}),
    "aarch64": (0xC00000B7, {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "perf_event_open": 241,
        "userfaultfd": 282, "bpf": 280, "keyctl": 219, "add_key": 217, "request_key": 218, "mount": 40,
        "umount2": 39, "pivot_root": 41, "chroot": 51, "unshare": 97, "setns": 268, "init_module": 105,
        "finit_module": 273, "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294, "reboot": 142,
        "swapon": 224, "swapoff": 225, "acct": 89, "quotactl": 60, "syslog": 116,
        "open_by_handle_at": 265, "name_to_handle_at": 264, **_NEW_MOUNT_API}),
}


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


@functools.lru_cache(maxsize=4)
def program(machine: str | None = None) -> bytes:
    """The filter for ``machine`` (default: this host's), as bytes for ``--seccomp``."""
    machine = machine or platform.machine()
    if machine not in TABLES:
        raise SandboxError(f"seccomp: no system-call table for architecture {machine!r}; "
                           f"supported: {', '.join(TABLES)}")
    arch, table = TABLES[machine]
    nrs = sorted({table[name] for name in DENIED})
    body: list[tuple[int, int, int, int]] = []  # (code, jt, jf, k) with jt = "to deny" marker -1
    body.append((_LD_W_ABS, 0, 0, 4))  # seccomp_data.arch
    body.append((_JEQ_K, 1, 0, arch))  # native: skip the deny jump below
    body.append((-1, 0, 0, 0))  # unconditional jump to deny (filled in below)
    body.append((_LD_W_ABS, 0, 0, 0))  # seccomp_data.nr
    if machine == "x86_64":
        body.append((_JGE_K, -1, 0, _X32_BIT))
    body += [(_JEQ_K, -1, 0, nr) for nr in nrs]
    body.append((_RET_K, 0, 0, _RET_ALLOW))
    deny = len(body)
    body.append((_RET_K, 0, 0, _RET_ERRNO | _EPERM))
    out = []
    for i, (code, jt, jf, k) in enumerate(body):
        if code == -1:  # "ja deny"
            out.append(_insn(0x05, 0, 0, deny - i - 1))
            continue
        if jt == -1:
            jt = deny - i - 1
            assert jt <= 255, "seccomp: deny list too long for 8-bit jumps"
        out.append(_insn(code, jt, jf, k))
    return b"".join(out)
