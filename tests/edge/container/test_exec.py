"""create -> exec -> destroy through the Backend protocol, on real namespaces and cgroups."""

from __future__ import annotations

import asyncio
import os

import pytest

from dsec.edge.backend import Backend
from dsec.edge.backends.container import ContainerBackend
from dsec.errors import ImageNotFound, InvalidArgument, SandboxNotFound
from dsec.wire.spec import ExecChunk, ExecRequest, ExecResult, SandboxSpec
from tests.edge.container.conftest import SPEC, new_sid


async def test_create_exec_destroy(backend: ContainerBackend) -> None:
    assert isinstance(backend, Backend)
    sid = new_sid()
    await backend.create(sid, SPEC)
    r = await backend.exec(sid, ExecRequest(shell="echo hello; echo oops >&2; exit 3"))
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"hello\n", b"oops\n")
    assert not r.timed_out and not r.stdout_truncated
    r = await backend.exec(sid, ExecRequest(argv=("hostname",)))
    assert r.stdout.decode().strip() == sid
    # create answers once init is set up in its namespaces; its execve of the init binary
    # may still be under way on a loaded host, and a process mid-execve has an empty
    # cmdline (its new mm has no arguments yet): read it again for a moment
    for _ in range(100):
        r = await backend.exec(sid, ExecRequest(
            shell="echo $$; cat /proc/1/cmdline | tr '\\0' ' '"))
        pid_inside, init_cmd = r.stdout.decode().split("\n")[:2]
        if init_cmd:
            break
        await asyncio.sleep(0.02)
    assert int(pid_inside) > 1 and init_cmd.startswith("/dev/.init -P")
    d = backend.upper_dir(sid)
    assert os.path.isdir(d)
    await backend.destroy(sid)
    assert not os.path.exists(os.path.dirname(d))
    await backend.destroy(sid)  # idempotent
    with pytest.raises(SandboxNotFound):
        await backend.exec(sid, ExecRequest(argv=("true",)))


async def test_env_cwd_user_stdin(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SandboxSpec(backend="container", env={"A": "spec", "B": "spec"}))
    r = await backend.exec(sid, ExecRequest(shell="echo $A $B $PATH", env={"B": "req"}))
    assert r.stdout.decode().split()[:2] == ["spec", "req"]
    assert "/usr/bin" in r.stdout.decode()
    r = await backend.exec(sid, ExecRequest(argv=("pwd",), cwd="/etc"))
    assert r.stdout == b"/etc\n"
    r = await backend.exec(sid, ExecRequest(shell="id -u; id -g; echo $HOME", user="agent"))
    assert r.stdout.split() == [b"1000", b"1000", b"/home/agent"]
    r = await backend.exec(sid, ExecRequest(argv=("id", "-u"), user="4242"))
    assert r.stdout == b"4242\n"
    data = os.urandom(300_000)
    r = await backend.exec(sid, ExecRequest(argv=("cat",), stdin=data))
    assert r.stdout == data
    r = await backend.exec(sid, ExecRequest(argv=("no-such-command",)))
    assert r.exit_code == 127 and b"no-such-command" in r.stderr


async def test_timeout_kills_process_group(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    r = await backend.exec(sid, ExecRequest(shell="sleep 100 & sleep 100; echo never",
                                            timeout_s=0.3))
    assert r.timed_out and r.exit_code == 128 + 9 and b"never" not in r.stdout
    ps = await backend.exec(sid, ExecRequest(shell="ps -o pid,args | grep 'sleep 100' | "
                                                   "grep -v grep | wc -l"))
    assert ps.stdout.strip() == b"0"


async def test_output_cap_truncates_and_yes_does_not_fill_memory(
        backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    r = await backend.exec(sid, ExecRequest(argv=("yes",), timeout_s=0.5,
                                            output_cap_bytes=1000))
    assert r.timed_out and r.stdout_truncated and r.stdout == b"y\n" * 500
    r = await backend.exec(sid, ExecRequest(shell="head -c 5000 /dev/zero",
                                            output_cap_bytes=4096))
    assert r.exit_code == 0 and r.stdout_truncated and len(r.stdout) == 4096


async def test_stream_yields_chunks_then_result(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    items = [i async for i in backend.exec_stream(
        sid, ExecRequest(shell="echo one; sleep 0.1; echo two >&2; echo three"))]
    assert isinstance(items[-1], ExecResult) and items[-1].exit_code == 0
    assert items[-1].stdout == b"" and items[-1].stderr == b""
    chunks = [c for c in items[:-1] if isinstance(c, ExecChunk)]
    assert len(chunks) == len(items) - 1
    assert b"".join(c.data for c in chunks if c.stream == "stdout") == b"one\nthree\n"
    assert b"".join(c.data for c in chunks if c.stream == "stderr") == b"two\n"


async def test_background_process_outlives_exec(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    r = await backend.exec(sid, ExecRequest(shell="sleep 30", background=True))
    assert r.exit_code == 0 and r.pid is not None and r.pid > 1
    # Started means the shell runs; its own exec of `sleep` follows a moment later (and a
    # process mid-execve has an empty cmdline: a window that is long under TCG, vm tier)
    for _ in range(100):
        ps = await backend.exec(sid, ExecRequest(argv=("cat", f"/proc/{r.pid}/cmdline")))
        if ps.stdout and not ps.stdout.startswith(b"/bin/sh"):
            break
        await asyncio.sleep(0.01)
    assert ps.stdout.startswith(b"sleep")
    # a foreground command whose child keeps stdout open still returns
    fg = await backend.exec(sid, ExecRequest(shell="sleep 30 & echo done", timeout_s=10))
    assert fg.stdout == b"done\n" and not fg.timed_out


async def test_bad_input_leaves_nothing(backend: ContainerBackend) -> None:
    sid = new_sid()
    with pytest.raises(ImageNotFound):
        await backend.create(sid, SandboxSpec(backend="container", image="nope"))
    with pytest.raises(InvalidArgument):
        await backend.create(sid, SandboxSpec(backend="container", memory_bytes=10))
    assert not os.path.exists(os.path.dirname(backend.upper_dir(sid)))
    assert backend.governor.list_sandboxes() == []
    await backend.create(sid, SPEC)
    with pytest.raises(InvalidArgument):
        await backend.exec(sid, ExecRequest())
