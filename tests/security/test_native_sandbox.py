"""Hostile root code inside a native container sandbox tries to break out.

Each test is a real attempt made from inside a sandbox (busybox + the static ``/probe``
from conftest). A test passes when the attempt fails. Attempts that succeed today are
kept as ``xfail(strict=True)`` with the hole named in the reason, so the suite stays
green while the hole is on record - and turns red the day it is fixed (remove the mark).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.container.conftest import _cleanup
from tests.security.conftest import PROBE_SPEC, new_sid, probe, sh

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

ENOSYS = "E38"

# Calls that reach kernel-global state or build new namespaces: each must be refused.
DENIED = (
    "clone_userns", "clone_newns", "clone_newnet", "unshare_user", "unshare_mnt",
    "setns_mnt", "mount_proc", "mount_cgroup", "fsopen", "open_tree", "keyctl", "add_key",
    "userfaultfd", "bpf", "perf_event_open", "ptrace_traceme", "init_module",
    "finit_module", "open_by_handle_at", "mknod_mem", "kmsg", "proc_sys_write",
    "sys_write", "sethostname", "settime",
)


@pytest.fixture
def host_marker() -> Iterator[str]:
    """A host file holding a secret, at a path that exists only on the host."""
    d = tempfile.mkdtemp(prefix="dsec-sec-host-")
    path = os.path.join(d, "shadow")
    with open(path, "w") as f:
        f.write("host-secret-" + secrets.token_hex(8))
    try:
        yield path
    finally:
        os.unlink(path)
        os.rmdir(d)


async def test_privileged_syscalls_are_refused(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    let_through = {}
    for name in DENIED:
        code, word = await probe(backend, sid, name)
        if word == "ok":
            let_through[name] = code
    assert not let_through, f"calls allowed inside the sandbox: {sorted(let_through)}"


async def test_clone3_answers_enosys_so_libc_falls_back_to_clone(
        backend: ContainerBackend) -> None:
    """seccomp cannot read clone3's flags (they are in memory): the call must fail with
    ENOSYS - plain or with CLONE_NEWUSER - and plain fork must still work."""
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    assert (await probe(backend, sid, "clone3_userns"))[1] == ENOSYS
    assert (await probe(backend, sid, "clone3_plain"))[1] == ENOSYS
    code, out = await sh(backend, sid, "(echo forked) | cat")
    assert (code, out) == (0, "forked\n")


@pytest.mark.parametrize("abi_probe", ["int80_getpid", "x32_getpid", "x32_unshare"])
async def test_foreign_syscall_abis_are_killed(backend: ContainerBackend,
                                               abi_probe: str) -> None:
    """i386 (int 0x80) and x32 syscall numbers bypass an x86_64-only rule set unless the
    filter checks the ABI: the process must die (SIGSYS -> 159) or get ENOSYS."""
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    code, word = await probe(backend, sid, abi_probe)
    assert code == 128 + 31 or word == ENOSYS, (code, word)


async def test_io_uring_is_unavailable(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    assert (await probe(backend, sid, "io_uring_setup"))[1] != "ok"


async def test_chroot_and_proc_root_tricks_stay_inside(backend: ContainerBackend,
                                                       host_marker: str) -> None:
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    # Classic chroot escape (chroot into a subdir, chdir .. many times, chroot .).
    assert (await probe(backend, sid, "chroot_escape", host_marker))[1] != "ok"
    for trick in (host_marker, f"/proc/1/root{host_marker}", f"/proc/self/root{host_marker}",
                  f"/proc/1/cwd{host_marker}"):
        assert (await probe(backend, sid, "stat", trick))[1] != "ok", trick


async def test_no_host_fd_is_reachable_from_inside(backend: ContainerBackend) -> None:
    """No helper socket, pidfd or host file is open in any sandbox process (init or
    exec'd), so /proc/<pid>/fd cannot hand one to the agent."""
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    r = await backend.exec(sid, ExecRequest(argv=("/probe", "fds")))
    links = [line.split(" -> ", 1)[1] for line in r.stdout.decode().splitlines()]
    assert links and all(t == "/dev/null" or t.startswith("pipe:") for t in links), links
    await backend.exec(sid, ExecRequest(shell="sleep 30", background=True))
    _, out = await sh(backend, sid, "ls -l /proc/[0-9]*/fd/ 2>/dev/null | grep -- '->' "
                                       "| sed 's/.*-> //' | sort -u")
    targets = set(out.split())
    allowed = {"/dev/null", "anon_inode:[signalfd]", "/proc/self/fd"}
    assert {t for t in targets if not t.startswith("pipe:")} <= allowed, targets


async def test_exec_children_are_not_reachable_before_they_enter(
        backend: ContainerBackend, host_marker: str) -> None:
    """An exec child appears in the sandbox's pid namespace while it still has the host's
    root, cwd and the helper's fds (before setns). A sandbox process hammering
    /proc/<pid>/{root,cwd,fd} during many execs must never reach any of them."""
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    await backend.exec(sid, ExecRequest(
        shell=f"/probe procroot_loop {host_marker} 3 > /tmp/loop.out 2>&1", background=True))
    deadline = asyncio.get_running_loop().time() + 2.5
    n = 0
    while asyncio.get_running_loop().time() < deadline:
        # user= makes the child parse /etc/passwd before it drops privileges: a longer window.
        await asyncio.gather(*(backend.exec(sid, ExecRequest(argv=("true",), user="agent"))
                               for _ in range(4)))
        n += 4
    for _ in range(100):
        out = (await backend.read_file(sid, "/tmp/loop.out")).decode()
        if "procroot_loop" in out:
            break
        await asyncio.sleep(0.05)
    assert "procroot_loop tries=" in out, out
    assert "HIT" not in out and out.rstrip().endswith("hits=0"), out
    assert n >= 8


async def test_sandboxes_cannot_reach_each_others_loopback(backend: ContainerBackend) -> None:
    a, b = new_sid(), new_sid()
    await backend.create(a, PROBE_SPEC)
    await backend.create(b, PROBE_SPEC)
    await backend.exec(b, ExecRequest(shell="while :; do echo b-secret | nc -l -p 5555; done",
                                      background=True))
    for _ in range(50):  # b can reach its own listener ...
        _, out = await sh(backend, b, "nc -w1 127.0.0.1 5555 </dev/null")
        if "b-secret" in out:
            break
        await asyncio.sleep(0.05)
    assert "b-secret" in out
    r = await backend.exec(a, ExecRequest(shell="nc -w1 127.0.0.1 5555 </dev/null; "
                                                "grep -c ':15B3 ' /proc/net/tcp"))  # a cannot
    assert b"b-secret" not in r.stdout and r.stdout.split()[-1:] == [b"0"], r


async def test_vsock_is_not_shared_with_the_host(backend: ContainerBackend) -> None:
    try:
        host = socket.socket(40, socket.SOCK_STREAM)  # AF_VSOCK
    except OSError:
        pytest.skip("no AF_VSOCK on this host")
    try:
        host.bind((0xFFFFFFFF, 0))  # VMADDR_CID_ANY, any port
        port = host.getsockname()[1]
        sid = new_sid()
        await backend.create(sid, PROBE_SPEC)
        # EADDRINUSE (98) means the sandbox sees the host's own vsock port table.
        assert (await probe(backend, sid, "vsock_bind", str(port)))[1] != "E98"
    finally:
        host.close()


async def test_disk_bytes_caps_the_upper_layer(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SandboxSpec(backend="container", disk_bytes=4 << 20,
                                          memory_bytes=256 << 20, pids_max=64))
    code, out = await sh(backend, sid, "dd if=/dev/zero of=/root/fill bs=1M count=16")
    assert code != 0, f"16 MiB written with disk_bytes=4 MiB: {out}"
    # The cap is a btrfs qgroup (edge/backends/container/disk.py): the kernel answers a
    # write past it with EDQUOT; a full pool would be ENOSPC. Either way it fails inside.
    assert "Disk quota exceeded" in out, out
    code, out = await sh(backend, sid, "rm /root/fill && echo fine > /root/ok && cat /root/ok")
    assert (code, out) == (0, "fine\n")  # freeing space makes it writable again


async def test_setuid_binaries_from_a_sandbox_do_not_work_on_the_host(images_dir: str) -> None:
    parent = tempfile.mkdtemp(prefix="dsec-sec-suid-")
    os.chmod(parent, 0o755)  # like /var/lib: the docs' example root_dir sits in one
    b = ContainerBackend(root_dir=os.path.join(parent, "root"),
                         images=DirectoryImages(images_dir))
    try:
        sid = new_sid()
        await b.create(sid, PROBE_SPEC)
        code, out = await sh(b, sid, "cp /probe /root/suid && chmod 4755 /root/suid")
        assert code == 0, out
        planted = os.path.join(b.upper_dir(sid), "root/suid")
        for d in (b.root_dir, os.path.join(b.root_dir, "sb"), os.path.dirname(b.upper_dir(sid))):
            assert os.stat(d).st_mode & 0o777 == 0o700, d
        try:
            r = subprocess.run(  # noqa: ASYNC221 - a short, host-side run as nobody
                [planted, "euid"], user=65534, group=65534, extra_groups=[],
                capture_output=True, text=True, timeout=10, check=False)
        except PermissionError:
            pass  # nobody cannot even reach it: root_dir is 0700
        else:
            assert r.stdout.strip() != "euid=0", "nobody became root through the sandbox's file"
        # Every sandbox's upper lives on the backend's disk pool (a btrfs mount, see
        # container/disk.py): nosuid and nodev there too, so even a path that reached the
        # file would not run it setuid.
        upper = b.upper_dir(sid)
        mounts = [line.split() for line in _read("/proc/self/mountinfo").splitlines()]
        holder = max((m for m in mounts if upper == m[4] or upper.startswith(m[4] + "/")),
                     key=lambda m: len(m[4]))
        assert holder[4] != "/", f"{upper} is not on a dsec-owned mount"
        assert {"nosuid", "nodev"} <= set(holder[5].split(",")), holder
    finally:
        await _cleanup(b)
        shutil.rmtree(parent, ignore_errors=True)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _effective_pids_max(cgroup_dir: str) -> float:
    """The tightest pids.max on ``cgroup_dir`` and its ancestors (v1 or v2)."""
    best = float("inf")
    d = cgroup_dir
    while os.path.exists(os.path.join(d, "pids.max")):
        v = _read(os.path.join(d, "pids.max"))
        if v != "max":
            best = min(best, int(v))
        d = os.path.dirname(d)
    return best


async def test_all_sandboxes_together_cannot_exhaust_the_node_pid_space(
        backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    pid_max = int(_read("/proc/sys/kernel/pid_max"))
    base = os.path.dirname(backend.governor.paths(sid).dirs.get(
        "pids", backend.governor.paths(sid).dirs.get("unified", "")))
    assert _effective_pids_max(base) < pid_max * 0.9, \
        f"sandboxes may use all {pid_max} pids of the node"
