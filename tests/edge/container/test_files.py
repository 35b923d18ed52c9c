"""File calls stay inside the sandbox root against ../, absolute symlinks and races."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.errors import InvalidArgument, NotFound, SandboxError
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import SPEC, new_sid


async def test_file_roundtrip(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    await backend.mkdir(sid, "/workspace/a/b")
    await backend.write_file(sid, "/workspace/a/b/f.txt", b"hello", mode=0o600)
    await backend.write_file(sid, "/workspace/a/b/f.txt", b" world", append=True)
    assert await backend.read_file(sid, "/workspace/a/b/f.txt") == b"hello world"
    assert await backend.read_file(sid, "/workspace/a/b/f.txt", offset=6, length=3) == b"wor"
    info = await backend.stat(sid, "/workspace/a/b/f.txt")
    assert (info.type, info.size, info.mode, info.name) == ("file", 11, 0o600, "f.txt")
    r = await backend.exec(sid, ExecRequest(argv=("cat", "/workspace/a/b/f.txt")))
    assert r.stdout == b"hello world"  # the process sees what the file call wrote
    await backend.exec(sid, ExecRequest(shell="ln -s /etc/passwd /workspace/link"))
    names = {i.name: i for i in await backend.list_dir(sid, "/workspace")}
    assert names["a"].type == "dir" and names["link"].type == "symlink"
    assert names["link"].link_target == "/etc/passwd"
    assert (await backend.stat(sid, "/workspace/link")).type == "symlink"
    await backend.remove(sid, "/workspace/link")
    with pytest.raises(InvalidArgument):
        await backend.remove(sid, "/workspace/a")  # not empty, not recursive
    await backend.remove(sid, "/workspace/a", recursive=True)
    assert await backend.list_dir(sid, "/workspace") == []
    with pytest.raises(NotFound):
        await backend.read_file(sid, "/workspace/a/b/f.txt")
    with pytest.raises(InvalidArgument):
        await backend.read_file(sid, "/dev/zero")  # not a regular file: no endless read
    with pytest.raises(InvalidArgument):
        await backend.remove(sid, "/")
    # changes land in the upper dir, for pack_diff
    await backend.write_file(sid, "/etc/motd", b"x")
    assert Path(backend.upper_dir(sid), "etc/motd").read_bytes() == b"x"


async def test_escapes_resolve_inside_the_root(backend: ContainerBackend, tmp_path: object
                                               ) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    host_secret = os.path.join(str(tmp_path), "host-secret")
    Path(host_secret).write_text("HOST")
    # ../ climbs stop at the sandbox root
    assert (await backend.read_file(sid, "../../../../etc/passwd")).startswith(b"root:x:0:0")
    assert b"agent" in await backend.read_file(sid, "/../../etc/passwd")
    # an absolute symlink made inside the sandbox points into the sandbox, not the host
    await backend.exec(sid, ExecRequest(shell=f"mkdir -p $(dirname {host_secret}); "
                                              f"echo SANDBOX > {host_secret}; "
                                              f"ln -s {host_secret} /evil; ln -s / /rootlink"))
    assert await backend.read_file(sid, "/evil") == b"SANDBOX\n"
    assert await backend.read_file(sid, f"/rootlink/rootlink/{host_secret}") == b"SANDBOX\n"
    await backend.write_file(sid, "/evil", b"overwritten")
    assert Path(host_secret).read_text() == "HOST"
    # /proc magic links (/proc/<pid>/root of a host process) are refused
    # refused by openat2's RESOLVE_NO_MAGICLINKS (ELOOP), not read, not another error
    with pytest.raises(SandboxError, match="Too many levels of symbolic links"):
        await backend.read_file(sid, f"/proc/1/root{host_secret}")


async def test_symlink_race_stays_inside(backend: ContainerBackend, tmp_path: object) -> None:
    """A process inside flips a path between a dir and a symlink to / as fast as it can
    while we write through it: every write must land inside the sandbox."""
    sid = new_sid()
    await backend.create(sid, SPEC)
    target = os.path.join(str(tmp_path), "race-target")
    os.makedirs(target)
    await backend.exec(sid, ExecRequest(shell=f"mkdir -p /r {target}", timeout_s=5))
    race = await backend.exec(sid, ExecRequest(
        shell=f"while true; do rm -rf /r/d; ln -s {target} /r/d; rm -f /r/d; mkdir /r/d; done",
        background=True))
    assert race.pid
    for i in range(300):
        try:
            await backend.write_file(sid, f"/r/d/f{i}", b"x")
        except (NotFound, InvalidArgument):
            pass
        if i % 50 == 0:
            await asyncio.sleep(0)
    assert os.listdir(target) == []  # nothing escaped to the host directory


async def test_write_creates_missing_parents_inside_the_root(backend: ContainerBackend,
                                                            tmp_path: object) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    await backend.write_file(sid, "/srv/new/deep/f.txt", b"x")
    r = await backend.exec(sid, ExecRequest(shell="cat /srv/new/deep/f.txt; stat -c %a /srv/new"))
    assert r.stdout == b"x755\n"
    # A parent chain through an absolute symlink still lands inside the sandbox.
    outside = os.path.join(str(tmp_path), "outside")
    await backend.exec(sid, ExecRequest(shell=f"mkdir -p {outside} && ln -s {outside} /escape"))
    await backend.write_file(sid, "/escape/made/f.txt", b"in")
    assert not os.path.exists(outside)
    r = await backend.exec(sid, ExecRequest(argv=("cat", f"{outside}/made/f.txt")))
    assert r.stdout == b"in"


async def test_only_the_sandboxes_own_filesystems_are_reachable(
        backend: ContainerBackend) -> None:
    """The edge acts as host root: on procfs/sysfs/devpts or the host file behind the
    /dev/.init bind it would do more than the sandbox may (a chmod of /proc/version is
    kernel-wide), so those are refused before anything is read, truncated or chmod'ed;
    the overlay root, /tmp and /dev/shm (tmpfs) work."""
    sid = new_sid()
    await backend.create(sid, SPEC)
    for path in ("/proc/version", "/proc/1/status", "/proc/kallsyms", "/sys/kernel/uevent_seqnum",
                 "/dev/.init", "/dev/pts/ptmx"):
        with pytest.raises(InvalidArgument):
            await backend.read_file(sid, path)
        # refused as a kernel filesystem, or (the running init binary) by the kernel
        with pytest.raises(SandboxError if path == "/dev/.init" else InvalidArgument,
                           match="Text file busy" if path == "/dev/.init"
                           else "kernel or host filesystem|openat2"):
            await backend.write_file(sid, path, b"", mode=0o600)
    for path in ("/proc", "/sys/kernel", "/dev/pts"):
        with pytest.raises(InvalidArgument):
            await backend.list_dir(sid, path)
        with pytest.raises(InvalidArgument):
            await backend.mkdir(sid, path + "/newdir")
    with pytest.raises(InvalidArgument):
        await backend.remove(sid, "/proc/sys/kernel/hostname")
    r = await backend.exec(sid, ExecRequest(shell="stat -c %a /proc/version /dev/.init"))
    assert r.stdout.split()[0] == b"444"  # untouched
    for path in ("/tmp/t", "/dev/shm/s", "/root/r"):
        await backend.write_file(sid, path, b"ok", mode=0o640)
        assert await backend.read_file(sid, path) == b"ok"
        assert (await backend.stat(sid, path)).mode == 0o640
    assert [i.name for i in await backend.list_dir(sid, "/dev/shm")] == ["s"]
    # listing a directory that holds mount points works; only entering them is refused
    assert "proc" in {i.name for i in await backend.list_dir(sid, "/")}
