"""spec.user_namespace=True: root inside is an unprivileged uid on the host (native driver).

Real sandboxes: the user namespace, idmapped lower layers, the chowned upper dir, and that
exec/files/pause/resume/destroy keep working and leave nothing behind."""

from __future__ import annotations

import os

import msgspec
import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.errors import InvalidArgument
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.container.conftest import SPEC, new_sid

USERNS = msgspec.structs.replace(SPEC, user_namespace=True)


async def sh(b: ContainerBackend, sid: str, cmd: str, **kw: object) -> str:
    r = await b.exec(sid, ExecRequest(shell=cmd, timeout_s=20, **kw))  # type: ignore[arg-type]
    assert r.exit_code == 0, (cmd, r)
    return r.stdout.decode()


def _mounts(under: str) -> list[str]:
    """Host mount points below ``under`` (the backend's root_dir). Only those: other tests
    on the machine mount and unmount elsewhere all the time."""
    with open("/proc/self/mountinfo") as f:
        return sorted(p for p in (line.split()[4] for line in f)
                      if p == under or p.startswith(under + "/"))


async def test_root_inside_is_mapped_uid_outside(backend: ContainerBackend) -> None:
    base, size = backend.userns_range
    sid = new_sid()
    await backend.create(sid, USERNS)
    assert (await sh(backend, sid, "id -u; id -g")).split() == ["0", "0"]
    assert (await sh(backend, sid, "stat -c '%u:%g' /bin/busybox /etc/passwd /")).split() \
        == ["0:0"] * 3
    assert (await sh(backend, sid, "cat /proc/self/uid_map")).split() == ["0", str(base),
                                                                          str(size)]
    assert (await sh(backend, sid, "cat /proc/self/gid_map")).split() == ["0", str(base),
                                                                          str(size)]
    # the init and an exec run as the mapped uid on the host
    init = backend.init_pid(sid)
    assert os.stat(f"/proc/{init}").st_uid == base
    # a file made inside (new, and a copy-up of a lower file) is the mapped uid on the host
    await sh(backend, sid, "echo hi > /made && echo x >> /etc/passwd && mkdir -p /d/e")
    upper = backend.upper_dir(sid)
    for rel in ("made", "etc/passwd", "d/e"):
        st = os.stat(os.path.join(upper, rel))
        assert (st.st_uid, st.st_gid) == (base, base), rel
    # a non-root user inside maps to base + 1000
    assert (await sh(backend, sid, "id -u", user="agent")).strip() == "1000"
    await sh(backend, sid, "touch /tmp/x", user="agent")
    # net, uts and ipc belong to the sandbox's user namespace: its root may bind port 80
    # (CAP_NET_BIND_SERVICE there); CAP_SYS_ADMIN is dropped as without the option
    await sh(backend, sid, "httpd -p 127.0.0.1:80 -h /tmp")
    assert "127.0.0.1:80" in await sh(backend, sid, "netstat -ltn")
    assert (await sh(backend, sid, "ip -o link | wc -l")).strip() == "1"  # lo only
    r = await backend.exec(sid, ExecRequest(argv=("hostname", "renamed")))
    assert r.exit_code != 0 and (await sh(backend, sid, "hostname")).strip() == sid
    # caps are per user namespace: the host's files and kernel knobs stay out of reach
    r = await backend.exec(sid, ExecRequest(shell="echo 1 > /proc/sys/kernel/sysrq"))
    assert r.exit_code != 0
    r = await backend.exec(sid, ExecRequest(argv=("cat", "/proc/kcore")))
    assert r.stdout == b""
    await backend.destroy(sid)


async def test_files_pause_resume_destroy(backend: ContainerBackend) -> None:
    base = backend.userns_range[0]
    warm = new_sid()  # starts the zygote (its socket is one fd of ours for good)
    await backend.create(warm, USERNS)
    await backend.destroy(warm)
    mounts, fds = _mounts(backend.root_dir), len(os.listdir("/proc/self/fd"))
    sid = new_sid()
    await backend.create(sid, USERNS)
    await backend.write_file(sid, "/work/a/note.txt", b"from the host")
    assert await backend.read_file(sid, "/work/a/note.txt") == b"from the host"
    # written by the API as host root, yet owned by the sandbox's root, which may change it
    assert (await sh(backend, sid, "stat -c '%u' /work /work/a /work/a/note.txt")).split() \
        == ["0"] * 3
    await sh(backend, sid, "echo more >> /work/a/note.txt && rm -r /work/a && mkdir /work/b")
    assert os.stat(os.path.join(backend.upper_dir(sid), "work/b")).st_uid == base
    assert {i.name for i in await backend.list_dir(sid, "/work")} == {"b"}
    await sh(backend, sid, "sleep 1000", background=True)
    await backend.pause(sid)
    assert (await sh(backend, sid, "echo up")) == "up\n"  # resumes transparently
    await backend.pause(sid)
    await backend.resume(sid)
    d = os.path.join(backend.root_dir, "sb", sid)
    await backend.destroy(sid)
    assert not os.path.exists(d)
    assert backend.sandbox_ids() == []
    assert not backend.governor.list_sandboxes()
    assert _mounts(backend.root_dir) == mounts and len(os.listdir("/proc/self/fd")) == fds


async def test_disk_capped_upper(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, msgspec.structs.replace(USERNS, disk_bytes=8 << 20))
    await sh(backend, sid, "echo hi > /x && cat /x")
    assert os.stat(os.path.join(backend.upper_dir(sid), "x")).st_uid == backend.userns_range[0]
    r = await backend.exec(sid, ExecRequest(shell="head -c 16m /dev/zero > /big"))
    assert r.exit_code != 0  # the 8 MiB cap holds (busybox head says "I/O error")
    assert os.stat(os.path.join(backend.upper_dir(sid), "big")).st_size < 8 << 20
    await backend.destroy(sid)


async def test_default_has_no_user_namespace(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    assert "4294967295" in await sh(backend, sid, "cat /proc/self/uid_map")
    assert os.stat(f"/proc/{backend.init_pid(sid)}").st_uid == 0
    await backend.destroy(sid)


async def test_bad_values_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="user_namespace"):
        msgspec.structs.replace(SPEC, user_namespace="yes").validate()  # type: ignore[arg-type]
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"user_namespace": 1}', type=SandboxSpec)
    with pytest.raises(InvalidArgument, match="userns_range"):
        ContainerBackend(root_dir="/nonexistent-never-made", images=None,  # type: ignore[arg-type]
                         userns_range=(0, 65536))


async def test_runc_refuses_it(runc_backend: ContainerBackend) -> None:
    with pytest.raises(InvalidArgument, match="native"):
        await runc_backend.create(new_sid(), USERNS)
    assert runc_backend.sandbox_ids() == []
