"""The default seccomp profile of a container sandbox.

A deny list on top of "allow": the calls that let root inside a sandbox reach the kernel's
global state (mounts, modules, kexec, keyrings, bpf, perf, swap, reboot), inspect other
processes (ptrace), open files by handle (escapes a chroot), or build new namespaces
(unless the spec asks for ``allow_nested``; a new cgroup namespace even then) answer
``EPERM``. ``clone3`` answers
``ENOSYS`` because its flags live in a struct seccomp cannot read; libc then falls back to
``clone``, whose flags we can check. Calls from a non-native ABI (i386 ``int 0x80``) kill
the process (libseccomp's default bad-arch action).

Also refused: ``socket(AF_VSOCK, ...)`` (vsock is not confined by network namespaces: a
sandbox would share the VM's vsock port space with the host and reach the hypervisor) and
io_uring (``ENOSYS``, as on a kernel built without it, so runtimes fall back to epoll; a
large, often-exploited kernel surface that Docker's default profile blocks too).

The profile is a pure description (:func:`profile_rules`); :func:`compile_profile` turns it
into classic BPF bytes with libseccomp once per helper process, and the helper loads those
bytes in each new process with one prctl (``linux.load_seccomp``): building costs ~ms,
loading ~µs.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "AF_VSOCK",
    "CLONE_NEWCGROUP",
    "CLONE_NS_FLAGS",
    "DENIED_ALWAYS",
    "DENIED_ENOSYS",
    "DENIED_UNLESS_NESTED",
    "Rule",
    "compile_profile",
    "compile_rules",
    "profile_rules",
]

# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
CLONE_NS_FLAGS: tuple[int, ...] = (0x00020000, 0x02000000, 0x04000000, 0x08000000,
                                   0x10000000, 0x20000000, 0x40000000)
CLONE_NEWCGROUP = 0x02000000

DENIED_ALWAYS: tuple[str, ...] = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    "kexec_load", "kexec_file_load", "reboot",
    "init_module", "finit_module", "delete_module", "create_module",
    "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key",
    "swapon", "swapoff", "acct", "quotactl", "syslog",
    "open_by_handle_at", "name_to_handle_at",
    "iopl", "ioperm", "lookup_dcookie", "uselib", "ustat", "sysfs", "_sysctl",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "stime",
    "nfsservctl", "vm86", "vm86old", "get_kernel_syms", "query_module",
)
# Answer ENOSYS (the call "does not exist"), so libraries fall back instead of failing.
DENIED_ENOSYS: tuple[str, ...] = ("io_uring_setup", "io_uring_enter", "io_uring_register")
AF_VSOCK = 40
# Mount and namespace calls. With allow_nested they are permitted, but CAP_SYS_ADMIN stays
# dropped, so they only work inside a user namespace the sandbox creates itself - except a
# new cgroup namespace, refused even then: one made with such a user namespace lets the
# sandbox mount cgroupfs rooted at its own cgroup, and without a sandbox user namespace
# its root is host uid 0, the owner of the cgroup files - it raised its own pids.max,
# memory and CPU limits (tests/security/test_nested_cgroups.py).
DENIED_UNLESS_NESTED: tuple[str, ...] = (
    "mount", "umount", "umount2", "pivot_root", "unshare", "setns",
    "fsopen", "fsmount", "fsconfig", "fspick", "move_mount", "open_tree", "mount_setattr",
)


@dataclass(frozen=True, slots=True)
class Rule:
    """``syscall`` answers ``errno``; with ``arg0_mask`` only when ``arg0 & mask == mask``,
    with ``arg0_eq`` only when ``arg0 == arg0_eq``, with ``arg1_masked=(mask, value)``
    only when ``arg1 & mask == value`` (at most one of the three)."""

    syscall: str
    errno: int = errno.EPERM
    arg0_mask: int | None = None
    arg0_eq: int | None = None
    arg1_masked: tuple[int, int] | None = None


def profile_rules(*, allow_nested: bool) -> list[Rule]:
    """The deny rules of the default profile (pure: no libseccomp involved)."""
    rules = [Rule(name) for name in DENIED_ALWAYS]
    rules += [Rule(name, errno=errno.ENOSYS) for name in DENIED_ENOSYS]
    rules.append(Rule("socket", errno=errno.EAFNOSUPPORT, arg0_eq=AF_VSOCK))
    # clone3 carries its flags in memory: always ENOSYS (libc falls back to clone), or a
    # nested sandbox could ask for what the clone rules below refuse.
    rules.append(Rule("clone3", errno=errno.ENOSYS))
    if not allow_nested:
        rules += [Rule(name) for name in DENIED_UNLESS_NESTED]
        rules += [Rule("clone", arg0_mask=flag) for flag in CLONE_NS_FLAGS]
    else:
        rules += [Rule(name, arg0_mask=CLONE_NEWCGROUP) for name in ("unshare", "clone")]
    return rules


def compile_profile(*, allow_nested: bool) -> bytes:
    """Build the profile with libseccomp and return the BPF program bytes."""
    return compile_rules(profile_rules(allow_nested=allow_nested))


def compile_rules(rules: Iterable[Rule]) -> bytes:
    """Build "allow everything but ``rules``" with libseccomp; the BPF program bytes.
    (A part of the profile, e.g. for the fncall worker, which loads the profile in two
    stacked parts: the second one after the calls it still needs at admission.)

    Syscall names this libseccomp or architecture does not know (e.g. ``vm86`` on x86_64)
    are skipped: a call that does not exist cannot be made.
    """
    import pyseccomp

    f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for rule in rules:
        try:
            nr = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, rule.syscall)
        # pyseccomp raises an untyped error when libseccomp does not know the name
        except Exception:  # noqa: BLE001, S112
            continue
        if nr < 0:
            continue
        if rule.arg1_masked is not None:
            mask, value = rule.arg1_masked
            f.add_rule(pyseccomp.ERRNO(rule.errno), rule.syscall,
                       pyseccomp.Arg(1, pyseccomp.MASKED_EQ, mask, value))
        elif rule.arg0_eq is not None:
            f.add_rule(pyseccomp.ERRNO(rule.errno), rule.syscall,
                       pyseccomp.Arg(0, pyseccomp.EQ, rule.arg0_eq))
        elif rule.arg0_mask is None:
            f.add_rule(pyseccomp.ERRNO(rule.errno), rule.syscall)
        else:
            f.add_rule(pyseccomp.ERRNO(rule.errno), rule.syscall,
                       pyseccomp.Arg(0, pyseccomp.MASKED_EQ, rule.arg0_mask, rule.arg0_mask))
    fd = os.memfd_create("dsec-seccomp", os.MFD_CLOEXEC)
    try:
        with os.fdopen(os.dup(fd), "wb") as w:
            f.export_bpf(w)
        size = os.lseek(fd, 0, os.SEEK_END)
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)
