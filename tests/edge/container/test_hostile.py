"""An agent running as root inside its sandbox tries to break out, cheat or take the node
down. Every attempt must fail, and only its own sandbox may feel it."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.container.conftest import SPEC, new_sid


async def sh(b: ContainerBackend, sid: str, cmd: str, **kw: object) -> tuple[int, str]:
    r = await b.exec(sid, ExecRequest(shell=cmd, timeout_s=20, **kw))  # type: ignore[arg-type]
    return r.exit_code, (r.stdout + r.stderr).decode(errors="replace")


async def test_overwriting_bin_sh_stays_in_its_sandbox(backend: ContainerBackend,
                                                       images_dir: str) -> None:
    a, b = new_sid(), new_sid()
    await backend.create(a, SPEC)
    await backend.create(b, SPEC)
    image_sh = os.path.join(images_dir, "base/bin/busybox")
    size = os.path.getsize(image_sh)
    code, out = await sh(backend, a, "rm /bin/sh; printf '#!/bin/busybox ash\\necho PASSED\\n'"
                                     " > /bin/sh; chmod +x /bin/sh; /bin/sh -c true")
    assert "PASSED" in out
    code, out = await sh(backend, b, "echo real")  # b still has the real shell
    assert (code, out) == (0, "real\n")
    assert os.path.getsize(image_sh) == size and os.path.islink(
        os.path.join(images_dir, "base/bin/sh"))
    code, out = await sh(backend, a, "echo > /bin/busybox", )
    assert os.path.getsize(image_sh) == size  # copy-up, the image is untouched


async def test_cannot_see_other_sandboxes(backend: ContainerBackend) -> None:
    a, b = new_sid(), new_sid()
    await backend.create(a, SPEC)
    await backend.create(b, SPEC)
    await backend.write_file(b, "/root/answer.txt", b"42")
    await backend.exec(b, ExecRequest(shell="sleep 60", background=True))
    _code, out = await sh(backend, a, "find / -name answer.txt 2>/dev/null; echo ---; "
                                      "ps -o comm")
    found, procs = out.split("---")
    assert found.strip() == "" and "sleep" not in procs.split()
    _code, out = await sh(backend, a, "ls /proc | grep -c '^[0-9]'")
    assert int(out) <= 4  # init, sh, ls, grep: its own processes only
    _code, out = await sh(backend, a, f"ls {backend.root_dir} 2>&1; cat /proc/1/mountinfo")
    assert backend.upper_dir(b) not in out.split("upperdir=")[0]


async def test_cannot_reach_host_sockets(backend: ContainerBackend, tmp_path: object) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    path = os.path.join(str(tmp_path), "edge.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen()
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(b"\0dsec-test-edge")
    abstract.listen()
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    port = tcp.getsockname()[1]
    try:
        _code, out = await sh(backend, sid, f"ls -la {path} 2>&1; "
                                           f"echo x | nc -w1 127.0.0.1 {port} && echo TCPOK")
        assert "No such file" in out and "TCPOK" not in out
        r = await backend.exec(sid, ExecRequest(shell="grep -c dsec-test-edge /proc/net/unix"))
        assert r.stdout == b"0\n"  # the edge's abstract socket is not even listed
        r = await backend.exec(sid, ExecRequest(shell="ls /sys/class/net"))
        assert r.stdout.split() == [b"lo"]  # the only interface
    finally:
        srv.close()
        abstract.close()
        tcp.close()


async def test_privileged_calls_are_denied(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    checks = {
        "mount": "mount -t tmpfs none /mnt",
        "umount": "umount /proc",
        "unshare-user": "unshare -U true",
        "unshare-net": "unshare -n true",
        "chroot-escape-mknod": "mknod /tmp/sda b 8 0",
        "kcore": "test $(head -c 100 /proc/kcore 2>/dev/null | wc -c) -gt 0",
        "keys": "test $(cat /proc/keys 2>/dev/null | wc -c) -gt 0",
        "sysrq": "echo h > /proc/sysrq-trigger",
        "sysctl": "echo 1 > /proc/sys/kernel/panic",
        "sys-write": "echo 1 > /sys/kernel/profiling",
        "hostname": "hostname evil",
        "ptrace": "strace true || nsenter -t 1 -m true",
        "swapoff": "swapoff -a && swapon -s | grep -q zram",
        "insmod": "insmod /nonexistent.ko",
        "reboot": "reboot -f",
        "cgroup-escape": "echo $$ > /sys/fs/cgroup/cgroup.procs",
    }
    for name, cmd in checks.items():
        code, out = await sh(backend, sid, cmd)
        assert code != 0, f"{name}: {cmd!r} succeeded inside the sandbox: {out}"
    code, out = await sh(backend, sid, "grep -E 'CapEff|NoNewPrivs|Seccomp:' /proc/self/status")
    fields = dict(line.split(":\t") for line in out.strip().splitlines())
    assert fields["NoNewPrivs"] == "1" and fields["Seccomp"] == "2"
    assert int(fields["CapEff"], 16) & (1 << 21) == 0  # no CAP_SYS_ADMIN
    code, out = await sh(backend, sid, "echo alive")  # and the sandbox still works
    assert out == "alive\n"


async def test_memory_bomb_is_oom_killed_and_reported(backend: ContainerBackend) -> None:
    events: list[tuple[str, str, str]] = []
    backend.watch(lambda sid, reason, detail: events.append((sid, reason, detail)))
    bomb, bystander = new_sid(), new_sid()
    await backend.create(bomb, SandboxSpec(backend="container", memory_bytes=64 << 20))
    await backend.create(bystander, SPEC)
    r = await backend.exec(bomb, ExecRequest(
        shell="head -c 500m /dev/zero | tail > /dev/null; echo survived", timeout_s=60))
    # The kernel kills the biggest task (tail) and the shell lives on; on a loaded host a
    # second OOM can come while tail's memory is still being freed and take the shell
    # too (seen once in a full suite run). Either way: killed by the OOM killer, reported.
    assert b"survived" in r.stdout or (r.exit_code == 137 and not r.timed_out), r
    for _ in range(100):
        if events:
            break
        await asyncio.sleep(0.01)
    assert [(s, why) for s, why, _ in events][:1] == [(bomb, "oom_kill")]
    assert "memory limit of 67108864" in events[0][2]
    _code, out = await sh(backend, bystander, "echo fine")
    assert out == "fine\n"
    _code, out = await sh(backend, bomb, "echo still-exec-able")
    assert out == "still-exec-able\n"


@pytest.mark.parametrize("userns", [False, True], ids=["plain", "userns"])
async def test_fork_bomb_hits_pids_max(backend: ContainerBackend, userns: bool) -> None:
    sid, other = new_sid(), new_sid()
    await backend.create(sid, SandboxSpec(backend="container", pids_max=64,
                                          user_namespace=userns))
    await backend.create(other, SPEC)
    r = await backend.exec(sid, ExecRequest(
        shell="i=0; while [ $i -lt 200 ]; do sleep 30 & i=$((i+1)); done", timeout_s=30))
    assert b"can't fork" in r.stderr or b"Resource temporarily unavailable" in r.stderr
    stats = await backend.stats(sid)
    assert 50 <= stats.pids <= 64
    # an exec still gets in (its helper forks outside the cap and moves the command in)
    # and sees the cap; the command is counted in the sandbox's pids cgroup
    r = await backend.exec(sid, ExecRequest(argv=("ls", "/proc")))
    assert 50 <= sum(1 for n in r.stdout.split() if n.isdigit()) <= 64
    # its own forks stay capped: more than the cap's worth of them fail. (One fork was
    # not enough: a pid the bomb's last round left free - a helper that held it while the
    # bomb ran, under a loaded machine - let a single fork through.)
    r = await backend.exec(sid, ExecRequest(
        shell="i=0; while [ $i -lt 80 ]; do sleep 30 & i=$((i+1)); done", user="agent",
        timeout_s=30))
    assert b"can't fork" in r.stderr or b"Resource temporarily unavailable" in r.stderr, r
    _code, out = await sh(backend, other, "echo ok")  # other sandboxes unaffected
    assert out == "ok\n"
    await backend.destroy(sid)  # and it can still be torn down
