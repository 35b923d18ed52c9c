"""Red team 24 (session 2026-12-03): shared fixtures."""

from __future__ import annotations

from tests.security.conftest import images_dir, probe_binary  # noqa: F401  (pytest fixtures)
