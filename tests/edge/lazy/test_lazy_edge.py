"""``dsec edge --blob-store URL`` with an empty layer store starts a sandbox from an image
that exists only in the blob store and runs a real command reading files from its three
layers; its metrics show the chunk path; a stop leaves no FUSE mount or daemon."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import httpx

from dsec.edge.backends.container.linux import MNT_DETACH, umount2
from dsec.edge.service import EdgeClient
from dsec.wire.spec import SandboxSpec
from tests.conftest import requires_root
from tests.edge.lazy.conftest import Remote, fuse_mounts

pytestmark = requires_root

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_edge_starts_a_sandbox_from_the_blob_store(remote: Remote, tmp_path: object) -> None:
    tmp = str(tmp_path)
    sock, port = os.path.join(tmp, "edge.sock"), _port()
    before = set(fuse_mounts())
    proc = subprocess.Popen(  # noqa: ASYNC220
        [*DSEC, "edge", "--listen", f"unix:{sock}", "--state-dir", os.path.join(tmp, "s"),
         "--layer-store", os.path.join(tmp, "layers"), "--backend", "container",
         "--node-id", "lazy-node", "--blob-store", remote.url, "--lazy-cache-bytes", "64MiB",
         "--metrics-listen", f"127.0.0.1:{port}", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(500):
            assert proc.poll() is None, proc.stderr.read().decode()  # type: ignore[union-attr]
            if os.path.exists(sock):
                break
            await asyncio.sleep(0.02)
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            sb = await c.create(SandboxSpec(
                backend="container", memory_bytes=256 << 20, image=remote.base.digest,
                workspace=remote.workspace.digest, toolkits=(remote.toolkit.digest,)))
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
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        pool = os.path.join(tmp, "s", "container", "pool")
        if os.path.ismount(pool):
            umount2(pool, MNT_DETACH)
    assert proc.returncode == 0
    assert set(fuse_mounts()) <= before          # its FUSE mount went with it
