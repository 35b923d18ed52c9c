"""Issue 22: the container backend reports its QoS pinning for node info
(tests/edge/test_qos_policy_info.py has the rest)."""

from __future__ import annotations

import os

import pytest


@pytest.mark.root
async def test_container_backend_reports_its_pinning(tmp_path: object, images_dir: str) -> None:
    from dsec.edge.backends.container import ContainerBackend, DirectoryImages
    from tests.edge.container.conftest import _cleanup

    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "r"),
                         images=DirectoryImages(images_dir), qos_cpus="be=0")
    try:
        assert b.qos_policy() == {"cpus.be": "0"}
    finally:
        await _cleanup(b)
