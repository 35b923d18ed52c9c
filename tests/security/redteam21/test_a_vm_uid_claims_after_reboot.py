"""A8 (red21a): QEMU's "a uid of its own" after a host reboot.

Each VM's QEMU runs as ``uid_base + slot``, claimed by a file in ``/run/dsec/vm-uids``
(O_EXCL, naming the backend and the sandbox) so the several edges of a host (``dsec up``
runs more than one) never hand out the same uid: an escapee of one QEMU must not be able
to signal or ptrace another. /run is a tmpfs: after a reboot the claims are gone, while
paused vm sandboxes (their memory in ``mem.bin`` on disk) are adopted again. adopt()
puts the record's uid back into the backend's own set but never re-creates its claim
file, so another edge hands the same uid to a new VM: two QEMUs of different sandboxes
(and tenants) share a uid once the paused one resumes.

No boot needed: a paused record is what adopt reads (vm.json + mem.bin), and the uid
allocator is the backend's own.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import msgspec
import pytest

from dsec.edge.backends.container import DirectoryImages
from dsec.edge.backends.vm.backend import VmBackend, _Record
from dsec.ids import SandboxId
from dsec.wire.spec import SandboxSpec

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups)")]


async def test_a_adopted_paused_vm_keeps_its_uid_claim(tmp_path: Any) -> None:
    d = str(tmp_path)
    os.makedirs(os.path.join(d, "images", "base"))
    uid_dir = os.path.join(d, "vm-uids")               # /run/dsec/vm-uids after a reboot
    images = DirectoryImages(os.path.join(d, "images"))
    a = VmBackend(root_dir=os.path.join(d, "edge-a"), images=images, kernel="/none",
                  initrd="/none", uid_dir=uid_dir)
    b = VmBackend(root_dir=os.path.join(d, "edge-b"), images=images, kernel="/none",
                  initrd="/none", uid_dir=uid_dir)
    sid = SandboxId("sb-red21a-paused")
    try:
        # edge A paused this sandbox before the reboot; its record and memory are on disk
        sb = os.path.join(a.root_dir, "sb", sid)
        os.makedirs(sb, mode=0o700)
        rec = _Record(sid=sid, uid=a.uid_base, paused=True, memory_mib=128)
        with open(os.path.join(sb, "vm.json"), "wb") as f:  # noqa: ASYNC230
            f.write(msgspec.json.encode(rec))
        with open(os.path.join(sb, "mem.bin"), "wb") as f:  # noqa: ASYNC230
            f.write(b"\0" * 4096)
        spec = SandboxSpec(image="base", backend="vm", memory_bytes=128 << 20)
        assert await a.adopt(sid, spec)
        # edge B (same host, its own root_dir) creates a VM: which uid does it get?
        uid_b = b._alloc_uid("sb-red21a-new")
        assert uid_b != rec.uid, (
            f"after a reboot, edge B handed uid {uid_b} to a new VM while edge A's adopted "
            f"paused sandbox {sid} will run as the same uid when resumed (adopt did not "
            f"claim it again in {uid_dir})")
    finally:
        for be in (a, b):
            await be.close()
            with contextlib.suppress(OSError):
                be.governor.remove_base()
