"""A9 (red21a): a vm tenant writing within its own disk cap fills the filesystem that
holds the edge's state.

A vm sandbox's writable disk is a sparse file of ``disk_bytes`` in ``<root_dir>/sb/<sid>/``
on the same filesystem as every other sandbox's disk, their ``vm.json``, paused
sandboxes' ``mem.bin``, the warm-pool templates, the snapshot tars. Nothing is reserved
or admitted at create (the container tier keeps upper layers in a bounded disk pool of
its own): one tenant filling its disk up to its cap takes the host filesystem's last
blocks, and then every other sandbox of the node gets I/O errors on its disk and no
sandbox can be paused (its memory has nowhere to go).

Here: root_dir on a 64 MiB ext4 (loop), one sandbox with a 256 MiB cap writes 80 MiB
(within its cap): afterwards the edge's filesystem must still have room. A create
refused for want of room (CapacityExceeded) is the other acceptable outcome.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import pytest

from dsec.edge.backends.vm.backend import VmBackend
from dsec.errors import CapacityExceeded
from dsec.ids import SandboxId
from dsec.image.mount import sys_umount
from dsec.wire.spec import ExecRequest, SandboxSpec

pytestmark = pytest.mark.root

SPEC = SandboxSpec(image="base", memory_bytes=128 << 20, disk_bytes=256 << 20, backend="vm",
                   project="default")


async def test_a_one_tenant_within_its_cap_cannot_fill_the_edges_filesystem(
        vm_backend: VmBackend) -> None:
    root = vm_backend.root_dir + "-small"
    os.makedirs(root)
    img = vm_backend.root_dir + "-small.img"
    with open(img, "wb") as f:  # noqa: ASYNC230
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", img], check=True)  # noqa: ASYNC221
    # a loop device: tmpfs pages would be charged to QEMU's memory cgroup
    subprocess.run(["mount", "-o", "loop", img, root], check=True)  # noqa: ASYNC221
    b = VmBackend(root_dir=root, images=vm_backend.images, kernel=vm_backend.kernel,
                  initrd=vm_backend.initrd, append=vm_backend.append)
    sid = SandboxId("sb-red21a-fill")
    try:
        try:
            await b.create(sid, SPEC)
        except CapacityExceeded:
            return                            # refused: the disk cap cannot be honoured
        r = await b.exec(sid, ExecRequest(
            shell="yes 0123456789abcdef | head -c 83886080 > /root/fill; sync; echo done",
            timeout_s=240))
        assert b"done" in r.stdout, r
        free = shutil.disk_usage(root).free
        assert free > 8 << 20, (
            f"sandbox {sid} wrote within its {SPEC.disk_bytes >> 20} MiB disk cap and left "
            f"{free >> 20} MiB free on the filesystem of the edge's root_dir {root} (every "
            "other VM's disk, vm.json, pause memory files live there)")
    finally:
        with contextlib.suppress(Exception):
            await b.destroy(sid)
        await b.close()
        with contextlib.suppress(OSError):
            b.governor.remove_base()
        sys_umount(root, detach=True)
        with contextlib.suppress(OSError):
            os.unlink(img)
