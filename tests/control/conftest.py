"""Fixtures for the control-plane tests: a real state store, SQLite in a temp dir and
PostgreSQL (a fresh database on the session's throwaway server: ``pg_dsn``) for every
test that takes ``store``/``store_url`` (parametrized ``[sqlite]``/``[postgresql]``); apiserver
replicas over one store (:func:`replica`, wired by :func:`dsec.cluster.compose.api_service`
as every apiserver is) reaching a real edge served over Aether (:func:`served_edge`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsec.aether import Server
from dsec.cluster.compose import api_service
from dsec.control.api.plane import ControlPlane, PlaneConfig
from dsec.control.api.service import ApiService
from dsec.control.idempotency import IdempotencyCache
from dsec.control.metrics import ApiMetrics
from dsec.control.store import StateStore, open_store
from dsec.edge.admission import Capacity
from dsec.edge.backend import Backend
from dsec.edge.backends import make_backend
from dsec.edge.client import EdgeClient
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.edge.service import serve_edge


class FakeClock:
    """A settable clock injected into the objects under test."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "state.db"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty state store, once per kind: every control-plane test that
    takes it (or ``store``) runs against both (:func:`dsec.control.store.open_store`)."""
    if request.param == "postgresql":
        return str(request.getfixturevalue("pg_dsn"))
    return f"sqlite://{tmp_path / 'state.db'}"


@pytest.fixture
def store(store_url: str) -> Iterator[StateStore]:
    s = open_store(store_url)
    try:
        yield s
    finally:
        s.close()


# ------------------------------------------------------- apiserver replicas over Aether
@dataclass
class Replica:
    """One apiserver replica (its own store connection, control plane, service and edge
    link) over a store file shared with the others."""

    store: StateStore
    plane: ControlPlane
    service: ApiService
    link: EdgeClient

    @property
    def cache(self) -> IdempotencyCache:
        return self.service.idempotency

    async def close(self) -> None:
        await self.cache.close()
        await self.plane.close()
        await self.link.close()
        self.store.close()


async def replica(db: Path | str, addr: str, *, node: str = "e0",
                  plane: PlaneConfig | None = None, **service: Any) -> Replica:
    """A replica over the store at ``db`` (a SQLite path or any store URL) reaching edge
    ``node`` at ``addr``, wired as every apiserver is
    (:func:`dsec.cluster.compose.api_service`; ``service``: its options), with the edge
    polled once. The caller closes it."""
    store = open_store(str(db))
    p = ControlPlane.open(store, metrics=ApiMetrics(), config=plane)
    link = await EdgeClient.connect(addr)
    p.add_edge(node, addr, link)
    svc = api_service(store, p, **service)
    await p.poll_edges()
    return Replica(store, p, svc, link)


@dataclass
class ServedEdge:
    node: EdgeNode
    addr: str
    server: Server     # close() it to take the edge off the network mid-test


@contextlib.asynccontextmanager
async def served_edge(tmp: Path, backend: Backend | None = None, *, node: str = "e0",
                      max_sandboxes: int = 1000) -> AsyncIterator[ServedEdge]:
    """A real edge (simulated backend unless given) served over Aether on a Unix socket
    in ``tmp``; closed after the block."""
    edge = EdgeNode(NodeConfig(node_id=node, capacity=Capacity(
        cpu_milli=10**6, memory_bytes=1 << 40, max_sandboxes=max_sandboxes)),
        {"simulated": backend or make_backend("simulated")})
    await edge.start()
    addr = f"unix:{tmp / f'{node}.sock'}"
    server = await serve_edge(edge, addr)
    try:
        yield ServedEdge(edge, addr, server)
    finally:
        await server.close()
        await edge.close()
