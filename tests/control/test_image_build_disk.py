"""An image build whose layer store's filesystem fills up is a capacity refusal, not a
bad upload (red team 16 F9's class, at the apiserver's builds): the real ImageAdmin
over a real layer store on a small tmpfs this test mounts (and unmounts)."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from dsec.control.api.images import ImageAdmin
from dsec.control.api.service import Caller
from dsec.errors import CapacityExceeded
from tests.security.redteam15.test_pull_names import _Charges

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

ROOT = Caller(id="k-root", name="root", roles={}, default_project="default",
              superuser=True)


def test_a_build_that_fills_the_store_is_capacity_exceeded(tmp_path: Path) -> None:
    small = tmp_path / "fs"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "dsec-t-build",
                    str(small)], check=True)
    try:
        admin = ImageAdmin(_Charges(), layer_dir=str(small / "layers"))
        tar_path = tmp_path / "up.tar"
        with tarfile.open(tar_path, "w") as tar:
            data = os.urandom(20 << 20)      # incompressible: stage + layer > 24 MiB
            info = tarfile.TarInfo("opt/blob")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        with pytest.raises(CapacityExceeded, match="is full"):
            asyncio.run(admin.build_image(ROOT, str(tar_path), name="big", kind="toolkit",
                                          tag="latest", oci=False))
        assert "big:latest" not in admin._layers().refs()
        assert os.listdir(small / "layers" / "tmp") == []      # no partial layer or stage
        assert admin._layers().manifests() == []
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
