"""The default seccomp profile: pure rules, and the compiled program really denies."""

from __future__ import annotations

import errno
import os

from dsec.net.seccomp import (
    AF_VSOCK,
    CLONE_NEWCGROUP,
    CLONE_NS_FLAGS,
    compile_profile,
    profile_rules,
)


def test_rules_cover_the_issue_list_and_nesting_switch() -> None:
    names = {r.syscall for r in profile_rules(allow_nested=False)}
    for must in ("mount", "umount2", "pivot_root", "ptrace", "kexec_load", "kexec_file_load",
                 "init_module", "finit_module", "delete_module", "bpf", "perf_event_open",
                 "keyctl", "add_key", "request_key", "reboot", "swapon", "swapoff",
                 "open_by_handle_at", "userfaultfd", "unshare", "setns", "clone", "clone3"):
        assert must in names
    clone_masks = {r.arg0_mask for r in profile_rules(allow_nested=False) if r.syscall == "clone"}
    assert clone_masks == set(CLONE_NS_FLAGS)
    nested = profile_rules(allow_nested=True)
    assert "ptrace" in {r.syscall for r in nested}
    # nesting lets namespaces through - but never a cgroup namespace (a view of the
    # sandbox's own cgroup files), and clone3 (flags in memory) stays ENOSYS
    ns_rules = {(r.syscall, r.arg0_mask) for r in nested if r.syscall in ("unshare", "clone")}
    assert ns_rules == {("unshare", CLONE_NEWCGROUP), ("clone", CLONE_NEWCGROUP)}
    assert [r.errno for r in nested if r.syscall == "clone3"] == [errno.ENOSYS]
    assert "mount" not in {r.syscall for r in nested}


def test_compiled_program_denies_in_a_child() -> None:
    from dsec.edge.backends.container import linux

    bpf = compile_profile(allow_nested=False)
    assert len(bpf) % 8 == 0 and len(bpf) > 0
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            linux.set_no_new_privs()
            linux.load_seccomp(bpf)
            for fn in (lambda: linux.unshare(linux.CLONE_NEWUSER),
                       lambda: linux.mount("none", "/mnt", "tmpfs")):
                try:
                    fn()
                    code |= 1
                except OSError as exc:
                    code |= 0 if exc.errno == errno.EPERM else 2
            os.getpid()  # allowed calls still work
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    result = os.read(r, 1)
    os.waitpid(pid, 0)
    assert result == b"\x00"


def test_vsock_and_io_uring_rules() -> None:
    rules = profile_rules(allow_nested=True)  # denied with or without nesting
    vsock = [r for r in rules if r.syscall == "socket"]
    assert [(r.arg0_eq, r.arg0_mask, r.errno) for r in vsock] == [
        (AF_VSOCK, None, errno.EAFNOSUPPORT)]
    assert {r.syscall for r in rules if r.errno == errno.ENOSYS} >= {
        "io_uring_setup", "io_uring_enter", "io_uring_register"}


def test_compiled_program_refuses_vsock_but_not_other_sockets() -> None:
    import socket

    from dsec.edge.backends.container import linux

    bpf = compile_profile(allow_nested=False)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        out = b"?"
        try:
            linux.set_no_new_privs()
            linux.load_seccomp(bpf)
            try:
                socket.socket(AF_VSOCK, socket.SOCK_STREAM).close()
                out = b"vsock-allowed"
            except OSError as exc:
                if exc.errno == errno.EAFNOSUPPORT:
                    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
                    out = b"ok"
                else:
                    out = str(exc.errno).encode()
        finally:
            os.write(w, out)
            os._exit(0)
    os.close(w)
    result = os.read(r, 64)
    os.waitpid(pid, 0)
    assert result == b"ok"
