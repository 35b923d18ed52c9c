"""Hostile root code inside a gvisor-tier sandbox (ContainerBackend runtime runsc) tries
to break out: the hostile-agent tests of test_native_sandbox.py, run unchanged on this
tier where they apply (this module's ``backend`` fixture is the gvisor backend), and the
gVisor-specific expectations where the answer differs by design.

Every exec'd process runs under the native seccomp profile inside the Sentry (runsc
gives an exec'd process none, so runsc.py starts each through nsexec's ``filter``
mode), so the native refusal tests hold unchanged. What differs by design (the Sentry is
the sandbox's kernel; see container/runsc.py):
- with ``allow_nested`` the profile lets namespaces through: they are the Sentry's own,
  and no host namespace comes of them (test_nested_namespaces_stay_in_the_sentry);
- foreign ABIs (int 0x80, x32): the Sentry traps every syscall and does not serve
  them; int 0x80 fails with an error rather than SIGSYS
  (test_foreign_syscall_abis_do_not_reach_a_kernel);
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

import msgspec
import pytest

from dsec.edge.backends import make_backend
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import _cleanup
from tests.security.conftest import PROBE_SPEC, _rmdir_everywhere, new_sid, probe, sh
from tests.security.test_native_sandbox import (
    host_marker,  # noqa: F401 - a fixture the imported tests use
    test_chroot_and_proc_root_tricks_stay_inside,
    test_clone3_answers_enosys_so_libc_falls_back_to_clone,
    test_disk_bytes_caps_the_upper_layer,
    test_io_uring_is_unavailable,
    test_privileged_syscalls_are_refused,
    test_sandboxes_cannot_reach_each_others_loopback,
    test_vsock_is_not_shared_with_the_host,
)

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)"),
              pytest.mark.skipif(shutil.which("runsc") is None,
                                 reason="needs runsc (make setup installs it)")]

__all__ = [
    "test_chroot_and_proc_root_tricks_stay_inside",
    "test_clone3_answers_enosys_so_libc_falls_back_to_clone",
    "test_disk_bytes_caps_the_upper_layer",
    "test_io_uring_is_unavailable",
    "test_privileged_syscalls_are_refused",
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


async def test_nested_namespaces_stay_in_the_sentry(backend: ContainerBackend) -> None:
    """``allow_nested`` lets namespace calls through the profile; on gVisor they make
    namespaces of the Sentry's kernel: the host tasks of the sandbox keep the host
    namespaces they had."""
    sid = new_sid()
    await backend.create(sid, msgspec.structs.replace(PROBE_SPEC, allow_nested=True))
    before = _host_namespaces(backend, sid)
    assert before
    for name in ("clone_userns", "unshare_user", "unshare_mnt"):
        assert (await probe(backend, sid, name))[1] == "ok", name
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
