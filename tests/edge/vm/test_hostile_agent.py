"""A hostile guest agent: the host's end (vm/link.py, vm/upper.py) bounds and validates
what it sends. The "agent" here is an Aether server on a unix socket (the real one is
reached through QEMU's chardev socket the same way)."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dsec.aether.connection import Router, StreamSender
from dsec.aether.transport import serve
from dsec.edge.backends.vm import agentproto as ap
from dsec.edge.backends.vm.link import AgentLink, GuestError
from dsec.edge.backends.vm.upper import Bounds, extract_upper
from dsec.errors import (
    Conflict,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    QuotaExceeded,
    SandboxNotFound,
    UnsafeArchive,
)
from dsec.wire.spec import ExecChunk, ExecRequest, ExecResult


@pytest.fixture
async def agent(tmp_path: Any) -> AsyncIterator[tuple[Router, str]]:
    router = Router()
    router.add("hello", lambda body: ap.Hello(version=ap.PROTOCOL_VERSION, boot_id="b1"))
    path = os.path.join(str(tmp_path), "a")
    server = await serve(router, "unix:" + path)
    try:
        yield router, path
    finally:
        await server.close()


async def test_guest_errors_cannot_pick_the_hosts_error_class(
        agent: tuple[Router, str]) -> None:
    router, path = agent

    def fail(code: str) -> Any:
        exc = {"sandbox_not_found": SandboxNotFound, "overloaded": Overloaded,
               "not_found": NotFound, "conflict": Conflict}[code]

        def handler(body: Any) -> Any:
            raise exc("x" * 5000)
        return handler
    for code in ("sandbox_not_found", "overloaded", "not_found", "conflict"):
        router.add(f"m_{code}", fail(code))
    link = await AgentLink.open(path, "sb-h", timeout=5)
    try:
        assert link.hello_reply.boot_id == "b1"
        # a class the agent may not use becomes the guest's own failure
        for code in ("sandbox_not_found", "overloaded"):
            with pytest.raises(GuestError) as ei:
                await link.call(f"m_{code}", None, ap.Ok)
            assert not isinstance(ei.value, (SandboxNotFound, Overloaded))
            assert len(str(ei.value)) < 700        # the guest's message is cut
        with pytest.raises(NotFound) as nf:
            await link.call("m_not_found", None, ap.Ok)
        assert not isinstance(nf.value, SandboxNotFound)
        with pytest.raises(Conflict):
            await link.call("m_conflict", None, ap.Ok)
    finally:
        await link.close()


async def test_oversized_and_mistyped_replies(agent: tuple[Router, str]) -> None:
    router, path = agent
    router.add("exec", lambda body: ExecResult(exit_code=0, stdout=b"y" * 10_000))
    router.add("read", lambda body: ap.ReadResult(data=b"z" * 100))   # more than asked
    router.add("list", lambda body: {"entries": "not a list"})

    async def exec_stream(body: Any, send: StreamSender) -> ExecResult:
        for _ in range(10):
            await send.send(ExecChunk(stream="stdout", data=b"s" * 1000))
        return ExecResult(exit_code=0, stdout=b"leak")
    router.add("exec_stream", exec_stream, streaming=True)
    link = await AgentLink.open(path, "sb-h", timeout=5)
    try:
        res = await link.exec(ExecRequest(argv=("x",), output_cap_bytes=100))
        assert len(res.stdout) == 100 and res.stdout_truncated
        got = [i async for i in link.exec_stream(ExecRequest(argv=("x",),
                                                             output_cap_bytes=2500))]
        chunks, final = got[:-1], got[-1]
        assert sum(len(c.data) for c in chunks) == 2500        # type: ignore[union-attr]
        assert isinstance(final, ExecResult) and final.stdout_truncated
        assert final.stdout == b""                              # no output smuggled at the end
        with pytest.raises(GuestError, match="returned 100 bytes for a read of 10"):
            await link.read("/f", 0, 10, max_bytes=1 << 20)
        with pytest.raises(GuestError, match="broke the protocol"):
            await link.list("/")
    finally:
        await link.close()


async def test_a_file_larger_than_the_bound_is_refused(agent: tuple[Router, str]) -> None:
    router, path = agent
    router.add("read", lambda body: ap.ReadResult(data=b"r" * min(body["length"], 4096)),
               )
    link = await AgentLink.open(path, "sb-h", timeout=5)
    try:
        with pytest.raises(PayloadTooLarge):
            await link.read("/big", 0, None, max_bytes=10_000)
        assert len(await link.read("/big", 0, 5000, max_bytes=10_000)) == 5000
    finally:
        await link.close()


async def test_wrong_protocol_version_is_refused(tmp_path: Any) -> None:
    router = Router()
    router.add("hello", lambda body: ap.Hello(version=ap.PROTOCOL_VERSION + 1))
    path = os.path.join(str(tmp_path), "a")
    server = await serve(router, "unix:" + path)
    try:
        with pytest.raises(GuestError, match="protocol"):
            await AgentLink.open(path, "sb-h", timeout=5)
    finally:
        await server.close()


# -- the diff tar -------------------------------------------------------------------------
def _tar(*members: tuple[tarfile.TarInfo, bytes]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data else None)
    buf.seek(0)
    return buf


def _m(name: str, type_: bytes = tarfile.REGTYPE, data: bytes = b"", **kw: Any
       ) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.type = type_
    ti.size = len(data) if type_ == tarfile.REGTYPE else 0
    ti.mode = kw.pop("mode", 0o644)
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti, data


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


pytestmark_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod, xattrs)")


@pytestmark_root
def test_upper_round_trip(tmp_path: Any) -> None:
    dest = str(tmp_path / "u")
    os.mkdir(dest)
    opaque = _m("d", tarfile.DIRTYPE, mode=0o700)
    opaque[0].pax_headers = {"SCHILY.xattr.trusted.overlay.opaque": "y"}
    n, data = extract_upper(_tar(
        opaque, _m("d/f", data=b"hello", mode=0o4755, uid=1000),
        _m("gone", tarfile.CHRTYPE, devmajor=0, devminor=0),
        _m("l", tarfile.SYMTYPE, linkname="/etc/passwd"),
        _m("deep/er/x", data=b"1")), dest, Bounds(data_bytes=1 << 20))
    assert (n, data) == (5, 6)
    assert _read(f"{dest}/d/f") == b"hello"
    st = os.stat(f"{dest}/d/f")
    assert stat.S_IMODE(st.st_mode) == 0o4755 and st.st_uid == 1000
    assert stat.S_IMODE(os.stat(f"{dest}/d").st_mode) == 0o700
    assert os.getxattr(f"{dest}/d", "trusted.overlay.opaque") == b"y"
    w = os.lstat(f"{dest}/gone")
    assert stat.S_ISCHR(w.st_mode) and w.st_rdev == 0
    assert os.readlink(f"{dest}/l") == "/etc/passwd"
    assert _read(f"{dest}/deep/er/x") == b"1"


@pytestmark_root
@pytest.mark.parametrize("members,err", [
    ([_m("../x", data=b"a")], UnsafeArchive),
    ([_m("/abs", data=b"a")], UnsafeArchive),
    ([_m("a/../../x", data=b"a")], UnsafeArchive),
    # a symlink then a member through it: never followed
    ([_m("l", tarfile.SYMTYPE, linkname="/tmp"), _m("l/pwned", data=b"a")], UnsafeArchive),
    ([_m("f", data=b"a"), _m("f", data=b"b")], UnsafeArchive),
    ([_m("dev", tarfile.CHRTYPE, devmajor=1, devminor=3)], UnsafeArchive),
    ([_m("blk", tarfile.BLKTYPE)], UnsafeArchive),
    ([_m("fifo", tarfile.FIFOTYPE)], UnsafeArchive),
    ([_m("h", tarfile.LNKTYPE, linkname="x")], UnsafeArchive),
    ([_m("big", data=b"x" * 2000)], QuotaExceeded),
])
def test_hostile_diffs_are_refused(tmp_path: Any, members: list[Any], err: type) -> None:
    dest = str(tmp_path / "u")
    os.mkdir(dest)
    outside = str(tmp_path / "outside")
    with pytest.raises(err):
        extract_upper(_tar(*members), dest, Bounds(data_bytes=1000))
    assert not os.path.exists(outside)
    assert not os.path.exists("/tmp/pwned")


@pytestmark_root
def test_entry_bound_and_garbage(tmp_path: Any) -> None:
    dest = str(tmp_path / "u")
    os.mkdir(dest)
    with pytest.raises(QuotaExceeded):
        extract_upper(_tar(*[_m(f"f{i}") for i in range(20)]), dest,
                      Bounds(data_bytes=1000, entries=10))
    os.mkdir(dest + "2")
    with pytest.raises(UnsafeArchive):
        extract_upper(io.BytesIO(b"\x01" * 4096), dest + "2", Bounds(data_bytes=1000))
