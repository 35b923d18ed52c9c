"""The microVM guest side: initramfs format, the agent protocol, and a real QEMU guest.

Three layers, cheapest first:
- pure functions of guest.py (newc archive, kernel package choice, module order);
- the agent in test mode (``--fd N --root DIR``: the same binary serving a socketpair
  on the host, no mounts, no chroot), for protocol, file confinement and diff checks
  that need no VM;
- one real guest under QEMU TCG (6.12 cloud kernel + initramfs, a busybox EROFS layer,
  an ext4 scratch disk) shared by the module's tests, each of which dials the agent
  afresh: every test is also a host disconnect + reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import shutil
import socket
import stat
import statistics
import subprocess
import tarfile
import time
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest

from dsec.aether.connection import Connection
from dsec.aether.frame import FrameType, encode_parts
from dsec.aether.messages import encode_request
from dsec.aether.transport import connect
from dsec.edge.backends.container.testimage import build_busybox_root
from dsec.edge.backends.vm import agentproto as ap
from dsec.edge.backends.vm import guest
from dsec.errors import (
    CannotRun,
    Conflict,
    ConnectFailed,
    DsecError,
    InvalidArgument,
    NotFound,
    RequestTimeout,
    ResourceExhausted,
    UnknownMethod,
)
from tests.syscall_order import assert_durable, record_syscalls

_enc = msgspec.msgpack.encode


# ---------------------------------------------------------------------------- pure
def _parse_newc(data: bytes) -> list[tuple[str, int, bytes, int, int]]:
    out, pos = [], 0
    while True:
        assert data[pos:pos + 6] == b"070701", pos
        f = [int(data[pos + 6 + 8 * i: pos + 14 + 8 * i], 16) for i in range(13)]
        nsz, fsz = f[11], f[6]
        name = data[pos + 110: pos + 110 + nsz - 1].decode()
        pos += 110 + nsz
        pos += -pos % 4
        body = data[pos:pos + fsz]
        pos += fsz
        pos += -pos % 4
        if name == "TRAILER!!!":
            assert len(data) % 512 == 0
            return out
        out.append((name, f[1], body, f[9], f[10]))


def test_newc_archive_is_what_the_kernel_reads() -> None:
    ents = guest.initramfs_entries(b"\x7fELF-agent", [("virtio_blk", b"ko1"), ("erofs", b"ko22")])
    got = {n: (m, b, (ma, mi)) for n, m, b, ma, mi in _parse_newc(guest.newc_archive(ents))}
    assert got["init"] == (stat.S_IFREG | 0o755, b"\x7fELF-agent", (0, 0))
    assert got["dev/console"] == (stat.S_IFCHR | 0o600, b"", (5, 1))
    assert got["lib/modules/load.order"][1] == b"virtio_blk.ko\nerofs.ko\n"
    assert stat.S_ISDIR(got["sb"][0]) and got["tmp"][0] & 0o7777 == 0o1777
    with pytest.raises(ValueError, match="relative"):
        guest.newc_archive([("../x", stat.S_IFREG, b"", (0, 0))])


def test_newest_kernel_package_compares_patch_levels_numerically() -> None:
    out = ("linux-image-6.12.9+deb12-cloud-amd64-unsigned - Linux 6.12\n"
           "linux-image-6.12.118+deb12-cloud-amd64-unsigned - Linux 6.12\n"
           "linux-image-6.12.118+deb12-cloud-amd64 - signed\n"
           "linux-image-6.1.0-9-cloud-amd64-unsigned - Linux 6.1\n")
    assert guest.newest_kernel_package(out) == (
        "linux-image-6.12.118+deb12-cloud-amd64-unsigned", "6.12.118+deb12-cloud-amd64")
    assert guest.newest_kernel_package("linux-image-6.1.0-9-cloud-amd64-unsigned - x") is None


def test_module_depends_reads_modinfo() -> None:
    blob = b"\x00license=GPL\x00depends=libnvdimm,nd-btt\x00intree=Y\x00"
    assert guest.module_depends(blob) == ["libnvdimm", "nd_btt"]
    assert guest.module_depends(b"\x00depends=\x00") == []


def test_agentproto_and_agent_c_name_the_same_methods() -> None:
    """The method table the host codes against is the one the agent dispatches."""
    src = guest.agent_source()
    dispatched = set(re.findall(r'!strcmp\(m, "([a-z_]+)"\)\) h_', src))
    assert dispatched == set(ap.METHODS)
    streaming = set(re.findall(r'!strcmp\(m, "([a-z_]+)"\)', src.split("wants_stream =")[1]
                               .split(";")[0]))
    assert streaming == set(ap.STREAMING_METHODS)
    assert f'"{ap.AGENT_PORT_NAME}"' in src
    for const, value in (("MAX_READ", ap.MAX_READ), ("MAX_FRAME", ap.DEFAULT_MAX_FRAME),
                         ("PROTO_VERSION", ap.PROTOCOL_VERSION)):
        m = re.search(rf"#define {const} \(?(\d+)u? \* 1024 \* 1024\)|#define {const} (\d+)", src)
        assert m is not None, const
        n = int(m.group(1)) << 20 if m.group(1) else int(m.group(2))
        assert n == value, const
    codes = (set(re.findall(r'return "([a-z_]+)";', src))
             | set(re.findall(r'send_error\([a-z_>-]+, "([a-z_]+)"', src))
             | set(re.findall(r'mp_str\(&b, "code"\); mp_str\(&b, "([a-z_]+)"\)', src)))
    assert codes <= ap.ERROR_CODES and "cannot_run" in codes, codes


def _kernel_or_skip() -> guest.GuestKernel:
    try:
        return guest.find_kernel()
    except DsecError as exc:
        pytest.skip(f"no guest kernel: {exc}")


def test_module_load_order_puts_dependencies_first() -> None:
    k = _kernel_or_skip()
    names = [n for n, _ in guest.module_load_order(k.modules_dir, guest.DEFAULT_MODULES)]
    for mod, dep in (("virtio_pmem", "libnvdimm"), ("nd_pmem", "nd_btt"), ("erofs", "libcrc32c")):
        assert names.index(dep) < names.index(mod), names
    with pytest.raises(DsecError, match="not in"):
        guest.module_load_order(k.modules_dir, ["no_such_module"])


# ---------------------------------------------------------------------------- host mode
@pytest.fixture(scope="module")
def agent_bin(tmp_path_factory: pytest.TempPathFactory) -> str:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    d = str(tmp_path_factory.mktemp("agentcache"))
    os.chmod(d, 0o700)
    return guest.ensure_agent(d)


def test_the_agent_and_initramfs_are_on_disk_before_they_are_named(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both are trusted by their names alone from then on (an empty agent after a power
    loss would be every guest's PID 1): each is fsynced before its rename, the cache
    directory after it."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    d = os.path.join(str(tmp_path), "cache")
    os.makedirs(d, mode=0o700)
    mods = os.path.join(str(tmp_path), "modules")
    os.mkdir(mods)
    calls = record_syscalls(monkeypatch)
    agent = guest.ensure_agent(d)
    assert_durable(calls, agent)
    initrd = guest.ensure_initramfs(guest.GuestKernel("test", "/none", mods), d, modules=())
    assert_durable(calls, initrd)


def _spawn(agent: str, root: str) -> tuple[socket.socket, subprocess.Popen[bytes]]:
    """The agent in test mode serving one end of a socketpair; the other end returned."""
    a, b = socket.socketpair()
    proc = subprocess.Popen([agent, "--fd", str(b.fileno()), "--root", root],
                            pass_fds=(b.fileno(),), stderr=subprocess.DEVNULL)
    b.close()
    return a, proc


@contextlib.asynccontextmanager
async def _host_agent(agent: str, root: str) -> AsyncIterator[tuple[Connection, socket.socket]]:
    a, proc = _spawn(agent, root)
    reader, writer = await asyncio.open_unix_connection(sock=a)
    conn = Connection(reader, writer, dialer=True, max_frame=ap.DEFAULT_MAX_FRAME)
    try:
        yield conn, a
    finally:
        await conn.close()
        try:
            proc.wait(timeout=5)
        finally:
            proc.kill()
            proc.wait()


def _confinement_tree(tmp: str) -> tuple[str, str]:
    root = os.path.join(tmp, "root")
    os.makedirs(os.path.join(root, "dir"))
    outside = os.path.join(tmp, "secret")
    with open(outside, "w") as f:
        f.write("host secret")
    os.symlink("/../../secret", os.path.join(root, "dir", "esc"))
    return root, outside


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


async def test_host_mode_protocol_files_and_confinement(tmp_path: object, agent_bin: str) -> None:
    root, outside = _confinement_tree(str(tmp_path))
    async with _host_agent(agent_bin, root) as (conn, _):
        h = await conn.call("hello", None, timeout=5, response_type=ap.Hello)
        assert h.version == ap.PROTOCOL_VERSION and not h.setup_done
        with pytest.raises(Conflict, match="setup first"):
            await conn.call("read", ap.ReadRequest(path="/x"), timeout=5)
        await conn.call("setup", ap.SetupRequest(), timeout=5, response_type=ap.SetupResult)
        with pytest.raises(Conflict, match="already"):
            await conn.call("setup", ap.SetupRequest(), timeout=5)
        w = await conn.call("write", ap.WriteRequest(path="/a/b/f.txt", data=b"hello"),
                            timeout=5, response_type=ap.WriteResult)
        assert w.size == 5
        await conn.call("write", ap.WriteRequest(path="a/b/f.txt", data=b"!", append=True), timeout=5)
        r = await conn.call("read", ap.ReadRequest(path="/a/b/f.txt", offset=1), timeout=5,
                            response_type=ap.ReadResult)
        assert (r.data, r.size, r.eof) == (b"ello!", 6, True)
        st = await conn.call("stat", ap.PathRequest(path="/a/b/f.txt"), timeout=5,
                             response_type=ap.FileInfo)
        assert (st.type, st.size, st.name, st.mode) == ("file", 6, "f.txt", 0o644)
        ls = await conn.call("list", ap.ListRequest(path="/dir"), timeout=5,
                             response_type=ap.ListResult)
        assert [(e.name, e.type, e.link_target) for e in ls.entries] == [
            ("esc", "symlink", "/../../secret")]
        # confinement: '..' and absolute symlinks resolve inside the root, never above it
        for p in ("/../secret", "../../secret", "/dir/esc", "dir/../../secret"):
            with pytest.raises(NotFound):
                await conn.call("read", ap.ReadRequest(path=p), timeout=5)
        await conn.call("write", ap.WriteRequest(path="/dir/esc", data=b"x"), timeout=5)
        assert _read(outside) == "host secret"       # the write landed inside the root
        assert os.path.exists(os.path.join(root, "secret"))
        await conn.call("rename", ap.RenameRequest(src="/a/b/f.txt", dst="/a/g.txt"), timeout=5)
        await conn.call("mkdir", ap.MkdirRequest(path="/m/n/o"), timeout=5)
        assert os.path.isdir(os.path.join(root, "m/n/o"))
        with pytest.raises(Conflict):
            await conn.call("remove", ap.RemoveRequest(path="/m"), timeout=5)
        await conn.call("remove", ap.RemoveRequest(path="/m", recursive=True), timeout=5)
        assert not os.path.exists(os.path.join(root, "m"))
        with pytest.raises(NotFound):
            await conn.call("remove", ap.RemoveRequest(path="/m"), timeout=5)
        with pytest.raises(InvalidArgument):
            await conn.call("remove", ap.RemoveRequest(path="/"), timeout=5)
        with pytest.raises(UnknownMethod):
            await conn.call("nope", None, timeout=5)
        with pytest.raises(InvalidArgument, match="path"):
            await conn.call("read", {"path": 7}, timeout=5)
        with pytest.raises(InvalidArgument, match="STREAMING"):
            await conn.call("exec_stream", ap.ExecRequest(argv=("true",)), timeout=5)


async def test_host_mode_survives_garbage_and_answers_pings(tmp_path: object,
                                                            agent_bin: str) -> None:
    """Bytes that are not a frame, a frame with a bad CRC and a truncated header are
    skipped; the next valid frame is served (the resync a racing reconnect relies on)."""
    a, proc = _spawn(agent_bin, str(tmp_path))
    try:
        good = encode_request("hello", _enc(None))
        bad = bytearray(encode_parts(FrameType.REQUEST, 1, good) + good)
        bad[-1] ^= 0xFF                                   # CRC mismatch
        a.sendall(b"\x00garbage AET" + bytes(bad) + b"AETH\x00\x01" +
                  encode_parts(FrameType.REQUEST, 3, good) + good +
                  encode_parts(FrameType.PING, 0, b"pp") + b"pp")
        a.settimeout(5)
        data = b""
        while data.count(b"AETH") < 2:
            chunk = a.recv(65536)
            assert chunk, "agent closed the connection"
            data += chunk
        assert data[6:14] == (3).to_bytes(8, "big") and data[14] == FrameType.RESPONSE
        assert msgspec.msgpack.decode(data[25:data.index(b"AETH", 4)], type=ap.Hello).version == 1
        assert data[data.index(b"AETH", 4) + 14] == FrameType.PONG
    finally:
        a.close()
        proc.wait(timeout=5)


def _raw_call(a: socket.socket, sid: int, method: str, body: bytes) -> tuple[int, dict[str, object]]:
    """One REQUEST with a raw msgpack body; (frame type, decoded reply body)."""
    payload = encode_request(method, body)
    a.sendall(encode_parts(FrameType.REQUEST, sid, payload) + payload)
    data = b""
    while len(data) < 25 or len(data) < 25 + int.from_bytes(data[15:19], "big"):
        chunk = a.recv(65536)
        assert chunk, "agent closed the connection"
        data += chunk
    assert int.from_bytes(data[6:14], "big") == sid
    return data[14], msgspec.msgpack.decode(data[25:25 + int.from_bytes(data[15:19], "big")])


async def test_host_mode_malformed_bodies_are_invalid_argument(tmp_path: object,
                                                              agent_bin: str) -> None:
    """The agent's msgpack reader bounds every read: truncated values, wrong types, huge
    announced counts and deep nesting are invalid_argument, and it keeps serving."""
    a, proc = _spawn(agent_bin, str(tmp_path))
    a.settimeout(10)
    try:
        assert _raw_call(a, 1, "setup", _enc({}))[0] == FrameType.RESPONSE
        bad = [
            ("read", b"\x81\xa4path\xda\xff\xff"),          # str of 65535 bytes, 0 present
            ("read", _enc({"path": 7})),
            ("read", b"\xdf\xff\xff\xff\xff"),              # map of 4G entries
            ("exec", _enc({"argv": ["a", 1]})),
            ("exec", _enc({"env": {"A=B": "c"}, "argv": ["true"]})),
            ("exec", _enc({"argv": ["tr\x00ue"]})),
            ("write", b"\x91" * 100 + b"\xc0"),                # 100 nested arrays
            ("stat", b"\xc1"),                                  # never-used msgpack byte
        ]
        sid = 3
        for method, body in bad:
            t, reply = _raw_call(a, sid, method, body)
            assert t == FrameType.ERROR and reply["code"] == "invalid_argument", (method, reply)
            sid += 2
        t, reply = _raw_call(a, sid, "hello", _enc(None))
        assert t == FrameType.RESPONSE and reply["setup_done"] is True
    finally:
        a.close()
        proc.wait(timeout=5)


async def test_host_mode_clock_and_quiesce_bounds(tmp_path: object, agent_bin: str) -> None:
    """``clock`` refuses a time outside 2024..2100 and a non-integer, and a test-mode agent
    (running on the host) never sets a clock; ``quiesce`` refuses device names that are not
    plain block device names and reports what it waited for."""
    a, proc = _spawn(agent_bin, str(tmp_path))
    a.settimeout(10)
    try:
        now = time.time_ns()
        t, r = _raw_call(a, 1, "clock", _enc({"unix_ns": now}))
        step = r["step_s"]
        assert t == FrameType.RESPONSE and r["set"] is False, r
        assert isinstance(step, float) and abs(step) < 5, r
        for sid, body in enumerate([{"unix_ns": 0}, {"unix_ns": ap.CLOCK_MIN_NS - 1},
                                    {"unix_ns": ap.CLOCK_MAX_NS + 1}, {"unix_ns": 1.7e18},
                                    {"unix_ns": "now"}, {}], start=1):
            t, r = _raw_call(a, 2 * sid + 1, "clock", _enc(body))
            assert t == FrameType.ERROR and r["code"] == "invalid_argument", (body, r)
        sid = 101
        for devs in (["../vda"], ["dev/vda"], ["VDA"], [""], ["a" * 32], ["x"] * 65):
            t, r = _raw_call(a, sid, "quiesce", _enc({"devices": devs, "settle_s": 1}))
            assert t == FrameType.ERROR and r["code"] == "invalid_argument", (devs, r)
            sid += 2
        t, r = _raw_call(a, sid, "quiesce", _enc({"devices": ["vda", "pmem0"],
                                                  "settle_s": 1e300, "drop_caches": False}))
        assert t == FrameType.RESPONSE and r["settled"] is True and r["devices"] == [], r
        t, r = _raw_call(a, sid + 2, "hello", _enc(None))
        assert t == FrameType.RESPONSE and r["unbound"] == [] and r["probing"] is False
    finally:
        a.close()
        proc.wait(timeout=5)


def _upper_tree(root: str) -> str:
    os.makedirs(os.path.join(root, "d", "opq"))
    long = "n" * 150
    with open(os.path.join(root, "d", long), "wb") as f:
        f.write(b"x" * 1000)
    os.symlink("t" * 120, os.path.join(root, "d", "ln"))
    os.mknod(os.path.join(root, "gone"), stat.S_IFCHR | 0o000, os.makedev(0, 0))
    os.setxattr(os.path.join(root, "d", "opq"), "trusted.overlay.opaque", b"y")
    os.mkfifo(os.path.join(root, "fifo"))
    return long


async def test_host_mode_exec_stream_waits_for_credit(tmp_path: object, agent_bin: str) -> None:
    """A reader that lags stops the command, not the link: 24 MB streamed to a caller
    that reads nothing for 1.5 s arrive whole. Without the agent honouring Aether's
    per-stream credit the caller's connection would hold more than STREAM_BACKLOG_MAX
    (16 MiB) unread and cancel the call (ResourceExhausted)."""
    async with _host_agent(agent_bin, str(tmp_path)) as (conn, _):
        await conn.call("setup", ap.SetupRequest(), timeout=5)
        n = 24 << 20
        s = conn.stream("exec_stream", ap.ExecRequest(argv=("head", "-c", str(n), "/dev/zero"),
                                                      output_cap_bytes=n),
                        timeout=60, item_type=ap.ExecChunk, response_type=ap.ExecResult)
        await asyncio.sleep(1.5)
        got = 0
        async for c in s:
            got += len(c.data)
        assert got == n and s.result.exit_code == 0 and not s.result.stdout_truncated


@pytest.mark.root
async def test_host_mode_diff_tar_format(tmp_path: object, agent_bin: str) -> None:
    root = os.path.join(str(tmp_path), "upper")
    long = _upper_tree(root)
    async with _host_agent(agent_bin, root) as (conn, _):
        await conn.call("setup", ap.SetupRequest(), timeout=5)
        s = conn.stream("diff", None, timeout=10, item_type=ap.DiffChunk,
                        response_type=ap.DiffResult)
        tar = b"".join([c.data async for c in s])
        res = s.result
    assert res.bytes == len(tar) and res.entries == 5 and res.skipped == 1
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        m = {x.name: x for x in t.getmembers()}
        assert m[f"d/{long}"].size == 1000 and t.extractfile(f"d/{long}").read() == b"x" * 1000
        assert m["d/ln"].issym() and m["d/ln"].linkname == "t" * 120
        assert m["gone"].ischr() and (m["gone"].devmajor, m["gone"].devminor) == (0, 0)
        assert m["d/opq"].isdir()
        assert m["d/opq"].pax_headers.get("SCHILY.xattr.trusted.overlay.opaque") == "y"
        assert "SCHILY.xattr.trusted.overlay.opaque" not in m["d"].pax_headers
        assert "fifo" not in m
    if os.geteuid() == 0:   # the host's own reader (vm/upper.py) takes the agent's tar
        from dsec.edge.backends.vm.upper import Bounds, extract_upper
        dest = os.path.join(str(tmp_path), "unpacked")
        os.mkdir(dest)
        assert extract_upper(io.BytesIO(tar), dest, Bounds(data_bytes=1 << 20))[0] == 5
        assert os.stat(os.path.join(dest, "d", long)).st_size == 1000
        assert os.readlink(os.path.join(dest, "d", "ln")) == "t" * 120
        assert os.getxattr(os.path.join(dest, "d", "opq"), "trusted.overlay.opaque") == b"y"


# ---------------------------------------------------------------------------- real guest
class Guest:
    def __init__(self, d: str, proc: subprocess.Popen[bytes], sock: str,
                 boot_to_hello_s: float, argv: list[str]) -> None:
        self.dir, self.proc, self.sock, self.boot_to_hello_s = d, proc, sock, boot_to_hello_s
        self.argv = argv
        self.qmp = os.path.join(d, "qmp.sock")

    async def dial(self) -> Connection:
        conn = await connect("unix:" + self.sock, max_frame=ap.DEFAULT_MAX_FRAME)
        # a reconnect is noticed by the agent on the port's open event: the first call
        # may race it, so hello is retried briefly
        for _ in range(50):
            try:
                await conn.call("hello", None, timeout=0.5, response_type=ap.Hello)
                return conn
            except RequestTimeout:
                continue
        raise AssertionError("the agent did not answer hello after a reconnect")

    def serial(self) -> str:
        with open(os.path.join(self.dir, "serial.log"), errors="replace") as f:
            return f.read()[-4000:]


def _boot(d: str, layer: str) -> Guest:
    k = guest.find_kernel()
    cache = os.path.join(d, "cache")
    os.makedirs(cache, mode=0o700)
    initrd = guest.ensure_initramfs(k, cache)
    scratch = os.path.join(d, "scratch.img")
    with open(scratch, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", scratch], check=True)
    sock = os.path.join(d, "agent.sock")
    argv = ["qemu-system-x86_64", "-M", "pc", "-accel", "tcg,tb-size=32", "-m", "192",
            "-smp", "1", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", k.vmlinuz, "-initrd", initrd, "-append", guest.kernel_cmdline(),
            "-serial", f"file:{d}/serial.log",
            "-device", "virtio-serial-pci,id=vs",
            "-chardev", f"socket,id=agent,path={sock},server=on,wait=off",
            "-device", f"virtserialport,bus=vs.0,chardev=agent,name={ap.AGENT_PORT_NAME}",
            "-drive", f"file={layer},if=none,id=l0,format=raw,readonly=on",
            "-device", "virtio-blk-pci,drive=l0",
            "-drive", f"file={scratch},if=none,id=s0,format=raw",
            "-device", "virtio-blk-pci,drive=s0",
            "-qmp", f"unix:{d}/qmp.sock,server=on,wait=off"]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)

    async def first_hello() -> float:
        while not os.path.exists(sock):
            if proc.poll() is not None:
                raise AssertionError(f"qemu exited {proc.returncode}")
            await asyncio.sleep(0.01)
        # QEMU binds the chardev's socket before it listens: the path can exist and
        # refuse a connect for a moment (CI, under load). The backend connects QMP
        # first, which answers only once QEMU's set-up is done.
        give_up = time.monotonic() + 30
        while True:
            try:
                conn = await connect("unix:" + sock, max_frame=ap.DEFAULT_MAX_FRAME)
                break
            except ConnectFailed:
                if time.monotonic() > give_up or proc.poll() is not None:
                    raise
                await asyncio.sleep(0.05)
        try:
            deadline = time.monotonic() + 120  # TCG boots take 4-25 s on a loaded 2-core VM
            while True:
                try:
                    h = await conn.call("hello", None, timeout=0.2, response_type=ap.Hello)
                    break
                except RequestTimeout:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
            took = time.monotonic() - t0
            assert h.kernel == k.version and h.mem_total > 100 << 20 and not h.setup_done
            r = await conn.call("setup", ap.SetupRequest(layers=["/dev/vda"], scratch="/dev/vdb",
                                                         env={"DSEC_T": "1"}),
                                timeout=30, response_type=ap.SetupResult)
            assert "/sb" in r.mounts
            return took
        finally:
            await conn.close()

    try:
        took = asyncio.run(first_hello())
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return Guest(d, proc, sock, took, argv)


@pytest.fixture(scope="module")
def vm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guest]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86 is not installed (make setup)")
    _kernel_or_skip()
    d = str(tmp_path_factory.mktemp("vmguest"))
    root = build_busybox_root(os.path.join(d, "bb"))
    layer = os.path.join(d, "bb.erofs")
    subprocess.run(["mkfs.erofs", "--quiet", layer, root], check=True)
    g = _boot(d, layer)
    print(f"\nboot-to-hello {g.boot_to_hello_s:.2f} s")
    try:
        yield g
    finally:
        g.proc.kill()
        g.proc.wait()


pytest_root = pytest.mark.root


@pytest_root
async def test_guest_exec(vm: Guest) -> None:
    conn = await vm.dial()
    try:
        r = await conn.call("exec", ap.ExecRequest(argv=("echo", "hi")), timeout=30,
                            response_type=ap.ExecResult)
        assert (r.exit_code, r.stdout, r.stderr) == (0, b"hi\n", b"")
        r = await conn.call("exec", ap.ExecRequest(
            shell="cat; echo $DSEC_T $X $(id -u) $(pwd) $HOME $LANG >&2; exit 3",
            env={"X": "y"}, stdin=b"in", cwd="/tmp", user="agent"), timeout=30,
            response_type=ap.ExecResult)
        assert (r.exit_code, r.stdout, r.stderr) == (
            3, b"in", b"1 y 1000 /tmp /home/agent C.UTF-8\n")
        r = await conn.call("exec", ap.ExecRequest(shell="head -c 5000 /dev/zero",
                                                   output_cap_bytes=100),
                            timeout=30, response_type=ap.ExecResult)
        assert len(r.stdout) == 100 and r.stdout_truncated
        r = await conn.call("exec", ap.ExecRequest(shell="head -c 3000000 /dev/zero",
                                                   output_cap_bytes=8 << 20),
                            timeout=30, response_type=ap.ExecResult)
        assert len(r.stdout) == ap.MAX_EXEC_OUTPUT and r.stdout_truncated   # fits one frame
        with pytest.raises(CannotRun) as ei:
            await conn.call("exec", ap.ExecRequest(argv=("/no/such",)), timeout=30)
        assert ei.value.detail.get("exit_code") == 127
        with pytest.raises(CannotRun, match="unknown user"):
            await conn.call("exec", ap.ExecRequest(argv=("true",), user="ghost"), timeout=30)
        lat = []
        for _ in range(7):
            t = time.monotonic()
            await conn.call("exec", ap.ExecRequest(argv=("true",)), timeout=30)
            lat.append(time.monotonic() - t)
        print(f"\nexec p50 {statistics.median(lat) * 1000:.1f} ms")
    finally:
        await conn.close()


@pytest_root
async def test_guest_exec_stream_timeout_and_signal(vm: Guest) -> None:
    conn = await vm.dial()
    try:
        s = conn.stream("exec_stream", ap.ExecRequest(shell="echo a; sleep 0.5; echo b >&2"),
                        timeout=30, item_type=ap.ExecChunk, response_type=ap.ExecResult)
        t0 = time.monotonic()
        items = []
        async for c in s:
            items.append((c.stream, c.data, time.monotonic() - t0))
        assert [(a, b) for a, b, _ in items] == [("stdout", b"a\n"), ("stderr", b"b\n")]
        assert items[1][2] - items[0][2] > 0.3          # the first chunk came before the end
        assert s.result.exit_code == 0 and s.result.stdout == b""
        # timeout kills the whole process group (the background sleep too)
        t0 = time.monotonic()
        r = await conn.call("exec", ap.ExecRequest(shell="sleep 300 & sleep 301",
                                                   timeout_s=0.5),
                            timeout=30, response_type=ap.ExecResult)
        assert r.timed_out and r.exit_code == 137 and time.monotonic() - t0 < 60  # not 301
        ps = await conn.call("exec", ap.ExecRequest(shell="ps -o args | grep -c '^sleep 30'"),
                             timeout=30, response_type=ap.ExecResult)
        assert ps.stdout.strip() == b"0", ps
        bg = await conn.call("exec", ap.ExecRequest(argv=("sleep", "302"), background=True),
                             timeout=30, response_type=ap.ExecResult)
        assert bg.pid and bg.pid > 1
        await conn.call("signal", ap.SignalRequest(pid=bg.pid, sig=9), timeout=30)
        with pytest.raises(InvalidArgument):
            await conn.call("signal", ap.SignalRequest(pid=1), timeout=30)
        for _ in range(50):
            ps = await conn.call("exec", ap.ExecRequest(shell="ps -o args | grep -c '^sleep 302'"),
                                 timeout=30, response_type=ap.ExecResult)
            if ps.stdout.strip() == b"0":
                break
            await asyncio.sleep(0.05)
        assert ps.stdout.strip() == b"0"
        st = await conn.call("stats", None, timeout=30, response_type=ap.GuestStats)
        assert st.mem_available < st.mem_total and st.cpu_ns > 0 and st.disk_total > 50 << 20
        q = await conn.call("quiesce", ap.QuiesceRequest(), timeout=30, response_type=ap.QuiesceResult)
        assert q.mem_available > 0
        # what the guest has: both disks, every virtio device driven, the loader done
        h = await conn.call("hello", None, timeout=30, response_type=ap.Hello)
        assert {"vda", "vdb"} <= set(h.devices) and h.unbound == [] and not h.probing, h
        q = await conn.call("quiesce", ap.QuiesceRequest(devices=["vda", "vdb"], settle_s=30,
                                                         drop_caches=False, compact=False),
                            timeout=60, response_type=ap.QuiesceResult)
        assert q.settled and q.duration_s < 5, q
        t0 = time.monotonic()
        q = await conn.call("quiesce", ap.QuiesceRequest(devices=["vdz"], settle_s=0.3,
                                                         drop_caches=False, compact=False),
                            timeout=60, response_type=ap.QuiesceResult)
        assert not q.settled and "vdz" not in q.devices and time.monotonic() - t0 < 20
        # clock: the guest's wall clock is set from the request, no program involved
        ahead = time.time_ns() + 3600 * 10**9
        c = await conn.call("clock", ap.ClockRequest(unix_ns=ahead), timeout=30,
                            response_type=ap.ClockResult)
        assert c.set and 3590 < c.step_s < 3610, c
        r = await conn.call("exec", ap.ExecRequest(argv=("date", "+%s")), timeout=30,
                            response_type=ap.ExecResult)
        assert abs(int(r.stdout) - (time.time() + 3600)) < 30, r
        c = await conn.call("clock", ap.ClockRequest(unix_ns=time.time_ns()), timeout=30,
                            response_type=ap.ClockResult)
        assert -3610 < c.step_s < -3590
        with pytest.raises(InvalidArgument, match="2024"):
            await conn.call("clock", ap.ClockRequest(unix_ns=10**9), timeout=30)
    finally:
        await conn.close()


@pytest_root
async def test_guest_files_and_diff(vm: Guest) -> None:
    conn = await vm.dial()
    try:
        data = os.urandom(3 << 20)                      # more than one MAX_READ
        await conn.call("write", ap.WriteRequest(path="/workspace/big.bin", data=data), timeout=60)
        got, off = b"", 0
        while True:
            r = await conn.call("read", ap.ReadRequest(path="/workspace/big.bin", offset=off),
                                timeout=60, response_type=ap.ReadResult)
            got += r.data
            off += len(r.data)
            if r.eof:
                break
        assert got == data
        ex = await conn.call("exec", ap.ExecRequest(shell="md5sum /workspace/big.bin; ls /"),
                             timeout=30, response_type=ap.ExecResult)
        assert b"init" not in ex.stdout.split()         # the agent's root is not the sandbox's
        with pytest.raises(NotFound):
            await conn.call("read", ap.ReadRequest(path="/../init"), timeout=30)
        await conn.call("exec", ap.ExecRequest(
            shell="rm /linuxrc && rm -rf /var && mkdir -p /var/new && echo v > /var/new/f"
                  " && mv /home /home2"),
            timeout=30)
        s = conn.stream("diff", None, timeout=60, item_type=ap.DiffChunk,
                        response_type=ap.DiffResult)
        tar = b"".join([c.data async for c in s])
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            m = {x.name: x for x in t.getmembers()}
        assert m["linuxrc"].ischr() and m["linuxrc"].devmajor == 0
        assert m["var"].pax_headers.get("SCHILY.xattr.trusted.overlay.opaque") == "y"
        assert m["workspace/big.bin"].size == len(data)
        assert "bin/busybox" not in m                   # lower-layer files are not in the diff
        # a renamed lower dir is copied, never an overlay redirect (redirect_dir=nofollow)
        assert m["home"].ischr() and m["home2/agent"].isdir()
    finally:
        await conn.close()


@pytest_root
async def test_guest_survives_host_disconnect(vm: Guest) -> None:
    """The host going away mid-call kills the call's foreground command (nobody can read
    its result), keeps background ones and the sandbox's files, and the next host is
    served: the reconnect pause/resume depends on."""
    conn = await vm.dial()
    h1 = await conn.call("hello", None, timeout=30, response_type=ap.Hello)
    await conn.call("write", ap.WriteRequest(path="/tmp/keep", data=b"k"), timeout=30)
    bg = await conn.call("exec", ap.ExecRequest(argv=("sleep", "303"), background=True),
                         timeout=30, response_type=ap.ExecResult)
    task = asyncio.ensure_future(conn.call("exec", ap.ExecRequest(argv=("sleep", "304")), timeout=60))
    await asyncio.sleep(0.3)
    await conn.close()
    with contextlib.suppress(DsecError):
        await task
    conn = await vm.dial()
    try:
        h2 = await conn.call("hello", None, timeout=30, response_type=ap.Hello)
        assert h2.boot_id == h1.boot_id and h2.setup_done and h2.connections > h1.connections
        r = await conn.call("read", ap.ReadRequest(path="/tmp/keep"), timeout=30,
                            response_type=ap.ReadResult)
        assert r.data == b"k"
        for _ in range(50):
            ps = await conn.call("exec", ap.ExecRequest(shell="ps -o args | grep '^sleep 30[34]'"),
                                 timeout=30, response_type=ap.ExecResult)
            if b"304" not in ps.stdout:
                break
            await asyncio.sleep(0.05)
        assert b"sleep 303" in ps.stdout and b"304" not in ps.stdout, ps.stdout
        await conn.call("signal", ap.SignalRequest(pid=bg.pid, sig=9), timeout=30)
    finally:
        await conn.close()
    assert vm.proc.poll() is None, vm.serial()


@pytest_root
async def test_guest_faults_full_disk_and_oom(vm: Guest) -> None:
    """A full scratch disk is resource_exhausted for the host's write and a failing
    command for the sandbox, and clears when files go; a command eating more than the
    guest's RAM is OOM-killed inside the guest (reported), the agent (PID 1, exempt from
    the OOM killer) keeps serving."""
    conn = await vm.dial()
    try:
        # fill the disk without writing it (TCG writes a few MB/s under load): fallocate
        # files, halving the size at each refusal, down to 256 KiB
        r = await conn.call("exec", ap.ExecRequest(shell=(
            "s=67108864; i=0; while [ $s -ge 262144 ]; do "
            "if fallocate -l $s /workspace/fill$i 2>/dev/null; then i=$((i+1)); "
            "else s=$((s/2)); fi; done")), timeout=60, response_type=ap.ExecResult)
        assert r.exit_code == 0, r
        r = await conn.call("exec", ap.ExecRequest(
            argv=("dd", "if=/dev/zero", "of=/workspace/dd", "bs=1M", "count=4")), timeout=60,
            response_type=ap.ExecResult)
        assert r.exit_code != 0 and b"No space left" in r.stderr, r
        with pytest.raises(ResourceExhausted):
            await conn.call("write", ap.WriteRequest(path="/workspace/more", data=b"x" * (2 << 20)),
                            timeout=30)
        await conn.call("exec", ap.ExecRequest(shell="rm -f /workspace/fill* /workspace/dd"),
                        timeout=30)
        await conn.call("write", ap.WriteRequest(path="/workspace/more", data=b"x" * (1 << 20)),
                        timeout=30)
        # (overcommit on, so that the allocation succeeds and touching it is what fails)
        await conn.call("exec", ap.ExecRequest(shell="echo 1 > /proc/sys/vm/overcommit_memory"),
                        timeout=30)
        try:
            r = await conn.call("exec", ap.ExecRequest(
                shell="exec dd if=/dev/zero of=/dev/null bs=300M count=1"), timeout=60,
                response_type=ap.ExecResult)
        finally:
            await conn.call("exec", ap.ExecRequest(
                shell="echo 0 > /proc/sys/vm/overcommit_memory"), timeout=30)
        assert r.exit_code == 137 and r.oom_killed, r
        st = await conn.call("stats", None, timeout=30, response_type=ap.GuestStats)
        assert st.oom_kills >= 1
        r = await conn.call("exec", ap.ExecRequest(argv=("echo", "alive")), timeout=30,
                            response_type=ap.ExecResult)
        assert r.stdout == b"alive\n"
    finally:
        await conn.close()


class _Qmp:
    """Just enough QMP (JSON lines over the -qmp unix socket) for a migration."""

    def __init__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.r, self.w = r, w

    @classmethod
    async def open(cls, path: str) -> _Qmp:
        deadline = time.monotonic() + 60      # QEMU's start: seconds at host load 20
        while True:
            try:
                r, w = await asyncio.open_unix_connection(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.01)
        q = cls(r, w)
        await r.readline()                                  # greeting
        await q.cmd("qmp_capabilities")
        return q

    async def cmd(self, name: str, **args: object) -> object:
        self.w.write(msgspec.json.encode({"execute": name, "arguments": args}) + b"\n")
        while True:
            async with asyncio.timeout(30):
                line = await self.r.readline()
            msg = msgspec.json.decode(line)
            if "return" in msg:
                return msg["return"]
            if "error" in msg:
                raise AssertionError(f"QMP {name}: {msg['error']}")

    async def close(self) -> None:
        self.w.close()
        with contextlib.suppress(OSError):
            await self.w.wait_closed()


async def _wait_status(q: _Qmp, key: str, want: tuple[str, ...]) -> str:
    for _ in range(600):
        st = await q.cmd(key)
        status = st.get("status") if isinstance(st, dict) else None
        if status in want:
            return str(status)
        await asyncio.sleep(0.05)
    raise AssertionError(f"{key} never reached {want}")


@pytest_root
async def test_guest_pause_resume_by_migration(vm: Guest) -> None:
    """What pause/resume does to the agent: quiesce, the stopped guest migrated into a
    memory file, QEMU gone, a new QEMU started from that file. The restored agent keeps
    its boot, setup, files and background processes, and serves the new socket."""
    conn = await vm.dial()
    h1 = await conn.call("hello", None, timeout=30, response_type=ap.Hello)
    await conn.call("write", ap.WriteRequest(path="/tmp/paused", data=b"p"), timeout=30)
    bg = await conn.call("exec", ap.ExecRequest(argv=("sleep", "305"), background=True),
                         timeout=30, response_type=ap.ExecResult)
    await conn.call("quiesce", ap.QuiesceRequest(), timeout=30)
    await conn.close()
    mem = os.path.join(vm.dir, "mem")
    q = await _Qmp.open(vm.qmp)
    await q.cmd("stop")
    await q.cmd("migrate", uri=f"exec:cat > {mem}")
    assert await _wait_status(q, "query-migrate", ("completed", "failed")) == "completed"
    await q.close()
    vm.proc.kill()
    vm.proc.wait()
    for p in (vm.sock, vm.qmp):
        os.unlink(p)
    t0 = time.monotonic()
    vm.proc = subprocess.Popen([*vm.argv, "-incoming", f"exec:cat {mem}"],  # noqa: ASYNC220
                               stdin=subprocess.DEVNULL)
    q = await _Qmp.open(vm.qmp)
    await _wait_status(q, "query-status", ("paused", "postmigrate"))
    await q.cmd("cont")
    await q.close()
    conn = await vm.dial()
    try:
        print(f"\nresume-to-hello {time.monotonic() - t0:.2f} s")
        h2 = await conn.call("hello", None, timeout=30, response_type=ap.Hello)
        assert h2.boot_id == h1.boot_id and h2.setup_done and h2.uptime_s > h1.uptime_s
        r = await conn.call("read", ap.ReadRequest(path="/tmp/paused"), timeout=30,
                            response_type=ap.ReadResult)
        assert r.data == b"p"
        ps = await conn.call("exec", ap.ExecRequest(shell="ps -o args | grep -c '^sleep 305'"),
                             timeout=30, response_type=ap.ExecResult)
        assert ps.stdout.strip() == b"1"
        await conn.call("signal", ap.SignalRequest(pid=bg.pid, sig=9), timeout=30)
    finally:
        await conn.close()
