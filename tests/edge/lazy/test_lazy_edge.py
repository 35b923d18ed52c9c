"""``dsec edge --blob-store URL`` with an empty layer store starts a sandbox from an image
that exists only in the blob store and runs a real command reading files from its three
layers; its metrics show the chunk path; a stop leaves no FUSE mount or daemon."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import subprocess
import sys

import httpx
import msgspec
import pytest

from dsec.edge.backends.container.linux import MNT_DETACH, umount2
from dsec.edge.service import EdgeClient
from dsec.errors import ImageNotFound
from dsec.wire import ops
from dsec.wire.layers import LayerGrant
from dsec.wire.spec import SandboxSpec
from tests.conftest import requires_root
from tests.edge.lazy.conftest import Remote, fuse_mounts

pytestmark = requires_root

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _edge(remote: Remote, tmp: str, sock: str, port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*DSEC, "edge", "--listen", f"unix:{sock}", "--state-dir", os.path.join(tmp, "s"),
         "--layer-store", os.path.join(tmp, "layers"), "--backend", "container",
         "--node-id", "lazy-node", "--blob-store", remote.url, "--lazy-cache-bytes", "64MiB",
         "--metrics-listen", f"127.0.0.1:{port}", "--metrics-public", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def _listening(proc: subprocess.Popen[bytes], sock: str) -> None:
    for _ in range(1000):
        assert proc.poll() is None, proc.stderr.read().decode()  # type: ignore[union-attr]
        if os.path.exists(sock):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("dsec edge did not listen")


async def _grant(c: EdgeClient, remote: Remote) -> None:
    """What the control plane sends before a create on a lazy node: the pushed layers'
    manifests (``layer_grant``); the node never reads them from the blob store."""
    got = await c.call(ops.LAYER_GRANT, LayerGrant(
        manifests=[msgspec.json.encode(m) for m in remote.manifests]))
    assert got.digests == [m.digest for m in remote.manifests]


def _stop(proc: subprocess.Popen[bytes], tmp: str) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for sub in ("pool", "scratch"):   # (+ the shared scratch tmpfs, issue 22)
        pool = os.path.join(tmp, "s", "container", sub)
        if os.path.ismount(pool):
            umount2(pool, MNT_DETACH)


@pytest.mark.serial  # compares the host's fuse.dsec mounts before/after: another test's edge beside it adds some
async def test_edge_starts_a_sandbox_from_the_blob_store(remote: Remote, tmp_path: object) -> None:
    tmp = str(tmp_path)
    sock, port = os.path.join(tmp, "edge.sock"), _port()
    before = set(fuse_mounts())
    proc = _edge(remote, tmp, sock, port)
    try:
        await _listening(proc, sock)
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            spec = SandboxSpec(
                backend="container", memory_bytes=256 << 20, image=remote.base.digest,
                workspace=remote.workspace.digest, toolkits=(remote.toolkit.digest,))
            # every create door of the edge refuses a layer the control plane did not
            # grant (red team 17 F1): nothing read from the store's .manifest
            with pytest.raises(ImageNotFound, match="granted no manifest"):
                await c.create(spec)
            (one,) = await c.create_many([spec])
            assert isinstance(one, ImageNotFound), one
            assert os.listdir(os.path.join(tmp, "layers", "manifests")) == []
            await _grant(c, remote)
            sb = await c.create(spec)
            r = await c.exec(sb.id, "cat /opt/tool /work/readme && busybox | head -1")
            assert r.exit_code == 0, r.stderr
            assert r.stdout.startswith(b"toolkit layer\nworkspace layer\nBusyBox")
            # nothing was pulled whole: the node's store holds manifests only
            assert os.listdir(os.path.join(tmp, "layers", "layers")) == []
            fetched = 0.0
            async with httpx.AsyncClient() as http:
                for _ in range(50):     # the daemon writes its stats every 0.5 s
                    text = (await http.get(f"http://127.0.0.1:{port}/metrics",
                                           timeout=10)).text
                    fetched = float(next(ln for ln in text.splitlines() if ln.startswith(
                        "dsec_lazy_bytes_fetched_total ")).split()[1])
                    if fetched > 0:
                        break
                    await asyncio.sleep(0.2)
            assert fetched > 0
            assert "dsec_lazy_fetch_seconds_bucket" in text
            await c.destroy(sb.id)
    finally:
        _stop(proc, tmp)
    assert proc.returncode == 0
    assert set(fuse_mounts()) <= before          # its FUSE mount went with it


@pytest.mark.serial  # compares the host's fuse.dsec mounts before/after: another test's edge beside it adds some
async def test_edge_kill_9_adopted_sandbox_is_told_and_fails_cleanly(
        remote: Remote, tmp_path: object) -> None:
    """kill -9 of the edge takes its FUSE daemon with it (EOF on its stdin): the next
    edge adopts the sandbox, which gets a layer_unavailable event; its uncached reads
    fail with EIO instead of hanging; new sandboxes read through the new daemon."""
    tmp = str(tmp_path)
    sock, port = os.path.join(tmp, "edge.sock"), _port()
    before = set(fuse_mounts())
    spec = SandboxSpec(backend="container", memory_bytes=256 << 20, image=remote.base.digest,
                       workspace=remote.workspace.digest)
    proc = _edge(remote, tmp, sock, port)
    try:
        await _listening(proc, sock)
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            await _grant(c, remote)
            old = await c.create(spec)
            assert (await c.exec(old.id, "cat /work/readme")).exit_code == 0
        proc.kill()
        proc.wait()
        os.unlink(sock)
        proc = _edge(remote, tmp, sock, port)
        await _listening(proc, sock)
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            assert (await c.get(old.id)).state == "running"
            evs = await c.events(old.id)
            assert any(e.reason == "layer_unavailable" and "adopted" in e.detail for e in evs)
            r = await c.exec(old.id, "cat /work/big > /dev/null", timeout_s=30)
            assert not r.timed_out and r.exit_code != 0, r
            new = await c.create(spec)
            r = await c.exec(new.id, "md5sum /work/big")
            assert r.exit_code == 0 and hashlib.md5(remote.big).hexdigest().encode() in r.stdout
            await c.destroy(old.id)
            await c.destroy(new.id)
    finally:
        _stop(proc, tmp)
    assert set(fuse_mounts()) <= before
