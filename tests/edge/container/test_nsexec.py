"""The C zygote (dsec-nsexec): its build, its wire format, and many requests in flight."""

from __future__ import annotations

import asyncio
import os
import struct

import msgspec
import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.edge.backends.container.linux import DEFAULT_CAPS
from dsec.edge.backends.container.nsexec import ensure_nsexec, tables_header
from dsec.edge.backends.container.protocol import (
    Create,
    Created,
    Exec,
    Exited,
    Failed,
    Kill,
    Started,
    decode_reply,
    encode,
    request_argv,
)
from dsec.edge.backends.container.rootfs import MASKED_DIRS, MASKED_FILES, READONLY_PATHS
from dsec.edge.backends.container.runsc import write_helpers
from dsec.errors import BackendError, InvalidArgument
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import SPEC, new_sid
from tests.syscall_order import assert_durable, record_syscalls

EXEC = Exec(id=7, argv=["sh", "-c", "echo hi"], env=["A=1"], cwd=None, user="agent",
            cgroup_procs=["/cg/a/cgroup.procs", "/cg/b/cgroup.procs"], nested=True,
            background=True)


def test_tables_header_carries_the_rootfs_tables() -> None:
    h = tables_header()
    for p in (*MASKED_FILES, *MASKED_DIRS, *READONLY_PATHS):
        assert f'"{p}",' in h
    mask = sum(1 << c for c in DEFAULT_CAPS)
    assert f"#define DSEC_KEEP_CAPS 0x{mask:x}ULL" in h
    assert '{"null", 1, 3, 0666},' in h


def test_exec_request_is_a_header_and_the_child_argv() -> None:
    raw = encode(EXEC)
    kind, flags, rid = struct.unpack_from("=IIQ", raw)
    assert (kind, flags, rid) == (2, 1 | 2, 7)
    strings = raw[16:].split(b"\0")
    assert strings[-1] == b""  # every string is NUL-terminated
    assert [s.decode() for s in strings[:-1]] == [
        "exec", "", "agent", "2", "/cg/a/cgroup.procs", "/cg/b/cgroup.procs", "-1", "",
        "", "1", "A=1", "--", "sh", "-c", "echo hi"]       # "": nothing hidden (hide)


def test_create_and_kill_requests() -> None:
    c = Create(id=3, lowerdirs=["/l/2", "/l/1"], upper="/s/u", work="/s/w", root="/s/r",
               hostname="sb-1", cgroup_procs=["/cg/x"], loopback=True, nested=False,
               tmp_bytes=1 << 20)
    assert request_argv(c) == ["create", "/s/r", "2", "/l/2", "/l/1", "/s/u", "/s/w",
                               "sb-1", "1", str(1 << 20), "1", "/cg/x"]
    assert struct.unpack_from("=IIQ", encode(c)) == (1, 0, 3)
    # the optional tail, in the order nsexec.c takes it from the end: sysfs, scratch,
    # ipc caps (each with its flag)
    full = msgspec.structs.replace(c, sysfs="/sys-shared", scratch="/scr/sb-1",
                                   ipc_caps=(("shmmax", "4096"), ("sem", "1 2 3 4")))
    assert request_argv(full)[-3:] == ["/sys-shared", "/scr/sb-1", "shmmax=4096;sem=1 2 3 4"]
    assert struct.unpack_from("=IIQ", encode(full))[1] == 128 | 256 | 1024
    assert encode(Kill(id=9)) == struct.pack("=IIQ", 3, 0, 9)


def test_nul_bytes_are_refused() -> None:
    with pytest.raises(ValueError, match="NUL"):
        encode(Exec(id=1, argv=["a\0b"], env=[], cwd=None, user=None, cgroup_procs=[],
                    nested=False, background=False))
    with pytest.raises(ValueError, match="NUL"):
        encode(Create(id=1, lowerdirs=["/a\0b"], upper="/u", work="/w", root="/r",
                      hostname="h", cgroup_procs=[], loopback=False, nested=False,
                      tmp_bytes=1))
    # layer paths travel one by one and the helper mounts them by fd, so ':' and ','
    # (the overlay option separators) reach it intact
    assert "/a:b,c" in request_argv(Create(
        id=1, lowerdirs=["/a:b,c"], upper="/u", work="/w", root="/r", hostname="h",
        cgroup_procs=[], loopback=False, nested=False, tmp_bytes=1))


def test_replies_decode() -> None:
    hdr = struct.Struct("=iiQiiiI")
    assert decode_reply(hdr.pack(1, 42, 5, 42, 0, 0, 0)) == Created(5, 42)
    assert decode_reply(hdr.pack(2, 42, 5, 3, 0, 0, 0)) == Started(5, 42, 3)
    assert decode_reply(hdr.pack(3, 42, 5, 42, 256, 0, 0)) == Exited(5, 256, 42)
    assert decode_reply(hdr.pack(3, 0, 5, 0, 256, 0, 0)) == Exited(5, 256)  # helper died
    assert decode_reply(hdr.pack(4, 0, 5, 0, 0, 2, 4) + b"gone") == Failed(5, "gone", 2)
    with pytest.raises(ValueError, match="header"):
        decode_reply(b"\1\0")
    with pytest.raises(ValueError, match="unknown reply type 9"):
        decode_reply(hdr.pack(9, 0, 0, 0, 0, 0, 0))


def test_build_is_cached_and_refuses_shared_dirs(tmp_path: object) -> None:
    d = os.path.join(str(tmp_path), "bin")
    path = ensure_nsexec(d)
    assert os.access(path, os.X_OK) and os.path.dirname(path) == d
    mtime = os.stat(path).st_mtime_ns
    assert ensure_nsexec(d) == path and os.stat(path).st_mtime_ns == mtime
    assert os.listdir(d) == [os.path.basename(path)]  # no temp dirs left behind
    with pytest.raises(BackendError, match="no-such-cc"):
        ensure_nsexec(os.path.join(str(tmp_path), "other"), compilers=("no-such-cc",))
    shared = os.path.join(str(tmp_path), "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    with pytest.raises(BackendError, match="not group/world-writable"):
        ensure_nsexec(shared)


def test_a_built_helper_is_on_disk_before_it_is_named(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next start trusts any file of the helper's name: the compiler's output is
    fsynced before the rename, the cache directory after it."""
    d = os.path.join(str(tmp_path), "bin")
    calls = record_syscalls(monkeypatch)
    assert_durable(calls, ensure_nsexec(d))


def test_the_gvisor_helper_dir_is_on_disk_before_it_is_named(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """write_helpers' directory is trusted whole by its name: each file in it and the
    directory itself are fsynced before the rename, the parent after it."""
    src = os.path.join(str(tmp_path), "src")
    os.mkdir(src)
    for n in ("busybox", "nsexec"):
        with open(os.path.join(src, n), "wb") as f:
            f.write(os.urandom(4096))
    calls = record_syscalls(monkeypatch)
    path = write_helpers(os.path.join(str(tmp_path), "helpers"),
                         busybox=os.path.join(src, "busybox"),
                         nsexec=os.path.join(src, "nsexec"), seccomp=b"bpf")
    assert_durable(calls, path, inside=("busybox", "nsexec", "seccomp"))


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def test_nul_in_exec_is_invalid_and_leaks_no_fds(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    await backend.exec(sid, ExecRequest(argv=("true",)))  # the zygote runs
    before = _open_fds()
    with pytest.raises(InvalidArgument, match="NUL"):
        await backend.exec(sid, ExecRequest(argv=("echo", "a\0b")))
    assert _open_fds() == before
    r = await backend.exec(sid, ExecRequest(argv=("echo", "ok")))
    assert r.stdout == b"ok\n"


async def test_many_execs_and_creates_in_flight(backend: ContainerBackend) -> None:
    sids = [new_sid() for _ in range(8)]
    await asyncio.gather(*(backend.create(s, SPEC) for s in sids))

    async def one(k: int) -> tuple[int, bytes, bytes]:
        r = await backend.exec(sids[k % len(sids)],
                               ExecRequest(shell=f"echo {k}; hostname", stdin=b""))
        return k, r.stdout, sids[k % len(sids)].encode()
    results = await asyncio.gather(*(one(k) for k in range(200)))
    for k, out, sid in results:
        assert out == f"{k}\n".encode() + sid + b"\n"
    # a blocked exec does not hold up the others: 20 execs finish while it waits
    waiter = asyncio.ensure_future(backend.exec(sids[0], ExecRequest(
        shell="while [ ! -e /tmp/go ]; do sleep 0.01; done; echo z")))
    quick = await asyncio.gather(*(backend.exec(sids[1], ExecRequest(argv=("true",)))
                                   for _ in range(20)))
    assert not waiter.done() and all(r.exit_code == 0 for r in quick)
    await backend.exec(sids[0], ExecRequest(argv=("touch", "/tmp/go")))
    assert (await waiter).stdout == b"z\n"


async def test_a_flood_of_execs_does_not_deadlock_the_helper_socket(
        backend: ContainerBackend) -> None:
    """More execs at once than the request socket holds: the edge waits for room while
    still reading replies (the zygote blocks on its replies meanwhile). Before, a blocking
    sendmsg on both sides hung the edge for good at ~600 gathered execs."""
    sids = [new_sid() for _ in range(4)]
    await asyncio.gather(*(backend.create(s, SPEC) for s in sids))
    results = await asyncio.wait_for(asyncio.gather(*(
        backend.exec(sids[k % 4], ExecRequest(argv=("echo", str(k)))) for k in range(800))),
        120)
    assert [r.stdout for r in results] == [f"{k}\n".encode() for k in range(800)]


async def test_a_request_too_big_for_the_helper_fails_alone(backend: ContainerBackend) -> None:
    """An exec whose argv + env passed the API's 1 MiB check but not the helper socket's
    default ~208 KiB datagram size killed the helper (rt-kernel review): every create and
    exec in flight on the node - other tenants' - failed with "helper process died". Now
    the socket carries the largest request the helper takes, a bigger one is refused
    alone, and a request that cannot be sent for any other reason fails alone too."""
    sids = [new_sid(), new_sid()]
    await asyncio.gather(*(backend.create(s, SPEC) for s in sids))
    victim = asyncio.ensure_future(backend.exec(sids[1], ExecRequest(
        shell="while [ ! -e /tmp/go ]; do sleep 0.01; done; echo still-here")))
    await asyncio.sleep(0.2)
    helper = backend._zygote.pid
    # 400 KB of argv, each string under Linux's 128 KiB (the shared request check admits
    # 1 MiB): the socket's default ~208 KiB datagram limit refused it and the helper died
    r = await backend.exec(sids[0], ExecRequest(argv=("true", *["x" * 100_000] * 4)))
    assert r.exit_code == 0, r
    r = await backend.exec(sids[0], ExecRequest(shell='echo ${#BIG}',
                                                env={"BIG": "y" * 100_000,
                                                     "BIG2": "z" * 100_000}))
    assert (r.exit_code, r.stdout) == (0, b"100000\n"), r
    assert backend._zygote.pid == helper  # the helper lives on
    await backend.exec(sids[1], ExecRequest(argv=("touch", "/tmp/go")))
    assert (await victim).stdout == b"still-here\n"


def test_a_request_over_the_helpers_buffer_is_refused_before_sending() -> None:
    """The helper reads one request into a 4 MiB buffer; a bigger one (no door admits
    one today: argv + env are capped at 1 MiB) is refused by name, not truncated."""
    with pytest.raises(ValueError, match="ARG_MAX"):
        encode(Exec(id=1, argv=["x" * 100_000] * 50, env=[], cwd=None, user=None,
                    cgroup_procs=[], nested=False, background=False))
    assert len(encode(Exec(id=1, argv=["x" * 100_000] * 40, env=[], cwd=None, user=None,
                           cgroup_procs=[], nested=False, background=False))) < 4 << 20
