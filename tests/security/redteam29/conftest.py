"""Red team 29 (the memory-group lowering deadline, and red team 28's fixes): shared
fixtures and helpers."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from tests.security.conftest import images_dir, probe_binary  # noqa: F401  (pytest fixtures)
from tests.security.redteam26.conftest import group_file, oom_kills, read  # noqa: F401
from tests.security.redteam27.conftest import (  # noqa: F401  (pytest fixtures)
    MIB,
    grouped,
    hog_images,
    spec,
)

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def hog29_images(hog_images: str) -> Iterator[str]:  # noqa: F811
    """hog_images (image ``hog``) with /bin/hog29 (hog29.c, static) added."""
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc is not None
    out = os.path.join(hog_images, "hog", "bin", "hog29")
    r = subprocess.run([cc, "-static", "-O1", "-o", out, os.path.join(HERE, "hog29.c")],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"hog29.c did not compile: {r.stderr[-2000:]}"
    yield hog_images
