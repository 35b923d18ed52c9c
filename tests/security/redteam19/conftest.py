"""Red team A of issue 19/20 (red19a): a simulated cluster with the E2B layer, shared."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsec import LocalCluster
from tests.edge.container.conftest import images_dir  # noqa: F401  (pytest fixture)


@pytest.fixture(scope="module")
def e2b_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    state = str(tmp_path_factory.mktemp("red19a-e2b"))
    with LocalCluster(backend="simulated", state_dir=state, e2b="127.0.0.1:0") as cl:
        yield cl

