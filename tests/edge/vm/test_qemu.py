"""The QEMU command line, the reconcile marker and the host's checks of agent results
(pure: no QEMU started)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.edge.backends.vm.link import checked_result
from dsec.edge.backends.vm.qemu import (
    Disk,
    VmSpec,
    marker_of,
    memory_mib,
    parse_marker,
    qemu_argv,
    vcpus,
)
from dsec.errors import BackendError
from dsec.wire.spec import ExecRequest, ExecResult


def _spec(**kw: object) -> VmSpec:
    base: dict[str, object] = {"marker": marker_of("k", "sb-1"), "kernel_fd": 3,
                               "initrd_fd": 4, "memory_mib": 256, "vcpus": 2, "agent_fd": 5,
                               "qmp_fd": 6}
    base.update(kw)
    return VmSpec(**base)  # type: ignore[arg-type]


def _after(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_every_file_is_a_descriptor_and_the_sandbox_is_on() -> None:
    s = _spec(disks=(Disk(7), Disk(8), Disk(9, readonly=False, rw_fd=10)), incoming_fd=11)
    argv = qemu_argv(s)
    assert _after(argv, "-kernel") == ["/proc/self/fd/3"]
    assert _after(argv, "-initrd") == ["/proc/self/fd/4"]
    assert _after(argv, "-add-fd") == ["fd=7,set=1", "fd=8,set=2", "fd=9,set=3",
                                       "fd=10,set=3"]
    drives = _after(argv, "-drive")
    assert [d.split(",")[0] for d in drives] == ["file=/dev/fdset/1", "file=/dev/fdset/2",
                                                 "file=/dev/fdset/3"]
    assert ["readonly=on" in d for d in drives] == [True, True, False]
    assert "werror=report" in drives[2] and "discard=ignore" in drives[2]
    # /dev/vda, vdb, vdc in command-line order: fixed, increasing PCI slots
    blk = [d for d in _after(argv, "-device") if d.startswith("virtio-blk-pci")]
    assert [d.rsplit("addr=", 1)[1] for d in blk] == ["0x4", "0x5", "0x6"]
    assert _after(argv, "-incoming") == ["fd:11"]
    assert _after(argv, "-sandbox") == [
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]
    assert "-runas" not in argv                  # started unprivileged instead
    assert "vmgenid,guid=auto" in _after(argv, "-device")   # clones reseed their RNG
    assert _after(argv, "-accel") == ["tcg,tb-size=32"]
    assert _after(argv, "-M") == ["pc"]
    assert sorted(s.fds()) == [3, 4, 5, 6, 7, 8, 9, 10, 11]
    # nothing QEMU would open by a path of ours
    assert not any(a.startswith("/") and not a.startswith(("/proc/self/fd/", "/dev/fdset/"))
                   for a in argv[1:])


def test_a_writable_disk_needs_both_access_modes() -> None:
    with pytest.raises(BackendError, match="O_RDWR"):
        qemu_argv(_spec(disks=(Disk(7, readonly=False),)))
    with pytest.raises(BackendError, match="PCI slots"):
        qemu_argv(_spec(disks=tuple(Disk(7 + i) for i in range(25))))


def test_console_only_when_asked() -> None:
    assert "console=ttyS0" not in " ".join(qemu_argv(_spec()))
    argv = qemu_argv(_spec(console_fd=12))
    assert _after(argv, "-append")[0].startswith("console=ttyS0 ")
    assert 12 in _spec(console_fd=12).fds()


def test_marker_names_only_our_own_vms() -> None:
    argv = qemu_argv(_spec())
    cmd = b"\0".join(a.encode() for a in argv) + b"\0"
    assert parse_marker(cmd, "k") == "sb-1"
    assert parse_marker(cmd, "other") is None           # another edge's VM
    assert parse_marker(b"sleep\0-name\0guest=dsec-vm.k.\0", "k") is None
    assert parse_marker(b"x\0-name\0guest=dsec-vm.k.a/b\0", "k") is None
    assert parse_marker(b"x\0-name\0guest=dsec-vm.k.\xff\0", "k") is None
    assert parse_marker(b"x\0-name", "k") is None


def test_sizes() -> None:
    assert vcpus(1, max_vcpus=8) == 1
    assert vcpus(1000, max_vcpus=8) == 1
    assert vcpus(1001, max_vcpus=8) == 2
    assert vcpus(64000, max_vcpus=2) == 2
    assert memory_mib(1 << 20) == 64
    assert memory_mib((256 << 20) + 1) == 257


def test_agent_results_are_held_to_the_request() -> None:
    req = ExecRequest(argv=("x",), output_cap_bytes=4)
    res = checked_result(ExecResult(exit_code=1 << 40, stdout=b"123456", stderr=b"ab",
                                    pid=77, duration_s=-3.0), req)
    assert (res.stdout, res.stdout_truncated) == (b"1234", True)
    assert (res.stderr, res.stderr_truncated) == (b"ab", False)
    assert res.exit_code == -1 and res.pid is None and res.duration_s == 0.0
    bg = checked_result(ExecResult(exit_code=0, pid=77),
                        ExecRequest(argv=("x",), background=True))
    assert bg.pid == 77


def test_exec_defaults_come_from_the_spec() -> None:
    from dsec.edge.backends.vm.backend import VmBackend, _Record, _Vm
    from dsec.edge.governor import SandboxCgroup
    from dsec.wire.spec import SandboxSpec

    vm = _Vm(sid="sb-1", spec=SandboxSpec(cwd="/work", user="agent"), dir="",
             rec=_Record(sid="sb-1", uid=0), cg=SandboxCgroup(1, {}))
    got = VmBackend._with_defaults(vm, ExecRequest(argv=("x",)))
    assert (got.cwd, got.user) == ("/work", "agent")
    own = VmBackend._with_defaults(vm, ExecRequest(argv=("x",), cwd="/tmp", user="root"))
    assert (own.cwd, own.user) == ("/tmp", "root")


def test_unix_sockets_under_a_long_root_dir_bind_and_connect(tmp_path: Path) -> None:
    """A socket path longer than sun_path (a deep root_dir: a pytest temp dir made one
    107 bytes long) binds and connects through its directory's descriptor."""
    import socket

    from dsec.edge.backends.vm.qemu import unix_path

    deep = tmp_path / ("x" * 60) / ("y" * 60)
    deep.mkdir(parents=True)
    path = str(deep / "a")
    assert len(path) > 108
    srv = socket.socket(socket.AF_UNIX)
    cli = socket.socket(socket.AF_UNIX)
    try:
        with unix_path(path) as short:
            assert len(short) < 100
            srv.bind(short)
        srv.listen(1)
        with unix_path(path) as short:
            cli.connect(short)
        assert os.path.exists(path)
        with unix_path("/tmp/short") as same:
            assert same == "/tmp/short"
    finally:
        srv.close()
        cli.close()
