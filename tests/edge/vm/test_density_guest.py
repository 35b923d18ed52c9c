"""Density on a real guest (vm/density.py through the vm backend): a hostile guest root
writing over the read-only layer region it maps changes nothing on the host nor what it
reads back; the guest kernel gets the density command line."""

from __future__ import annotations

import glob
import hashlib
import os

import pytest

from dsec.edge.backends.vm.backend import VmBackend
from dsec.edge.backends.vm.density import DensityOptions
from dsec.ids import SandboxId
from dsec.wire.spec import ExecRequest, SandboxSpec

pytestmark = pytest.mark.root

SPEC = SandboxSpec(image="base", memory_bytes=192 << 20, disk_bytes=64 << 20, backend="vm",
                   project="default")
# Root inside the guest makes a node for the pmem region and writes 64 KiB of noise over
# the start of the layer (its superblock and first inodes), then drops the guest's caches
# so the next reads come from the region again.
_OVERWRITE = ("set -e; d=$(cat /sys/class/block/pmem0/dev); mknod /tmp/pm b ${d%:*} ${d#*:}; "
              "dd if=/dev/urandom of=/tmp/pm bs=4096 count=16 conv=notrunc,fsync 2>/dev/null; "
              "sync; echo 3 > /proc/sys/vm/drop_caches; echo written")


def _digests(paths: list[str]) -> dict[str, str]:
    out = {}
    for p in paths:
        with open(p, "rb") as f:
            out[p] = hashlib.sha256(f.read()).hexdigest()
    return out


async def test_guest_root_cannot_write_the_shared_layer(vm_backend: VmBackend) -> None:
    b = VmBackend(root_dir=vm_backend.root_dir + "-pm", images=vm_backend.images,
                  kernel=vm_backend.kernel, initrd=vm_backend.initrd,
                  append=vm_backend.append, density=DensityOptions())
    sid = SandboxId("sb-vd-pmem")
    try:
        await b.create(sid, SPEC)
        r = await b.exec(sid, ExecRequest(shell="cat /proc/cmdline; md5sum /bin/busybox"))
        assert r.exit_code == 0, r
        cmdline, before = r.stdout.decode().splitlines()
        assert "swiotlb=noforce" in cmdline.split() and "damon_reclaim" not in cmdline
        regions = b._vms[sid].rec.layer_files + glob.glob(os.path.join(b.root_dir, "pmem", "*"))
        host_before = _digests(regions)
        r = await b.exec(sid, ExecRequest(shell=_OVERWRITE))
        assert r.exit_code == 0 and r.stdout.strip() == b"written", r  # the write "succeeded"
        r = await b.exec(sid, ExecRequest(shell="md5sum /bin/busybox; ls /bin | wc -l"))
        assert r.exit_code == 0, r
        after, n = r.stdout.decode().splitlines()
        assert after == before and int(n) > 50            # the guest reads the layer as it was
        assert _digests(regions) == host_before            # and the host's files are untouched
    finally:
        for s in list(b._vms):
            await b.destroy(s)  # type: ignore[arg-type]
        await b.close()
        b.governor.remove_base()
