"""The file API (files.py: openat2 RESOLVE_IN_ROOT under /proc/<init>/root) against a
sandbox that plants symlinks, races them, and an API caller that asks for host paths.

The edge does this I/O as host root with every capability, so the only thing standing
between a path and the host is the confinement. A secret file on the host must never be
read, and a host directory must never be written, whatever the sandbox does meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.errors import DsecError, InvalidArgument, PayloadTooLarge, SandboxError
from dsec.wire.spec import ExecRequest
from tests.security.conftest import PROBE_SPEC, new_sid, sh

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]


@pytest.fixture
def host_dir() -> Iterator[tuple[str, bytes]]:
    """A host directory holding secret.txt and victim.txt; yields (dir, secret)."""
    d = tempfile.mkdtemp(prefix="dsec-sec-files-")
    secret = b"host-secret-" + secrets.token_hex(8).encode()
    for name, data in (("secret.txt", secret), ("victim.txt", b"keep me")):
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    try:
        yield d, secret
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def _read_or_none(b: ContainerBackend, sid: str, path: str) -> bytes | None:
    try:
        return bytes(await b.read_file(sid, path))
    except DsecError:
        return None


async def test_traversal_and_planted_symlinks_resolve_inside(
        backend: ContainerBackend, host_dir: tuple[str, bytes]) -> None:
    d, secret = host_dir
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    code, out = await sh(backend, sid, f"ln -s {d}/secret.txt /tmp/abs; ln -s {d} /tmp/dir; "
                                       "ln -s ../../../../../../.. /tmp/up; "
                                       f"ln -s /proc/1/root{d} /tmp/magic; "
                                       f"ln -s /proc/self/root{d} /tmp/magic2")
    assert code == 0, out
    attempts = [
        f"{d}/secret.txt", f"../../../../../..{d}/secret.txt", f"/tmp/../../..{d}/secret.txt",
        "/tmp/abs", "/tmp/dir/secret.txt", f"/tmp/up{d}/secret.txt",
        "/tmp/magic/secret.txt", "/tmp/magic2/secret.txt", f"/proc/1/root{d}/secret.txt",
        f"/proc/self/root{d}/secret.txt", f"/proc/1/cwd{d}/secret.txt",
    ]
    for path in attempts:
        got = await _read_or_none(backend, sid, path)
        assert got is None or secret not in got, path
    # Writes, mkdir and remove through the same links land inside (or fail), never on host.
    for path in ("/tmp/dir/pwned", f"/tmp/up{d}/pwned", "/tmp/magic/pwned"):
        try:
            await backend.write_file(sid, path, b"x")
        except DsecError:
            pass
    for path in ("/tmp/dir/newdir", f"/tmp/up{d}/newdir"):
        try:
            await backend.mkdir(sid, path)
        except DsecError:
            pass
    for path in ("/tmp/dir/victim.txt", f"/tmp/up{d}/victim.txt", "/tmp/dir"):
        try:
            await backend.remove(sid, path, recursive=True)
        except DsecError:
            pass
    assert sorted(os.listdir(d)) == ["secret.txt", "victim.txt"]
    assert open(os.path.join(d, "victim.txt"), "rb").read() == b"keep me"  # noqa: ASYNC230, SIM115


async def test_symlink_swap_race_never_reaches_the_host(
        backend: ContainerBackend, host_dir: tuple[str, bytes]) -> None:
    """The sandbox flips /tmp/r/x between a symlink to a real directory and a symlink to
    a host directory as fast as it can, and moves a directory up and down under a ``..``
    path, while the API reads, writes and removes through both."""
    d, secret = host_dir
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    code, out = await sh(backend, sid, "mkdir -p /tmp/r/real /tmp/q/a/b && "
                                       "echo decoy > /tmp/r/real/secret.txt && "
                                       "echo decoy > /tmp/r/real/victim.txt")
    assert code == 0, out
    await backend.exec(sid, ExecRequest(
        # (files.write makes missing parents: if it turned x into a directory, undo that)
        shell=f"while :; do ln -sfn {d} /tmp/r/x; ln -sfn /tmp/r/real /tmp/r/x; "
              "[ -L /tmp/r/x ] || rm -rf /tmp/r/x; done",
        background=True))
    await backend.exec(sid, ExecRequest(
        shell="while :; do mv /tmp/q/a/b /tmp/q/b; mv /tmp/q/b /tmp/q/a/b; done",
        background=True))
    seen: set[bytes | None] = set()
    dotdot = f"/tmp/q/a/b/../../../../../..{d}/secret.txt"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    i = 0
    # At least 3000 rounds, and on until the real directory was seen through the link
    # (a loaded CI box may schedule the sandbox's loops late).
    while i < 3000 or (b"decoy\n" not in seen and loop.time() < deadline):
        i += 1
        for path in ("/tmp/r/x/secret.txt", dotdot):
            got = await _read_or_none(backend, sid, path)
            seen.add(got)
            assert got is None or secret not in got, f"read #{i} of {path} returned it"
        if i % 4 == 0:
            for path in ("/tmp/r/x/pwned", f"/tmp/q/a/b/../../../../..{d}/pwned"):
                try:
                    await backend.write_file(sid, path, b"x")
                except DsecError:
                    pass
            try:
                await backend.remove(sid, "/tmp/r/x/victim.txt")
            except DsecError:
                pass
        if i % 100 == 0:
            await asyncio.sleep(0.001)  # let the sandbox's loops run on a busy 2-core box
    if b"decoy\n" not in seen:
        r = await backend.exec(sid, ExecRequest(shell="ps; ls -la /tmp/r /tmp/r/real"))
        pytest.fail(f"the swap loop never showed the real directory: {r}")
    assert sorted(os.listdir(d)) == ["secret.txt", "victim.txt"]


async def test_special_files_do_not_hang_or_exhaust_the_edge(backend: ContainerBackend) -> None:
    """FIFOs (a blocking open would freeze the edge's event loop), endless devices and
    huge sparse files are refused quickly instead of read."""
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    code, out = await sh(backend, sid, "mkfifo /tmp/fifo && ln -s /dev/zero /tmp/zero && "
                                       "ln -s /dev/urandom /tmp/rand && "
                                       "truncate -s 100G /tmp/huge")
    assert code == 0, out
    for path in ("/tmp/fifo", "/tmp/zero", "/tmp/rand", "/dev/zero"):
        with pytest.raises(InvalidArgument):
            await asyncio.wait_for(backend.read_file(sid, path), 5)
    with pytest.raises(PayloadTooLarge):
        await asyncio.wait_for(backend.read_file(sid, "/tmp/huge"), 5)
    with pytest.raises(SandboxError, match="No such device or address"):  # ENXIO, not a hang
        await asyncio.wait_for(backend.write_file(sid, "/tmp/fifo", b"x"), 5)
    # and the sandbox's kernel knobs stay read-only for the (privileged) edge too
    for path in ("/proc/sys/kernel/core_pattern", "/sys/kernel/mm/transparent_hugepage/enabled"):
        # refused either at the confined open (read-only mount) or by the filesystem check
        # that runs before a write (a kernel filesystem is never the sandbox's own file)
        with pytest.raises(InvalidArgument, match="openat2|kernel or host filesystem"):
            await backend.write_file(sid, path, b"|/tmp/x")


async def test_file_api_cannot_change_host_wide_proc_permissions(
        backend: ContainerBackend) -> None:
    a, other = new_sid(), new_sid()
    await backend.create(a, PROBE_SPEC)
    try:
        try:
            await backend.write_file(a, "/proc/version", b"", mode=0o600)
        except DsecError:
            pass
        await backend.create(other, PROBE_SPEC)  # a fresh procfs instance
        r = await backend.exec(other, ExecRequest(shell="stat -c %a /proc/version"))
        assert r.stdout.strip() == b"444", f"another sandbox now sees mode {r.stdout!r}"
    finally:
        try:  # put the global mode back (a no-op once the hole is fixed)
            await backend.write_file(a, "/proc/version", b"", mode=0o444)
        except DsecError:
            pass


async def test_file_api_reads_proc_with_sandbox_privileges(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, PROBE_SPEC)
    inside = await backend.exec(sid, ExecRequest(shell="head -c 64 /proc/kallsyms"))
    assert inside.stdout.startswith(b"0000000000000000"), inside  # the sandbox sees zeros
    try:
        via_api = await backend.read_file(sid, "/proc/kallsyms", length=64)
    except DsecError:
        return
    assert via_api[:16] == b"0" * 16, f"host kernel addresses leaked: {via_api[:40]!r}"
