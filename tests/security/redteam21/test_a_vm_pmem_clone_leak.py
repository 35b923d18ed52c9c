"""A7 (red21a): with the density options (the vm tier's layers on virtio-pmem, the
default of ``DensityOptions``), every layer whose size is not a multiple of 2 MiB - nearly
all, snapshot layers included - is copied (a reflink only where the filesystem has them;
a full copy on ext4/xfs without reflink) into ``<root_dir>/pmem/`` the first time a VM
uses it. Nothing ever removes those copies: not the last VM's destroy, not reconcile,
not the layer's deletion from the store. A tenant's deleted snapshot stays readable on
the host's disk (0444) and the disk fills with one copy per layer ever run on the tier,
outside the layer store's accounting and GC.

The copy is made here exactly as VmBackend._launch makes it; the check is after the
layer is gone and the backend reconciled with no sandbox left.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest

from dsec.edge.backends.container import DirectoryImages
from dsec.edge.backends.vm.backend import VmBackend
from dsec.edge.backends.vm.density import DensityOptions, prepare_pmem_layer

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups)")]


async def test_a_pmem_copy_of_a_deleted_layer_does_not_stay_on_disk(tmp_path: Any) -> None:
    d = str(tmp_path)
    os.makedirs(os.path.join(d, "images"))
    layer = os.path.join(d, "snapshot-layer.erofs")
    with open(layer, "wb") as f:  # noqa: ASYNC230
        f.write(b"tenant secret " * 100_000)            # ~1.4 MiB: not 2 MiB aligned
    b = VmBackend(root_dir=os.path.join(d, "vm"), images=DirectoryImages(
        os.path.join(d, "images")), kernel="/nonexistent", initrd="/nonexistent",
        density=DensityOptions())
    try:
        pl = prepare_pmem_layer(layer, os.path.join(b.root_dir, "pmem"))  # as _launch
        assert pl.path != layer and os.path.exists(pl.path)
        os.unlink(layer)                                  # the layer is deleted (store GC)
        await b.reconcile(set())                          # no sandbox uses it any more
        left = os.listdir(os.path.join(b.root_dir, "pmem"))
        assert not left, (f"copies of deleted layers stay in {b.root_dir}/pmem forever: "
                          f"{left}")
    finally:
        await b.close()
        with contextlib.suppress(OSError):
            b.governor.remove_base()
