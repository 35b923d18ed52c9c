"""C1: one tenant's recursive file watches take the node's whole inotify *directory*
budget; every other tenant's ``file_watch`` (E2B ``watch_dir``, streaming ``WatchDir``,
``CreateWatcher``) on that node is then refused.

The edge bounds watches (``watch_budget()``: max_user_instances / 2, 64 here) with a
per-project half (``EdgeNode._admit_watch``), but the directories those watches follow
(``_Hub.add``: ``watch_dir_budget()``, max_user_watches / 2 = 96,268 on this box) have
no per-project share: one project may hold 32 watches x ``MAX_WATCH_DIRS`` (4,096) =
131,072 directories > the node's whole budget (a sandbox making 96k empty directories
takes seconds; a recursive watch also adds every directory created below it later, so
the tree can grow after the watch). Past it every other tenant's watch fails with
"the node's file watches follow N directories, its budget ...; retry later".

The test keeps it small: the node's directory budget patched to 6 (the arithmetic above
is the same at any size): project ``acme`` watches a tree of 6 directories, then project
``other`` watches one directory of its own sandbox. The secure behaviour: ``other``'s
watch opens (one project holds at most a share of the node's directory budget)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import pytest

from dsec.edge import filestream
from dsec.edge.admission import Capacity
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.errors import ResourceExhausted
from dsec.wire.files import FileEvent, Watch
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.container.conftest import _cleanup

pytestmark = pytest.mark.root

BUDGET = 6


@pytest.fixture
async def node(tmp_path: object, images_dir: str) -> AsyncIterator[EdgeNode]:
    if os.geteuid() != 0:
        pytest.fail("needs root (CI runs as root)")
    backend = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                               images=DirectoryImages(images_dir))
    cfg = NodeConfig(node_id="r22c", capacity=Capacity(cpu_milli=64_000,
                                                       memory_bytes=64 << 30,
                                                       max_sandboxes=4))
    n = EdgeNode(cfg, backend)
    await n.start()
    try:
        yield n
    finally:
        await n.close()
        await _cleanup(backend)


async def _opened(t: asyncio.Task[str]) -> bool:
    """Whether watch task ``t`` is still open after a moment (a refused one ended)."""
    await asyncio.sleep(0.3)
    return not t.done()


async def test_one_project_cannot_take_the_nodes_watch_directories(
        node: EdgeNode, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(filestream, "watch_dir_budget", lambda: BUDGET)
    a = (await node.create(SandboxSpec(backend="container", project="acme",
                                       memory_bytes=128 << 20))).id
    b = (await node.create(SandboxSpec(backend="container", project="other",
                                       memory_bytes=128 << 20))).id
    # acme: a tree of BUDGET directories (the real attack: ~24 such trees of 4,096)
    mk = "mkdir -p /tmp/w/1 /tmp/w/2 /tmp/w/3 /tmp/w/4 /tmp/w/5"
    r = await node.exec(a, ExecRequest(argv=("sh", "-c", mk)))
    assert r.exit_code == 0, r

    async def send(ev: FileEvent) -> None:
        return None

    ta = asyncio.ensure_future(node.file_watch(Watch(id=a, path="/tmp/w", recursive=True),
                                               send))
    tb: asyncio.Task[str] | None = None
    try:
        assert await _opened(ta), "acme's watch of its own 6 directories did not open"
        tb = asyncio.ensure_future(node.file_watch(Watch(id=b, path="/tmp"), send))
        if not await _opened(tb):
            exc = tb.exception()
            assert not isinstance(exc, ResourceExhausted), (
                "project acme's one recursive watch took the node's whole inotify "
                "directory budget; project other's watch of one directory was refused: "
                f"{exc}")
            raise AssertionError(f"other's watch ended: {exc or tb.result()}")
    finally:
        for t in (ta, tb):
            if t is not None:
                t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*(t for t in (ta, tb) if t is not None),
                                 return_exceptions=True)


async def test_the_project_over_its_share_is_told_its_watch_is_incomplete(
        node: EdgeNode, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side of the fix: the directories ``other`` needs come from acme's
    watch, which says so (an ``incomplete`` event, never silently), goes on, and
    follows no directory created later while the node's budget is full."""
    monkeypatch.setattr(filestream, "watch_dir_budget", lambda: BUDGET)
    a = (await node.create(SandboxSpec(backend="container", project="acme",
                                       memory_bytes=128 << 20))).id
    b = (await node.create(SandboxSpec(backend="container", project="other",
                                       memory_bytes=128 << 20))).id
    mk = "mkdir -p /tmp/w/1 /tmp/w/2 /tmp/w/3 /tmp/w/4 /tmp/w/5"
    assert (await node.exec(a, ExecRequest(argv=("sh", "-c", mk)))).exit_code == 0
    assert (await node.exec(b, ExecRequest(argv=("mkdir", "-p", "/tmp/o/1")))
            ).exit_code == 0
    got_a: list[FileEvent] = []
    got_b: list[FileEvent] = []

    async def send_a(ev: FileEvent) -> None:
        got_a.append(ev)

    async def send_b(ev: FileEvent) -> None:
        got_b.append(ev)

    ta = asyncio.ensure_future(node.file_watch(Watch(id=a, path="/tmp/w", recursive=True),
                                               send_a))
    tb: asyncio.Task[str] | None = None
    try:
        assert await _opened(ta)
        assert not got_a, got_a         # alone, acme may follow the whole budget
        tb = asyncio.ensure_future(node.file_watch(
            Watch(id=b, path="/tmp/o", recursive=True), send_b))
        assert await _opened(tb), tb.exception()
        lost = [e for e in got_a if e.type == "incomplete"]
        assert len(lost) == 2, got_a    # other's 2 directories came from acme's 6
        assert all(e.path.startswith("/tmp/w/") for e in lost), lost
        assert not [e for e in got_b if e.type == "incomplete"], got_b
        # acme (at its share, the budget full) grows its tree: told, not followed
        assert (await node.exec(a, ExecRequest(argv=("mkdir", "/tmp/w/6")))).exit_code == 0
        await asyncio.sleep(0.3)
        assert any(e.type == "create" and e.path == "/tmp/w/6" for e in got_a), got_a
        assert any(e.type == "incomplete" and e.path == "/tmp/w/6" for e in got_a), got_a
        assert not ta.done() and not tb.done()
        # other, within its share, still grows its own tree
        assert (await node.exec(b, ExecRequest(argv=("mkdir", "/tmp/o/2")))).exit_code == 0
        await asyncio.sleep(0.3)
        assert any(e.type == "create" and e.path == "/tmp/o/2" for e in got_b), got_b
        assert not [e for e in got_b if e.type == "incomplete"], got_b
    finally:
        for t in (ta, tb):
            if t is not None:
                t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*(t for t in (ta, tb) if t is not None),
                                 return_exceptions=True)
