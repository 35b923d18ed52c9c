"""Red team 25 (BE CPU suppression): shared fixtures."""

from __future__ import annotations

from tests.security.conftest import images_dir, probe_binary  # noqa: F401  (pytest fixtures)
