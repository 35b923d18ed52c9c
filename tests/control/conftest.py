"""Fixtures for the control-plane tests: a real state store, SQLite in a temp dir and
PostgreSQL (a fresh database on the session's throwaway server: ``pg_dsn``) for every
test that takes ``store``/``store_url`` (parametrized ``[sqlite]``/``[postgresql]``); apiserver
replicas over one store (:func:`replica`, wired by :func:`dsec.cluster.compose.api_service`
as every apiserver is) reaching a real edge served over Aether (:func:`served_edge`)."""

from __future__ import annotations

import contextlib
import itertools
import os
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


# --- both stores (issue 16: the whole control-plane suite runs against both). Every test
# that touches a state store takes ``store_kind`` (through ``store_url``/``store`` or
# ``cluster_store``/``module_cluster_store`` for a LocalCluster), so it runs once per kind
# (``[sqlite]``/``[postgresql]``). PostgreSQL databases are cloned from a template that
# already holds the schema: one PostgreSQL server per session (tests/conftest.py), a fresh
# database per test or per module (CREATE DATABASE ... TEMPLATE: a file copy, no DDL).
STORE_KINDS = ("sqlite", "postgresql")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "store_kinds(*kinds): run a test that takes a store on these kinds only: "
        "for a test whose subject is not the store (the HTTP schema, a listener, a loop "
        "stall) and that costs seconds per run")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that takes ``store_kind`` (directly or through a fixture) runs once per
    kind, or on the kinds its ``store_kinds`` mark names."""
    if "store_kind" in metafunc.fixturenames:
        mark = metafunc.definition.get_closest_marker("store_kinds")
        metafunc.parametrize("store_kind", mark.args if mark else STORE_KINDS, indirect=True,
                             scope="module")


@pytest.fixture(scope="module")
def store_kind(request: pytest.FixtureRequest) -> str:
    """Which state store the test runs against; module-scoped so a module's tests are
    grouped by kind and module-scoped clusters start once per kind."""
    return str(request.param)


@pytest.fixture(scope="session")
def pg_template(pg_server: Any) -> str:
    """The name of a database on the session's server holding dsec's schema, the template
    every test database is cloned from."""
    import psycopg

    name = f"dsec_tpl_{os.getpid()}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.execute(f"CREATE DATABASE {name} TEMPLATE template0")
    open_store(pg_server.dsn_for(name)).close()   # the schema, once
    return name


@contextlib.contextmanager
def pg_database(server: Any, template: str) -> Iterator[str]:
    """A new database cloned from ``template``: its URL; dropped after the block (with
    every connection to it; a server a fault test stopped takes it with its dir)."""
    import psycopg

    name = f"t{os.getpid()}_{next(_pg_ids)}"
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template}")
    try:
        yield server.dsn_for(name)
    finally:
        try:
            with psycopg.connect(server.dsn, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        except psycopg.Error:
            pass


_pg_ids = itertools.count()


def _kind_store(request: pytest.FixtureRequest, kind: str) -> Iterator[str | None]:
    if kind != "postgresql":
        yield None
        return
    server = request.getfixturevalue("pg_server")
    with pg_database(server, request.getfixturevalue("pg_template")) as url:
        yield url


@pytest.fixture
def store_url(store_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of an empty state store of ``store_kind``
    (:func:`dsec.control.store.open_store`)."""
    for url in _kind_store(request, store_kind):
        yield url or f"sqlite://{tmp_path / 'state.db'}"


@pytest.fixture
def cluster_store(store_kind: str, request: pytest.FixtureRequest) -> Iterator[str | None]:
    """``LocalCluster(store=...)`` for ``store_kind``: None (SQLite in the cluster's state
    dir, the default) or a fresh PostgreSQL database."""
    yield from _kind_store(request, store_kind)


@pytest.fixture(scope="module")
def module_cluster_store(store_kind: str, request: pytest.FixtureRequest) -> Iterator[str | None]:
    """:func:`cluster_store` for a module-scoped cluster."""
    yield from _kind_store(request, store_kind)


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
