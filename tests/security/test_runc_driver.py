"""The runc driver (runtime="runc", oci.py + runc.py) must give a sandbox the same
isolation as the native one: same masks, capabilities, no_new_privs and the same seccomp
deny list (oci.py emits it as linux.seccomp from dsec.net.seccomp's rules)."""

from __future__ import annotations

import ctypes
import os
import tempfile

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.errors import DsecError
from dsec.wire.spec import ExecRequest
from tests.security.conftest import PROBE_SPEC, new_sid, probe, sh

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

async def test_runc_sandbox_gets_the_same_masks_caps_and_network(
        runc_backend: ContainerBackend) -> None:
    sid = new_sid()
    await runc_backend.create(sid, PROBE_SPEC)
    _, out = await sh(runc_backend, sid, "grep -E 'CapEff|NoNewPrivs' /proc/self/status")
    fields = dict(line.split(":\t") for line in out.strip().splitlines())
    assert fields["NoNewPrivs"] == "1"
    sys_admin, mknod, sys_module = 1 << 21, 1 << 27, 1 << 16
    assert int(fields["CapEff"], 16) & (sys_admin | mknod | sys_module) == 0
    for name in ("mount_proc", "mknod_mem", "proc_sys_write", "sys_write", "kmsg", "setns_mnt",
                 "unshare_mnt", "clone_newnet", "sethostname", "open_by_handle_at"):
        assert (await probe(runc_backend, sid, name))[1] != "ok", name
    r = await runc_backend.exec(sid, ExecRequest(shell="ls /sys/class/net; head -c 8 /proc/kcore"
                                                       " | wc -c"))
    assert r.stdout.split() == [b"lo", b"0"]


async def test_runc_sandbox_runs_under_seccomp(runc_backend: ContainerBackend) -> None:
    sid = new_sid()
    await runc_backend.create(sid, PROBE_SPEC)
    _, out = await sh(runc_backend, sid, "grep '^Seccomp:' /proc/self/status")
    assert out.split() == ["Seccomp:", "2"], out


async def test_runc_sandbox_cannot_build_user_namespaces(runc_backend: ContainerBackend) -> None:
    sid = new_sid()
    await runc_backend.create(sid, PROBE_SPEC)
    opened = {}
    for name in ("unshare_user", "clone_userns", "clone3_userns", "ptrace_traceme",
                 "io_uring_setup"):
        _, word = await probe(runc_backend, sid, name)
        if word == "ok":
            opened[name] = word
    _, word = await probe(runc_backend, sid, "int80_getpid")
    if word.startswith("ok"):
        opened["int80_getpid"] = word
    assert not opened, f"allowed in a runc sandbox: {sorted(opened)}"


async def test_runc_sandbox_does_not_share_the_host_keyring(
        runc_backend: ContainerBackend) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    host_ring = libc.syscall(250, 0, ctypes.c_int(-4), 0)  # keyctl GET_KEYRING_ID @u
    if host_ring < 0:
        pytest.skip("no keyring support on this host")
    sid = new_sid()
    await runc_backend.create(sid, PROBE_SPEC)
    r = await runc_backend.exec(sid, ExecRequest(argv=("/probe", "keyring_id")))
    assert r.stdout.strip() != f"keyring_id={host_ring}".encode(), \
        "the sandbox's @u is the host root's user keyring"


async def test_runc_exec_user_lookup_stays_inside(runc_backend: ContainerBackend) -> None:
    host = tempfile.NamedTemporaryFile("w", prefix="dsec-sec-passwd-", delete=False)  # noqa: SIM115
    try:
        host.write("alice:x:4242:4343:host file:/:/bin/sh\n")
        host.close()
        sid = new_sid()
        await runc_backend.create(sid, PROBE_SPEC)
        code, out = await sh(runc_backend, sid,
                             f"rm /etc/passwd && ln -s {host.name} /etc/passwd")
        assert code == 0, out
        try:
            r = await runc_backend.exec(sid, ExecRequest(argv=("id", "-u"), user="alice"))
        except DsecError:
            return  # refused: the host file was not used
        assert r.stdout.strip() != b"4242", "the uid came from a host file"
    finally:
        os.unlink(host.name)


async def test_runc_init_holds_no_host_file(runc_backend: ContainerBackend) -> None:
    sid = new_sid()
    await runc_backend.create(sid, PROBE_SPEC)
    _, out = await sh(runc_backend, sid, "for f in 0 1 2; do readlink /proc/1/fd/$f; done")
    assert set(out.split()) <= {"/dev/null"}, out
