"""Fixtures for the gvisor tier: the container suite's busybox image and a ContainerBackend
with runtime runsc (the "gvisor" backend), cleaned up like the container suite's.

Here the ``backend`` fixture IS the gvisor backend: test modules in this directory
import chosen tests of tests/edge/container and run their bodies unchanged on this tier
(the behaviour a user relies on must hold whatever the isolation).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends import make_backend
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from tests.edge.container.conftest import _cleanup, images_dir  # noqa: F401

pytestmark = pytest.mark.root


def runsc_missing() -> str | None:
    """Why the gvisor tier cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (CI runs as root)"
    if shutil.which("runsc") is None:
        return "needs runsc (make setup installs Debian's runsc)"
    return None


@pytest.fixture
async def backend(tmp_path: object, images_dir: str) -> AsyncIterator[ContainerBackend]:  # noqa: F811
    why = runsc_missing()
    if why:
        pytest.skip(why)
    b = make_backend("gvisor", root_dir=os.path.join(str(tmp_path), "groot"),
                     images=DirectoryImages(images_dir))
    assert isinstance(b, ContainerBackend)
    try:
        yield b
    finally:
        await _cleanup(b)
        _rmdir_everywhere(f"dsec-{b.cgroup_name}")


def _rmdir_everywhere(name: str) -> None:
    """rmdir the (empty) ``dsec-<name>`` parents runsc makes in controllers the governor
    does not manage (blkio, cpuset, devices, name=systemd)."""
    for top in os.listdir("/sys/fs/cgroup"):
        for dirpath, dirnames, _ in os.walk(os.path.join("/sys/fs/cgroup", top)):
            if dirpath.count("/") > 8:
                dirnames[:] = []
                continue
            if name in dirnames:
                try:
                    os.rmdir(os.path.join(dirpath, name))
                except OSError:
                    pass
                dirnames.remove(name)
