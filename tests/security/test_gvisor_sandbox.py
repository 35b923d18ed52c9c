"""Hostile root code inside a gvisor-tier sandbox (ContainerBackend runtime runsc) tries
to break out: the hostile-agent tests of test_native_sandbox.py, run unchanged on this
tier where they apply (this module's ``backend`` fixture is the gvisor backend), and the
gVisor-specific expectations where the answer differs by design.

Differs by design (the Sentry is the sandbox's kernel; see container/runsc.py):
- namespace, mount, keyring, ptrace, bpf-like calls: many *succeed* inside gVisor - they
  act on the Sentry's own emulated kernel, never reach the host's - so the native DENIED
  list is replaced by: the ones the Sentry does not implement or refuses stay refused,
  and whatever succeeds leaves the host unchanged (test_sentry_calls_stay_in_the_sentry).
- clone3: the Sentry answers ENOSYS itself (not our seccomp filter; exec'd processes run
  without the OCI filter in this runsc - only init has it).
- io_uring: the Sentry implements it (its own, not the host's): in SENTRY_ONLY.
- foreign ABIs (int 0x80, x32): no SIGSYS from a filter; the Sentry traps every
  syscall and does not serve them (test_foreign_syscall_abis_do_not_reach_a_kernel).
- fds: the exec's stdio pipes show as ``host:[N]`` (fds the Sentry imported from the
  host), not ``pipe:`` (test_no_host_fd_beyond_stdio_is_reachable).
Not run here: test_exec_children_are_not_reachable_before_they_enter (a race of the
native driver's setns: runsc exec creates the task inside the Sentry, never half
outside), test_setuid_binaries_from_a_sandbox_do_not_work_on_the_host and
test_all_sandboxes_together_cannot_exhaust_the_node_pid_space (they build their own
native backends; the root_dir and the pids budget are the shared ContainerBackend code).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends import make_backend
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import _cleanup
from tests.security.conftest import PROBE_SPEC, _rmdir_everywhere, new_sid, probe, sh
from tests.security.test_native_sandbox import (
    host_marker,  # noqa: F401 - a fixture the imported tests use
    test_chroot_and_proc_root_tricks_stay_inside,
    test_disk_bytes_caps_the_upper_layer,
    test_sandboxes_cannot_reach_each_others_loopback,
    test_vsock_is_not_shared_with_the_host,
)

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)"),
              pytest.mark.skipif(shutil.which("runsc") is None,
                                 reason="needs runsc (make setup installs it)")]

__all__ = [
    "test_chroot_and_proc_root_tricks_stay_inside", "test_disk_bytes_caps_the_upper_layer",
    "test_sandboxes_cannot_reach_each_others_loopback",
    "test_vsock_is_not_shared_with_the_host",
]


@pytest.fixture
async def backend(tmp_path: object, images_dir: str) -> AsyncIterator[ContainerBackend]:
    b = make_backend("gvisor", root_dir=os.path.join(str(tmp_path), "groot"),
                     images=DirectoryImages(images_dir))
    assert isinstance(b, ContainerBackend)
    try:
        yield b
    finally:
        await _cleanup(b)
        _rmdir_everywhere(f"dsec-{b.cgroup_name}")


# What the native suite refuses that the Sentry refuses too (errno words as probe.c
# prints them); measured on Debian's runsc 2022-12 (ptrace).
REFUSED = (
    "clone_newnet", "setns_mnt", "mount_proc", "mount_cgroup", "fsopen", "open_tree",
    "keyctl", "add_key", "userfaultfd", "bpf", "perf_event_open", "init_module",
    "finit_module", "open_by_handle_at", "mknod_mem", "kmsg", "proc_sys_write",
    "sys_write", "sethostname", "settime", "keyring_id", "clone3_userns", "clone3_plain",
)
# ... and what the Sentry implements for itself: allowed, but inside its kernel only
SENTRY_ONLY = ("clone_userns", "clone_newns", "unshare_user", "unshare_mnt", "ptrace_traceme",
               "io_uring_setup")


async def test_refused_calls_stay_refused(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    let_through = {}
    for name in REFUSED:
        _, word = await probe(backend, sid, name)
        if word == "ok" or word.startswith("keyring_id"):
            let_through[name] = word
    assert not let_through, f"calls allowed inside the gvisor sandbox: {let_through}"


def _host_namespaces(backend: ContainerBackend, sid: str) -> set[str]:
    """The host namespaces (user, mnt, net, pid) of every host task of the sandbox."""
    out = set()
    for pid in backend.governor.pids(backend.box(sid).cg):
        for ns in ("user", "mnt", "net", "pid"):
            try:
                out.add(f"{ns}:{os.readlink(f'/proc/{pid}/ns/{ns}')}")
            except OSError:
                continue
    return out


async def test_sentry_calls_stay_in_the_sentry(backend: ContainerBackend) -> None:
    """Namespaces and ptrace the Sentry emulates succeed inside, and no host namespace
    or host process comes of them: the host tasks of the sandbox keep the namespaces
    they had (a native sandbox is refused these outright)."""
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    before = _host_namespaces(backend, sid)
    assert before
    for name in SENTRY_ONLY:
        await probe(backend, sid, name)
    code, out = await sh(backend, sid, "unshare -U sh -c 'echo inside-ns'")
    assert (code, out) == (0, "inside-ns\n")
    assert _host_namespaces(backend, sid) == before


@pytest.mark.parametrize("abi_probe", ["int80_getpid", "x32_getpid", "x32_unshare"])
async def test_foreign_syscall_abis_do_not_reach_a_kernel(backend: ContainerBackend,
                                                          abi_probe: str) -> None:
    """i386/x32 syscall numbers: the process dies (SIGSYS) or the call fails - never the
    getpid/unshare it would be on the host."""
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    code, word = await probe(backend, sid, abi_probe)
    failed = word.startswith("E") or (word.startswith("ok(-") and word.endswith(")"))
    assert code == 128 + 31 or failed, (code, word)


async def test_no_host_fd_beyond_stdio_is_reachable(backend: ContainerBackend) -> None:
    """The only host files a sandbox process holds are its own stdio (the exec's pipes,
    /dev/null), shown by gVisor as ``host:[N]``; nothing else of the host is open."""
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    r = await backend.exec(sid, ExecRequest(argv=("/probe", "fds")))
    fds = dict(line.split(" -> ", 1) for line in r.stdout.decode().splitlines())
    assert fds and all(t == "/dev/null" or t.startswith(("pipe:", "host:[")) for t in
                       fds.values()), fds
    assert {k.split()[-1] for k, t in fds.items() if t.startswith("host:[")} <= \
        {"0", "1", "2"}, fds
    await backend.exec(sid, ExecRequest(shell="sleep 30", background=True))
    _, out = await sh(backend, sid, "ls -l /proc/[0-9]*/fd/ 2>/dev/null | grep -- '->' "
                                    "| sed 's/.*-> //' | sort -u")
    targets = {t for t in out.split() if not t.startswith(("pipe:", "host:["))}
    assert targets <= {"/dev/null", "anon_inode:[signalfd]", "/proc/self/fd"}, targets
