"""The pieces behind durable background processes (dsec.edge.fdstore, dsec.edge.fdkeeper),
with a real keeper process: descriptors held across the client's death, the exit status
of an orphan of a process the keeper started, the keeper's exit when it holds nothing,
and the process journal's replay (torn line, compaction)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from dsec.edge.fdstore import (
    KEEPER_SOCKET,
    PROCESS_JOURNAL,
    DurableProcess,
    FdStore,
    ProcessJournal,
)
from dsec.ownership import start_time
from dsec.wire.process import ProcessInfo


@pytest.fixture
def store(tmp_path: object) -> Iterator[FdStore]:
    s = FdStore(str(tmp_path), orphan_s=5.0)
    try:
        yield s
    finally:
        s.close()
        if s.keeper is not None:
            if s.keeper.poll() is None:
                s.keeper.kill()
            s.keeper.wait()


def _gone(proc: subprocess.Popen[bytes], within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return True
        time.sleep(0.02)
    return False


def test_descriptors_outlive_the_client_and_come_back(store: FdStore) -> None:
    r, w = os.pipe()
    store.put("sb-1/10/20", {"out": r})
    os.close(r)
    store.close()                     # the edge dies: the keeper keeps the read end
    os.write(w, b"kept\n")            # no EPIPE: a reader still exists
    again = FdStore(store.path.rsplit("/", 1)[0])
    assert again.keys() == ["sb-1/10/20"]
    fds = again.take("sb-1/10/20")
    assert fds is not None and os.read(fds["out"], 100) == b"kept\n"
    os.close(fds["out"])
    again.drop("sb-1/10/20")
    again.close()                     # nothing held, no edge: the keeper exits
    assert store.keeper is not None and _gone(store.keeper)
    assert not os.path.exists(store.path)
    with pytest.raises(BrokenPipeError):
        os.write(w, b"x")
    os.close(w)


def test_keeper_reaps_the_orphans_of_what_it_started(store: FdStore) -> None:
    """The exec helper's role: a process the keeper started forks a child and exits;
    the child is re-parented to the keeper (a subreaper), which keeps its status for
    the key it holds descriptors under."""
    r, w = os.pipe()
    helper = store.spawn(["sh", "-c", "sleep 0.3 & echo $! >&{0}; exec true"], "/bin/sh",
                         [w])
    os.close(w)
    child = int(os.read(r, 100).split()[0])
    os.close(r)
    start = start_time(child)
    assert start is not None
    key = f"sb-1/{child}/{start}"
    rr, ww = os.pipe()
    store.put(key, {"out": rr})
    os.close(rr)
    os.close(ww)
    helper.wait(timeout=5)
    raw = store.status(key)
    assert raw is not None and os.waitstatus_to_exitcode(raw) == 0
    # one that is not the keeper's: unknown at once, not waited for
    other = subprocess.Popen(["sleep", "5"])
    try:
        t0 = time.monotonic()
        assert store.status(f"sb-1/{other.pid}/{start_time(other.pid)}") is None
        assert time.monotonic() - t0 < 2
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    store.drop(key)


def test_what_the_keeper_starts_ignores_and_blocks_no_signal(store: FdStore) -> None:
    """Ignored dispositions survive execve: anything ignored here would be ignored by
    every sandbox command the exec helper starts (a Ctrl-C that does nothing). The
    keeper is started with SIGHUP and 32 ignored, as CI's parent left 32 (glibc's
    posix_spawn does) and ``nohup`` leaves SIGHUP: it puts them back to the default."""
    from tests.edge.container.test_process_durability import _sigaction
    r, w = os.pipe()
    before = {s: _sigaction(s, 1) for s in (signal.SIGHUP, 32)}
    try:
        helper = store.spawn(["sh", "-c", "grep -E '^Sig(Ign|Blk)' /proc/self/status >&{0}"],
                             "/bin/sh", [w])
    finally:
        for s, h in before.items():
            _sigaction(s, h)
    os.close(w)
    helper.wait(timeout=5)
    out = os.read(r, 1000).decode()
    os.close(r)
    assert out.split() == ["SigBlk:", "0" * 16, "SigIgn:", "0" * 16], out


def test_keeper_refuses_a_socket_of_another_uid(tmp_path: object) -> None:
    if os.geteuid() != 0:
        pytest.skip("by design: needs root to bind a socket as another uid")
    path = os.path.join(str(tmp_path), KEEPER_SOCKET)
    # bound as root, listening as nobody (SO_PEERCRED: the listener's creds at listen())
    squatter = subprocess.Popen(
        [sys.executable, "-c",
         ("import os,socket,time; s=socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); "
          f"s.bind({path!r}); os.setgid(65534); os.setuid(65534); s.listen(1); "
          "time.sleep(30)")])
    try:
        for _ in range(250):
            if os.path.exists(path):
                break
            time.sleep(0.02)
        time.sleep(0.3)          # bound; now listening
        s = FdStore(str(tmp_path))
        r, w = os.pipe()
        with pytest.raises(Exception, match="not this edge's"):
            s.put("sb-1/1/1", {"out": r})
        os.close(r)
        os.close(w)
    finally:
        squatter.kill()
        squatter.wait()


def _proc(sid: str, pid: int) -> DurableProcess:
    return DurableProcess(sid=sid, pid=pid, host_pid=1000 + pid, host_start=5,
                          exec_cgroup="/x", info=ProcessInfo(pid=pid, cmd="sleep 1"))


def test_journal_replays_puts_ends_drops_and_skips_a_torn_line(tmp_path: object) -> None:
    d = str(tmp_path)
    j = ProcessJournal(d)
    j.load()
    j.put(_proc("sb-a", 1))
    j.put(_proc("sb-a", 2))
    j.put(_proc("sb-b", 3))
    j.end("sb-a", 1)
    j.drop("sb-b")
    j.put(_proc("sb-c", 4))
    j.close()
    with open(os.path.join(d, PROCESS_JOURNAL), "ab") as f:
        f.write(b'{"tag":"p","pro')         # a write cut by the crash
    again = ProcessJournal(d)
    assert sorted(again.load()) == [("sb-a", 2), ("sb-c", 4)]
    with open(os.path.join(d, PROCESS_JOURNAL), "rb") as f:
        assert len(f.read().splitlines()) == 2       # compacted on load
    again.close()
