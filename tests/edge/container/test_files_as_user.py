"""File calls with ``user=`` run AS that sandbox user (red team 21, B1 B4 B10 B11): the
edge's file thread takes the user's fsuid/fsgid/groups, so the kernel checks every path
step, open, create, unlink and rename - no check-then-act as root to race, and no
lexical/physical path mismatch to exploit. Real sandboxes (native driver)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from dsec.edge.backends.container import ContainerBackend, linux
from dsec.edge.node import EdgeNode
from dsec.errors import InvalidArgument, NotFound, PermissionDenied
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.conftest import make_node
from tests.edge.container.conftest import SPEC, new_sid

pytestmark = pytest.mark.root

SETUP = ("mkdir -p /srv/h /tmp/w/a/b /home/agent/w && echo secret > /srv/h/s && "
         "chmod 700 /srv/h && chown -R agent:agent /tmp/w /home/agent/w && "
         "ln -s /tmp/w/a/b /tmp/w/l && chown -h agent /tmp/w/l")


async def sh(b: ContainerBackend, sid: str, cmd: str) -> str:
    r = await b.exec(sid, ExecRequest(shell=cmd, timeout_s=20))
    assert r.exit_code == 0, (cmd, r)
    return r.stdout.decode()


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def _as_user_calls(b: ContainerBackend, sid: str) -> None:
    passwd = await b.read_file(sid, "/etc/passwd")
    # reads, lists, stats of what the user may not reach: refused by the kernel
    with pytest.raises(PermissionDenied):
        await b.read_file(sid, "/srv/h/s", user="agent")
    with pytest.raises(PermissionDenied):
        await b.list_dir(sid, "/srv/h", user="agent")
    with pytest.raises(PermissionDenied):
        await b.stat(sid, "/srv/h/s", user="agent")
    got: list[bytes] = []

    async def sink(data: bytes) -> None:
        got.append(data)
    with pytest.raises(PermissionDenied):
        await b.read_stream(sid, "/srv/h/s", 0, None, sink, user="agent")
    # B11's shape: '..' after a symlink (lexically /etc/passwd): never root's write
    for path in ("/tmp/w/l/../../../etc/passwd", "/etc/passwd", "/etc/new"):
        with pytest.raises(PermissionDenied):
            await b.write_file(sid, path, b"pwned\n", user="agent")
        with pytest.raises(PermissionDenied):
            await b.write_stream(sid, path, 0o644, None, _chunks(b"pwned\n"), user="agent")
    with pytest.raises(PermissionDenied):
        await b.remove(sid, "/etc/passwd", user="agent")
    with pytest.raises(PermissionDenied):
        await b.rename_file(sid, "/etc/passwd", "/home/agent/w/p", True, user="agent")
    with pytest.raises(PermissionDenied):
        await b.mkdir(sid, "/srv/x/y", user="agent")
    assert await b.read_file(sid, "/etc/passwd") == passwd
    with pytest.raises(NotFound):
        await b.stat(sid, "/etc/new")
    # what the user may do works, and what it makes is its own (tmpfs: the charged
    # writer's helper and cgroup are still the edge's; overlay: a plain write)
    for d in ("/tmp/w", "/home/agent/w"):
        await b.write_stream(sid, f"{d}/x/f", 0o644, None, _chunks(b"a" * 70000, b"b"),
                             user="agent")
        await b.write_file(sid, f"{d}/g", b"small", user="agent")
        await b.mkdir(sid, f"{d}/m/n", user="agent")
        await b.rename_file(sid, f"{d}/g", f"{d}/m/g", False, user="agent")
        assert (await b.stat(sid, f"{d}/m/g", user="agent")).size == 5
        assert len(await b.read_file(sid, f"{d}/x/f", user="agent")) == 70001
        owners = await sh(b, sid, f"stat -c '%U:%G' {d}/x {d}/x/f {d}/m {d}/m/n {d}/m/g")
        assert owners.split() == ["agent:agent"] * 5, owners
        await b.remove(sid, f"{d}/m", recursive=True, user="agent")
        assert {i.name for i in await b.list_dir(sid, d, user="agent")} >= {"x"}
    # numeric uid and unknown users
    assert await b.read_file(sid, "/tmp/w/x/f", length=1, user="1000") == b"a"
    with pytest.raises(InvalidArgument, match="unknown user"):
        await b.read_file(sid, "/tmp/w/x/f", user="nobody-here")
    # root (and a uid-0 name) is the edge's own identity, as before
    assert await b.read_file(sid, "/srv/h/s", user="root") == b"secret\n"


async def _threads_are_root_again(b: ContainerBackend) -> None:
    """Every file thread got its identity back (FILE_THREADS of them: ask each)."""
    seen = await asyncio.gather(*(b._in_pool(lambda: (linux.current_fs_creds().uid,
                                                      linux.current_fs_creds().gid))
                                  for _ in range(16)))
    assert set(seen) == {(0, 0)}


async def test_file_calls_as_a_user_are_checked_by_the_kernel(
        backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    await sh(backend, sid, SETUP)
    await _as_user_calls(backend, sid)
    await _threads_are_root_again(backend)


async def test_file_calls_as_a_user_in_a_user_namespace(backend: ContainerBackend) -> None:
    """Inside uid 1000 is host uid base+1000: the identity is mapped (an unmapped one would
    be refused), and what the user makes shows as theirs inside."""
    sid = new_sid()
    await backend.create(sid, msgspec.structs.replace(SPEC, user_namespace=True))
    await sh(backend, sid, SETUP)
    await _as_user_calls(backend, sid)
    await _threads_are_root_again(backend)


async def test_backends_that_cannot_are_refused_clearly() -> None:
    """The simulated backend (like fncall and vm) has no per-user file identity: a call
    with user= is refused, never done as root."""
    node: EdgeNode = make_node()
    await node.start()
    try:
        info = await node.create(SandboxSpec())
        await node.write_file(info.id, "/f", b"x")
        with pytest.raises(InvalidArgument, match="only the container tiers"):
            await node.read_file(info.id, "/f", user="agent")
        with pytest.raises(InvalidArgument, match="not a user name"):
            await node.read_file(info.id, "/f", user="../x")
        assert await node.read_file(info.id, "/f") == b"x"
    finally:
        await node.close()


async def test_file_calls_as_a_user_on_runc(runc_backend: ContainerBackend) -> None:
    sid = new_sid()
    await runc_backend.create(sid, SPEC)
    await sh(runc_backend, sid, SETUP)
    await _as_user_calls(runc_backend, sid)
    await _threads_are_root_again(runc_backend)
