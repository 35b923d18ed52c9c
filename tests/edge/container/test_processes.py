"""The edge's process table on the container backend (issue 19): real processes in a real
sandbox - background output kept in a ring for a later connect, stdin kept open as a pipe,
signals to the process group, a pty inside the sandbox (controlling terminal, resize,
Ctrl-C reaching the foreground group), the caps, and processes dying with the sandbox."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.edge.processes import ProcessLimits, ProcessTable
from dsec.errors import (
    CannotRun,
    CapacityExceeded,
    InvalidTransition,
    RateLimited,
    ResourceExhausted,
)
from dsec.wire.spec import ExecChunk, ExecRequest, ExecResult, PtySize, SandboxSpec

from .conftest import _cleanup

pytestmark = pytest.mark.root


@pytest.fixture
async def node(tmp_path: object, images_dir: str) -> AsyncIterator[EdgeNode]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    backend = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                               images=DirectoryImages(images_dir))
    cfg = NodeConfig(node_id="t1", capacity=Capacity(cpu_milli=64_000, memory_bytes=64 << 30,
                                                     max_sandboxes=64))
    n = EdgeNode(cfg, backend)
    await n.start()
    try:
        yield n
    finally:
        await n.close()
        await _cleanup(backend)


SPEC = SandboxSpec(backend="container", memory_bytes=256 << 20, pids_max=256)


async def _collect(node: EdgeNode, sid: str, pid: int, *, until: bytes | None = None,
                   timeout: float = 20) -> tuple[bytes, ExecResult | None]:
    """Output of a connect (stdout and stderr together) until ``until`` shows or the
    process ends."""
    out = bytearray()

    async def run() -> ExecResult | None:
        async for item in node.processes.connect(sid, pid):
            if isinstance(item, ExecResult):
                return item
            out.extend(item.data)
            if until is not None and until in out:
                return None
        return None

    res = await asyncio.wait_for(run(), timeout)
    return bytes(out), res


async def test_background_output_is_kept_for_a_later_connect(node: EdgeNode) -> None:
    sid = (await node.create(SPEC)).id
    info = await node.processes.start(sid, ExecRequest(
        shell="echo out; echo err >&2; sleep 0.2; echo late; exit 3", tag="job"))
    assert info.pid > 1 and info.running and info.tag == "job"
    # a connect long after the end replays what it printed, then its exit
    await asyncio.sleep(1.0)
    out, res = await _collect(node, sid, info.pid)
    assert res is not None and res.exit_code == 3
    assert out.count(b"out\n") == 1 and b"err\n" in out and out.endswith(b"late\n")
    (listed,) = [p for p in node.processes.list(sid) if p.pid == info.pid]
    assert not listed.running and listed.exit_code == 3 and listed.signal is None
    # the pid is the one inside the sandbox (ps there shows it)
    info2 = await node.processes.start(sid, ExecRequest(shell="echo $$; sleep 5"))
    out, _ = await _collect(node, sid, info2.pid, until=b"\n")
    assert out.strip() == str(info2.pid).encode()


async def test_stdin_open_signals_and_exit_codes(node: EdgeNode) -> None:
    sid = (await node.create(SPEC)).id
    cat = await node.processes.start(sid, ExecRequest(argv=("cat",), stdin_open=True,
                                                      timeout_s=None))
    await node.processes.input(sid, cat.pid, b"hello ")
    await node.processes.input(sid, cat.pid, b"world\n")
    out, _ = await _collect(node, sid, cat.pid, until=b"world\n")
    assert out == b"hello world\n"
    node.processes.close_stdin(sid, cat.pid)
    _, res = await _collect(node, sid, cat.pid)
    assert res is not None and res.exit_code == 0
    with pytest.raises(InvalidTransition):
        await node.processes.input(sid, cat.pid, b"late")
    # a signal reaches the whole process group (the shell and its child sleep)
    sh = await node.processes.start(sid, ExecRequest(
        shell="trap 'echo got-term; exit 7' TERM; sleep 100 & wait"))
    await asyncio.sleep(0.3)
    node.processes.signal(sid, sh.pid, signal.SIGTERM)
    out, res = await _collect(node, sid, sh.pid)
    assert res is not None and res.exit_code == 7 and b"got-term" in out
    # SIGKILL: 137 and the signal recorded; nothing of it is left
    sl = await node.processes.start(sid, ExecRequest(shell="sleep 100 & sleep 100"))
    node.processes.signal(sid, sl.pid, signal.SIGKILL)
    _, res = await _collect(node, sid, sl.pid)
    assert res is not None and res.exit_code == 137
    (p,) = [p for p in node.processes.list(sid) if p.pid == sl.pid]
    assert p.signal == signal.SIGKILL
    left = await node.exec(sid, ExecRequest(shell="ps -o comm | grep -c sleep || true"))
    assert left.stdout.strip() == b"0", left.stdout
    # a command that cannot run is the caller's mistake, said as for a background exec
    with pytest.raises(CannotRun):
        await node.processes.start(sid, ExecRequest(argv=("/no/such/program",)))
    # a command timeout kills it
    t = await node.processes.start(sid, ExecRequest(shell="sleep 100", timeout_s=0.3))
    _, res = await _collect(node, sid, t.pid)
    assert res is not None and res.timed_out


async def test_pty_is_a_real_terminal_inside_the_sandbox(node: EdgeNode) -> None:
    sid = (await node.create(SPEC)).id
    info = await node.processes.start(sid, ExecRequest(
        argv=("/bin/sh",), pty=PtySize(cols=100, rows=30), env={"PS1": "$ "}))
    assert info.pty and info.stdin_open
    conn = node.processes.connect(sid, info.pid)
    out = bytearray()

    async def until(marker: bytes, timeout: float = 20) -> None:
        async def run() -> None:
            while marker not in out:
                item = await conn.__anext__()
                assert isinstance(item, ExecChunk), item
                out.extend(item.data)
        try:
            await asyncio.wait_for(run(), timeout)
        except TimeoutError:
            raise AssertionError(f"no {marker!r} in {bytes(out)!r}") from None

    await node.processes.input(sid, info.pid, b"tty; stty size; echo mark-$((6*7))\n")
    await until(b"mark-42")
    text = out.decode(errors="replace")
    assert "/dev/pts/" in text and "30 100" in text, text   # its own devpts, its size
    # resize: the size the terminal reports changes (TIOCSWINSZ)
    node.processes.resize(sid, info.pid, 132, 43)
    out.clear()
    await node.processes.input(sid, info.pid, b"stty size; echo mark-$((2+3))\n")
    await until(b"mark-5")
    assert b"43 132" in out, out
    # Ctrl-C reaches the foreground process (sleep), not through a signal call of ours
    out.clear()
    await node.processes.input(sid, info.pid, b"sleep 50\n")
    await asyncio.sleep(0.5)
    await node.processes.input(sid, info.pid, b"\x03")
    await until(b"^C")
    await node.processes.input(sid, info.pid, b"echo status-$?\n")
    await until(b"status-130", timeout=10)
    # exit code on exit
    await node.processes.input(sid, info.pid, b"exit 5\n")
    while True:
        item = await asyncio.wait_for(conn.__anext__(), 10)
        if isinstance(item, ExecResult):
            break
    assert item.exit_code == 5
    await conn.aclose()


async def test_caps_and_processes_die_with_their_sandbox(node: EdgeNode) -> None:
    node.processes = ProcessTable(node, ProcessLimits(per_sandbox=3, ring_bytes=4096,
                                                      ring_budget=5 * 4096))
    a = (await node.create(SPEC)).id
    b = (await node.create(SPEC)).id
    pids = [(await node.processes.start(a, ExecRequest(shell="sleep 100"))).pid
            for _ in range(3)]
    with pytest.raises(RateLimited, match="per-sandbox limit"):
        await node.processes.start(a, ExecRequest(shell="sleep 100"))
    # the ring budget of the node: two more fit on another sandbox, the third does not
    for _ in range(2):
        await node.processes.start(b, ExecRequest(shell="sleep 100"))
    with pytest.raises(CapacityExceeded, match="budget"):
        await node.processes.start(b, ExecRequest(shell="yes"))
    # a ring keeps the newest bytes only
    node.processes.signal(a, pids[0], signal.SIGKILL)
    _, res = await _collect(node, a, pids[0])
    assert res is not None
    big = await node.processes.start(a, ExecRequest(shell="seq 1 20000"))
    _, res = await _collect(node, a, big.pid)
    out, res = await _collect(node, a, big.pid)
    assert res is not None and len(out) <= 4096 and out.endswith(b"19999\n20000\n")
    (p,) = [p for p in node.processes.list(a) if p.pid == big.pid]
    assert p.output_dropped > 0
    # destroy: its processes end for a reader still following, and the table goes
    follower = asyncio.ensure_future(_collect(node, a, pids[1]))
    await asyncio.sleep(0.2)
    await node.destroy(a)
    out, res = await asyncio.wait_for(follower, 10)
    assert res is not None and res.exit_code == 137
    assert node.processes.count(a) == 0
    assert node._execs == 2         # b's two sleeps hold the node's command slots


async def test_a_hostile_reader_or_writer_cannot_make_the_edge_buffer(node: EdgeNode) -> None:
    """Input to a process that never reads waits in a bounded buffer (then the writer is
    told), queued writes are few; readers that never read are cut off (each alone, and
    the node's readers together, furthest behind first); no more than 16 follow one
    process."""
    node.processes = ProcessTable(node, ProcessLimits(
        input_pending=64 << 10, input_wait_s=0.5, follower_backlog=1 << 20,
        backlog_budget=3 << 20, followers=4))
    sid = (await node.create(SPEC)).id
    deaf = await node.processes.start(sid, ExecRequest(shell="sleep 100", stdin_open=True))
    await node.processes.input(sid, deaf.pid, b"x" * (60 << 10))   # the pipe takes 64 KiB
    await node.processes.input(sid, deaf.pid, b"x" * (60 << 10))   # then the buffer
    with pytest.raises(ResourceExhausted, match="has not read"):
        await node.processes.input(sid, deaf.pid, b"x" * (60 << 10))
    writers = [asyncio.ensure_future(node.processes.input(sid, deaf.pid, b"y" * (60 << 10)))
               for _ in range(8)]
    done = await asyncio.gather(*writers, return_exceptions=True)
    assert all(isinstance(d, ResourceExhausted) for d in done), done
    assert sum("queued behind" in str(d) for d in done) == 4          # 4 may wait
    # readers: a chatty process, five connects that read nothing after their first item
    chatty = await node.processes.start(sid, ExecRequest(shell="yes"))
    readers = [node.processes.connect(sid, chatty.pid) for _ in range(4)]
    for r in readers:
        await r.__anext__()
    with pytest.raises(RateLimited, match="readers following it"):
        await node.processes.connect(sid, chatty.pid).__anext__()
    await asyncio.sleep(1.0)
    assert node.processes._backlog.total <= 3 << 20
    for r in readers:
        with pytest.raises(ResourceExhausted, match="cut off"):
            while True:
                await r.__anext__()
    assert node.processes._backlog.total == 0
    node.processes.signal(sid, chatty.pid, signal.SIGKILL)
    node.processes.signal(sid, deaf.pid, signal.SIGKILL)


async def test_a_best_effort_sandbox_s_processes_and_ptys_run_sched_idle(
        node: EdgeNode) -> None:
    """Issue 22: a process of the table (background, pty) in a BE sandbox is SCHED_IDLE,
    and what it forks later inherits it; in an LS sandbox SCHED_OTHER. (The zygote forks
    these itself: the edge sets the policy when it reports the command running, so the
    shell sleeps first; what runs in that instant is held by the cgroup's cpu.idle.)"""
    import msgspec

    for qos, want in (("be", 5), ("ls", 0)):
        sid = (await node.create(msgspec.structs.replace(SPEC, qos=qos))).id
        info = await node.processes.start(sid, ExecRequest(
            shell="sleep 0.3; grep '^policy' /proc/self/sched; sleep 5"))
        out, _ = await _collect(node, sid, info.pid, until=b"\n")
        assert int(out.split(b":")[1]) == want, (qos, out)
        tty = await node.processes.start(sid, ExecRequest(
            shell="sleep 0.3; grep '^policy' /proc/self/sched; sleep 5",
            pty=PtySize(cols=80, rows=24)))
        out, _ = await _collect(node, sid, tty.pid, until=b"\n")
        assert int(out.split(b":")[1]) == want, (qos, out)
