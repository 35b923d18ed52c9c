"""An edge's sandbox list is read in pages, and what an edge may list is bounded: it is
a network peer, and a hostile one must not make every replica do unbounded work (issue
16). A page longer than the type's bound is refused at its array header (before its
items are decoded); pages out of id order, a list that never ends or one longer than
``max_listed_per_node`` hold the node as answering wrongly (unreachable, its sandboxes
kept), never silent and never written off. Real edge over Aether for the paging; fake
links (the boundary under test) for the hostile ones."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dsec.control.api.plane import ControlPlane, PlaneConfig
from dsec.control.metrics import ApiMetrics
from dsec.control.store.sqlite import SqliteStore
from dsec.edge.client import EdgeClient
from dsec.wire.node import MAX_LIST_PAGE, EventFeed, Heartbeat, Resources, SandboxBrief
from dsec.wire.spec import SandboxSpec
from tests.control.conftest import served_edge


class Pages:
    """The real edge link, recording each heartbeat's page request."""

    def __init__(self, link: EdgeClient) -> None:
        self._link = link
        self.asked: list[tuple[str, int | None]] = []

    async def heartbeat(self, *, include_sandboxes: bool = False, **kw: Any) -> Any:
        if include_sandboxes:
            self.asked.append((kw.get("list_after", ""), kw.get("list_limit")))
        return await self._link.heartbeat(include_sandboxes=include_sandboxes, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._link, name)


async def test_the_list_is_read_in_pages_in_id_order(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "control.sqlite")
    plane = ControlPlane.open(store, metrics=ApiMetrics(), config=PlaneConfig(list_page=7))
    async with served_edge(tmp_path, node="e0") as edge:
        made = sorted([(await edge.node.create(SandboxSpec(backend="simulated"))).id
                       for _ in range(20)])
        link = Pages(await EdgeClient.connect(edge.addr))
        plane.add_edge("e0", edge.addr, link)  # type: ignore[arg-type]
        try:
            await plane.poll_edges()
            assert link.asked == [("", 7), (made[6], 7), (made[13], 7)]
            assert [s.id for s in plane.edges["e0"].live] == made
            assert plane.quarantined("e0") == made      # no records: held aside
            assert {n.id: n.status for n in plane.nodes()} == {"e0": "healthy"}
            # the edge's own page bound: a direct heartbeat never exceeds its limit
            hb = edge.node.heartbeat(list_after=made[17], list_limit=5)
            assert [b.id for b in hb.sandboxes or ()] == made[18:] and not hb.list_more
        finally:
            await plane.close()
            await link.close()
            store.close()


def test_a_page_longer_than_the_bound_is_refused_at_its_header() -> None:
    res = Resources(cpu_milli=1, memory_bytes=1, sandboxes=1)
    big = Heartbeat(node="h", time=1.0, capacity=res, usage=res, counts={}, sandboxes=[
        SandboxBrief(f"sb-{i:012x}-h", "running", "p", 0, 0, 0)
        for i in range(MAX_LIST_PAGE + 1)])
    data = msgspec.msgpack.encode(big)
    with pytest.raises(msgspec.ValidationError, match=f"length <= {MAX_LIST_PAGE}"):
        msgspec.msgpack.decode(data, type=Heartbeat)


class Hostile:
    """An edge that lists pages of its own node's ids as ``pages`` says."""

    def __init__(self, pages: Any) -> None:
        self.pages = pages
        self.calls = 0

    async def heartbeat(self, *, include_sandboxes: bool = False, **kw: Any) -> Heartbeat:
        self.calls += 1
        res = Resources(cpu_milli=1000, memory_bytes=1 << 30, sandboxes=10**9)
        ids, more = self.pages(kw.get("list_after", "")) if include_sandboxes else ([], False)
        return Heartbeat(node="h", time=time.time(), capacity=res, usage=Resources(),
                         counts={}, backends=["simulated"], list_more=more,
                         sandboxes=[SandboxBrief(i, "running", "p", 0, 0, 0) for i in ids]
                         if include_sandboxes else None)

    async def feed(self, after: int = 0, limit: int = 1000, **kw: Any) -> EventFeed:
        return EventFeed(events=[], next=0)

    async def close(self) -> None:
        return None


def _endless(after: str) -> tuple[list[str], bool]:
    n = int(after[3:15], 16) + 1 if after else 0
    return [f"sb-{n + i:012x}-h" for i in range(5)], True


def _unordered(after: str) -> tuple[list[str], bool]:
    return ["sb-000000000002-h", "sb-000000000001-h"], False


def _stuck(after: str) -> tuple[list[str], bool]:
    return ([] if after else ["sb-000000000001-h"]), True


@pytest.mark.parametrize(("pages", "problem"), [
    (_endless, "lists more than 40 sandboxes"),
    (_unordered, "ascending id order"),
    (_stuck, "listed none"),
])
async def test_a_hostile_list_holds_the_node_after_bounded_work(
        tmp_path: Path, pages: Any, problem: str) -> None:
    store = SqliteStore(tmp_path / "control.sqlite")
    plane = ControlPlane.open(store, metrics=ApiMetrics(),
                              config=PlaneConfig(list_page=5, max_listed_per_node=40))
    link = Hostile(pages)
    plane.add_edge("h", "unix:/nonexistent", link)  # type: ignore[arg-type]
    try:
        await plane.poll_edges()
        assert link.calls <= 40 // 5 + 1          # bounded, whatever the edge says
        view = {n.id: n for n in plane.nodes()}["h"]
        assert view.status == "unreachable" and problem in view.problem
        assert plane.quarantined() == [] and len(plane.registry) == 0
        assert not plane.watcher.is_expired("h")
    finally:
        await plane.close()
        store.close()
