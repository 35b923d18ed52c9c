"""Red team B of issue 21 (red21b): the E2B layer's container cluster, shared with
tests/e2b (one session-scoped cluster)."""

from __future__ import annotations

from tests.e2b.conftest import e2b_cluster, e2b_target  # noqa: F401  (pytest fixtures)
