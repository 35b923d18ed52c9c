"""Red team B of issue 21 (red21b): the E2B layer's container cluster: the fixtures of
tests/e2b (session-scoped), in a directory of their own (red21a has the conftest above)."""

from __future__ import annotations

from tests.e2b.conftest import e2b_cluster, e2b_target  # noqa: F401  (pytest fixtures)
