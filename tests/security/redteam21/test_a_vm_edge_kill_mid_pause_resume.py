"""A3 (red21a): the edge killed with -9 in the middle of a vm pause or resume.

- **mid-resume** (after the new QEMU restored the guest, before ``vm.json`` says
  ``paused: false``): the next edge adopts the sandbox as paused (``mem.bin`` is there)
  and never looks for the QEMU the interrupted resume left running; reconcile skips it
  (the sandbox is kept). That guest runs on, untracked, while the node reports the
  sandbox paused (its code executes, its memory is held). The next resume starts a
  second QEMU on the same scratch disk (``file.locking=off``); observed here: the old
  one was gone after the resume (both share one memory cgroup sized for one guest) -
  which of the two survives is not something the code decides.
- **mid-pause** (QEMU ``stop``ped, its memory streaming into the edge's pipe): the
  migration fails when the edge dies and QEMU stays stopped (the edge stopped it before
  ``migrate``, so QEMU does not restart it). ``vm.json`` still says running: the next
  edge's adopt dials the agent, which never answers (its vCPUs are stopped), and after
  30 s destroys a sandbox that was intact.

The edge is a real child process killed with SIGKILL at the exact point (a subclass
sends the signal to itself), as tests/edge/vm/test_backend.py's reconcile test does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from dsec.edge.backends.vm.backend import VmBackend
from dsec.ids import SandboxId
from dsec.wire.spec import ExecRequest, SandboxSpec

pytestmark = pytest.mark.root

SPEC = SandboxSpec(image="base", memory_bytes=128 << 20, disk_bytes=32 << 20, backend="vm",
                   project="default")

_EDGE = """
import asyncio, os, signal, sys
from dsec.edge.backends.container.images import StoreImages
import dsec.edge.backends.vm.backend as vmb
from dsec.edge.backends.vm.backend import VmBackend
# the test's own backend (same root) holds the cgroup name: this edge, killed
# below, must not take it over (a dead claimer's empty cgroups get swept)
vmb.claim_cgroup_name = lambda *a, **k: None
from dsec.image import LayerStore, MountCache
from dsec.wire.spec import SandboxSpec
root, store, kernel, initrd, mode, sid = sys.argv[1:7]
def die(): os.kill(os.getpid(), signal.SIGKILL)
class Edge(VmBackend):
    armed = False
    def _save(self, vm):                  # resume: QEMU restored, vm.json not yet written
        if self.armed and mode == "resume" and not vm.rec.paused:
            die()
        super()._save(vm)
    async def _wait_migrated(self, vm):   # pause: guest stopped, memory streaming
        if self.armed and mode == "pause":
            await asyncio.sleep(0.05)
            die()
        await super()._wait_migrated(vm)
async def main():
    b = Edge(root_dir=root, images=StoreImages(LayerStore(store), MountCache()),
             kernel=kernel, initrd=initrd)
    await b.create(sid, SandboxSpec(image="base", memory_bytes=128 << 20,
                                    disk_bytes=32 << 20, backend="vm", project="default"))
    await b.write_file(sid, "/root/mine", b"1")
    if mode == "resume":
        await b.pause(sid)
    print("ready", flush=True)
    b.armed = True
    if mode == "resume":
        await b.resume(sid)
    else:
        await b.pause(sid)
    print("not killed", flush=True)
asyncio.run(main())
"""


async def _kill9_edge(b: VmBackend, store: Any, boot: tuple[str, str], mode: str,
                      sid: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _EDGE, b.root_dir, store.root, *boot, mode, sid, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await p.communicate()
    assert p.returncode == -signal.SIGKILL and b"ready" in out, err[-2000:]


async def test_a_edge_killed_mid_resume_leaves_no_second_qemu(
        vm_backend: VmBackend, vm_store: Any, boot_files: tuple[str, str]) -> None:
    b = vm_backend
    sid = SandboxId("sb-red21a-midresume")
    await _kill9_edge(b, vm_store, boot_files, "resume", sid)
    left = b._qemu_pids().get(sid, [])
    assert len(left) == 1                    # the QEMU of the interrupted resume
    adopted = await b.adopt(sid, SPEC)
    assert adopted
    await b.reconcile({sid})
    vm = b._vms[sid]
    pids = b._qemu_pids().get(sid, [])
    known = set() if vm.rec.paused else {vm.rec.pid}
    assert set(pids) <= known, (
        f"QEMU {pids} of sandbox {sid} runs its guest on the host while the edge holds the "
        f"sandbox as {'paused' if vm.rec.paused else 'running as ' + str(vm.rec.pid)}: the "
        "interrupted resume's QEMU was neither adopted nor killed by adopt/reconcile")
    if vm.rec.paused:
        await b.resume(sid)
    assert await b.read_file(sid, "/root/mine") == b"1"


async def test_a_edge_killed_mid_pause_keeps_the_sandbox(
        vm_backend: VmBackend, vm_store: Any, boot_files: tuple[str, str]) -> None:
    b = vm_backend
    sid = SandboxId("sb-red21a-midpause")
    events: list[tuple[str, str, str]] = []
    b.watch(lambda *a: events.append(a))
    await _kill9_edge(b, vm_store, boot_files, "pause", sid)
    assert b._qemu_pids().get(sid)           # QEMU survived the edge, guest stopped
    adopted = await b.adopt(sid, SPEC)
    assert adopted, ("an edge killed while pausing a vm sandbox: the next edge could not "
                     "adopt the intact guest (QEMU left stopped; hello timed out) and "
                     "destroyed it")
    r = await b.exec(sid, ExecRequest(argv=("cat", "/root/mine"), timeout_s=20))
    assert r.stdout == b"1"
