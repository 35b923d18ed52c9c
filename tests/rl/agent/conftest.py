"""Shared fixtures: the scripted OpenAI-compatible endpoint on loopback and one container
LocalCluster (real sandboxes through the SDK), each started once per session."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest

from dsec import AsyncClient, LocalCluster
from dsec.rl.agent.scripted import ScriptedEndpoint


@pytest.fixture(scope="session")
def endpoint() -> Iterator[ScriptedEndpoint]:
    with ScriptedEndpoint(think_s=0.05) as ep:
        yield ep


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    with LocalCluster(edges=1, backend="container") as cl:
        yield cl


@pytest.fixture
async def aclient(cluster: LocalCluster) -> AsyncIterator[AsyncClient]:
    c = cluster.async_client()
    try:
        yield c
    finally:
        await c.close()
