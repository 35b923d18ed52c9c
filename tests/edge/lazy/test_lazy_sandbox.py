"""Real container sandboxes on lazily loaded layers, and the faults of issue 17: a blob
store outage (EIO inside, an event naming the cause, nothing partial served, the rest of
the node unaffected) and a kill -9 of the FUSE daemon (clean failure, no D-state process,
restart and re-adoption)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.ids import SandboxId
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.conftest import requires_root
from tests.edge.container.conftest import _cleanup, new_sid
from tests.edge.lazy.conftest import Node, Remote

pytestmark = requires_root

Notices = list[tuple[str, str, str]]


@pytest.fixture
async def lazy_backend(node: Node, tmp_path: object) -> AsyncIterator[
        tuple[ContainerBackend, Notices]]:
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"), images=node.images)
    notices: Notices = []
    b.watch(lambda sid, reason, detail: notices.append((sid, reason, detail)))
    loop = asyncio.get_running_loop()
    node.lazy.on_event = lambda ev: loop.call_soon_threadsafe(b.lazy_event, ev)
    try:
        yield b, notices
    finally:
        node.lazy.on_event = None
        await _cleanup(b)


def spec_of(remote: Remote) -> SandboxSpec:
    return SandboxSpec(backend="container", memory_bytes=256 << 20, pids_max=256,
                       image=remote.base.digest, workspace=remote.workspace.digest,
                       toolkits=(remote.toolkit.digest,))


async def sh(b: ContainerBackend, sid: SandboxId, cmd: str, timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
    return await b.exec(sid, ExecRequest(shell=cmd, timeout_s=timeout_s))


def d_state_in(sid: str) -> list[int]:
    """Processes of sandbox ``sid`` (by cgroup) in uninterruptible sleep."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cgroup") as f:
                if sid not in f.read():
                    continue
            with open(f"/proc/{p}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "D":
            out.append(int(p))
    return out


async def test_sandbox_runs_a_command_reading_several_remote_layers(
        lazy_backend: tuple[ContainerBackend, Notices], node: Node, remote: Remote) -> None:
    b, _ = lazy_backend
    sid = new_sid()
    await b.create(sid, spec_of(remote))
    r = await sh(b, sid, "cat /opt/tool /work/readme && md5sum /work/big && ls /bin/busybox")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.startswith(b"toolkit layer\nworkspace layer\n")
    assert hashlib.md5(remote.big).hexdigest().encode() in r.stdout
    for m in (remote.base, remote.workspace, remote.toolkit):
        assert not os.path.exists(node.store.layer_path(m))   # nothing pulled whole


async def test_blob_outage_fails_reads_with_eio_and_an_event(
        lazy_backend: tuple[ContainerBackend, Notices], node: Node, remote: Remote) -> None:
    b, notices = lazy_backend
    a, other = new_sid(), new_sid()
    await b.create(a, spec_of(remote))
    await b.create(other, spec_of(remote))
    assert (await sh(b, a, "cat /work/readme")).exit_code == 0
    os.rename(remote.blob_dir, remote.blob_dir + ".away")        # the store is gone
    try:
        t0 = time.monotonic()
        r = await sh(b, a, "cat /work/big > /dev/null")
        took = time.monotonic() - t0
        assert r.exit_code != 0 and b"Input/output error" in r.stderr, r
        assert took < 15, f"the read hung {took:.1f}s past the 1 s retry budget"
        for _ in range(50):
            if any(s == a and why == "layer_unavailable" for s, why, _ in notices):
                break
            await asyncio.sleep(0.1)
        hits = [d for s, why, d in notices if s == a and why == "layer_unavailable"]
        assert hits and remote.workspace.digest in hits[0] and "retry budget" in hits[0]
        # the node and the other sandbox keep working on what is cached
        r2 = await sh(b, other, "cat /work/readme /opt/tool")
        assert r2.exit_code == 0 and b"workspace layer" in r2.stdout
        assert node.lazy.alive()
        st = node.lazy.stats(fresh=True)
        assert st["failed_reads"] > 0 and st["retries"] > 0
    finally:
        os.rename(remote.blob_dir + ".away", remote.blob_dir)
    # back: the same read now succeeds with the exact bytes (nothing partial was kept)
    r = await sh(b, a, "md5sum /work/big")
    assert r.exit_code == 0 and hashlib.md5(remote.big).hexdigest().encode() in r.stdout


async def test_kill_9_of_the_daemon_fails_cleanly_and_restarts(
        lazy_backend: tuple[ContainerBackend, Notices], node: Node, remote: Remote) -> None:
    b, notices = lazy_backend
    old = new_sid()
    await b.create(old, spec_of(remote))
    assert (await sh(b, old, "cat /work/readme")).exit_code == 0
    pid = node.lazy.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        if node.lazy.restarts == 1 and node.lazy.alive():
            break
        await asyncio.sleep(0.1)
    assert node.lazy.restarts == 1 and node.lazy.pid != pid
    # the old sandbox: a read of a page it never had fails at once, nothing hangs
    r = await sh(b, old, "cat /work/big > /dev/null", timeout_s=20)
    assert not r.timed_out and r.exit_code != 0, r
    assert d_state_in(old) == []
    await asyncio.sleep(0.2)
    assert any(s == old and why == "layer_unavailable" and "restarted" in d
               for s, why, d in notices)
    # a new sandbox of the same image reads everything through the new daemon
    new = new_sid()
    await b.create(new, spec_of(remote))
    r = await sh(b, new, "md5sum /work/big && cat /opt/tool")
    assert r.exit_code == 0, r.stderr
    assert hashlib.md5(remote.big).hexdigest().encode() in r.stdout
    assert b"toolkit layer" in r.stdout
