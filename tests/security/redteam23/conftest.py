"""Red team 23 (session 2026-12-02 night): shared fixtures."""

from __future__ import annotations

from tests.security.conftest import images_dir, probe_binary  # noqa: F401  (pytest fixtures)
