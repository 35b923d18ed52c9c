"""Fixtures for the control-plane tests: a real SQLite store in a temp dir.

Tests that wire an apiserver's ``ApiService`` by hand (replicas over one store) use
:func:`dsec.cluster.compose.api_service`, the factory every apiserver is built with."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.control.store.sqlite import SqliteStore


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


@pytest.fixture
def store(store_path: Path) -> Iterator[SqliteStore]:
    s = SqliteStore(store_path)
    try:
        yield s
    finally:
        s.close()
