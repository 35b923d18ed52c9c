"""Red team 30 (red team 29's fixes to the memory-group lowering deadline): shared
fixtures and helpers."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from tests.edge.container.conftest import _cleanup
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
def hog30_images(hog_images: str) -> Iterator[str]:  # noqa: F811
    """hog_images (image ``hog``) with /bin/hog30 (hog30.c, static) added."""
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc is not None
    out = os.path.join(hog_images, "hog", "bin", "hog30")
    r = subprocess.run([cc, "-static", "-O1", "-o", out, os.path.join(HERE, "hog30.c")],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"hog30.c did not compile: {r.stderr[-2000:]}"
    yield hog_images


@pytest.fixture
async def threes(tmp_path: object, hog30_images: str) -> AsyncIterator[ContainerBackend]:
    """Groups of 3, limits every 0.5 s, a 1 s lowering deadline."""
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(hog30_images), memory_group_size=3,
                         limits_poll_s=0.5, memory_group_grace_s=1.0)
    try:
        yield b
    finally:
        await _cleanup(b)
