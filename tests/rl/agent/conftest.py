"""The scripted OpenAI-compatible endpoint on loopback, one per test session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsec.rl.agent.scripted import ScriptedEndpoint


@pytest.fixture(scope="session")
def endpoint() -> Iterator[ScriptedEndpoint]:
    with ScriptedEndpoint(think_s=0.05) as ep:
        yield ep
