"""``file_watch`` takes one inotify *instance* of the edge process per watch
(``inotify_init1`` in ``edge/filestream.py``), bounded only per sandbox
(``MAX_WATCHES_PER_SANDBOX`` = 8). inotify instances are a per-uid resource of the host
(``fs.inotify.max_user_instances``, 128 by default) which the edge (root) shares with
every root process on the host: one member key with 16 sandboxes x 8 watches takes all
of them, after which every other tenant's ``file_watch`` (and E2B ``watch_dir``) on that
node fails with "inotify_init1: Too many open files", and so does every other root
daemon on the host that uses inotify (systemd, udev, other edges). The recursive watch's
``MAX_WATCH_DIRS`` (4,096 watches each) does the same to ``max_user_watches``.

A contained check (it never takes more than 40 of the host's instances, for a moment):
one project's watches on one node must be refused well before they could take the
host's whole budget - at most a quarter of ``max_user_instances`` here."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.errors import DsecError
from dsec.wire.files import FileEvent, Watch
from dsec.wire.spec import SandboxSpec
from tests.edge.container.conftest import _cleanup

pytestmark = pytest.mark.root


@pytest.fixture
async def node(tmp_path: object, images_dir: str) -> AsyncIterator[EdgeNode]:
    if os.geteuid() != 0:
        pytest.fail("needs root (CI runs as root)")
    backend = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                               images=DirectoryImages(images_dir))
    cfg = NodeConfig(node_id="r19w", capacity=Capacity(cpu_milli=64_000,
                                                       memory_bytes=64 << 30,
                                                       max_sandboxes=8))
    n = EdgeNode(cfg, backend)
    await n.start()
    try:
        yield n
    finally:
        await n.close()
        await _cleanup(backend)


def _instances() -> int:
    with open("/proc/sys/fs/inotify/max_user_instances") as f:
        return int(f.read())


async def test_one_tenant_cannot_take_the_hosts_inotify_instances(node: EdgeNode) -> None:
    share = _instances() // 4
    tries = min(share + 8, 40)
    spec = SandboxSpec(backend="container", project="acme", memory_bytes=128 << 20)
    sids = [(await node.create(spec)).id for _ in range((tries + 7) // 8)]

    async def send(ev: FileEvent) -> None:
        return None

    tasks: list[asyncio.Task[str]] = []
    opened = 0
    try:
        for i in range(tries):
            t = asyncio.ensure_future(node.file_watch(Watch(id=sids[i // 8], path="/tmp"),
                                                      send))
            await asyncio.sleep(0.05)
            if t.done():
                with contextlib.suppress(DsecError):
                    t.result()
                break                      # refused: the bound this test wants
            tasks.append(t)
            opened += 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert opened <= share, (
        f"one project held {opened} file watches (inotify instances of the edge, a "
        f"host-wide per-uid budget of {_instances()}) on one node; nothing bounds them "
        "but 8 per sandbox")
