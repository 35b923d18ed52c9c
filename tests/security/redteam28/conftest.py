"""Red team 28 (attacks on dsec.mountshed and the F_IPCCAPS member caps): shared
fixtures and helpers."""

from __future__ import annotations

from tests.security.conftest import images_dir, probe_binary  # noqa: F401  (pytest fixtures)
from tests.security.redteam27.conftest import (  # noqa: F401  (pytest fixtures)
    MIB,
    grouped,
    hog_images,
    spec,
)
