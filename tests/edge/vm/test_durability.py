"""The vm backend's durability and host resources beyond the red-team repros
(tests/security/redteam21/test_a_vm_*): the other cut-off points of a pause, the uid
claim rebuilt on adopt when it conflicts, the pmem copy GC keeping what live VMs use,
the scratch disk reservation."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from dsec.edge.backends.container import DirectoryImages
from dsec.edge.backends.container.linux import fstatfs_type
from dsec.edge.backends.vm.backend import TMPFS_MAGIC, VmBackend, _Record, _Vm
from dsec.edge.backends.vm.density import DensityOptions, prepare_pmem_layer
from dsec.errors import BackendError, CapacityExceeded, DsecError
from dsec.ids import SandboxId
from dsec.wire.spec import SandboxSpec
from tests.syscall_order import assert_durable, record_syscalls

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups)")]

SPEC = SandboxSpec(image="base", memory_bytes=128 << 20, disk_bytes=32 << 20, backend="vm",
                   project="default")


@pytest.fixture
async def bare(tmp_path: Any) -> AsyncIterator[VmBackend]:
    """A backend that never boots (no kernel): records, claims, files only."""
    d = str(tmp_path)
    os.makedirs(os.path.join(d, "images", "base"))
    b = VmBackend(root_dir=os.path.join(d, "vm"), images=DirectoryImages(
        os.path.join(d, "images")), kernel="/none", initrd="/none",
        uid_dir=os.path.join(d, "uids"), density=DensityOptions())
    try:
        yield b
    finally:
        await b.close()
        for sid in b.governor.list_sandboxes():   # cgroups a test's resume made
            with contextlib.suppress(DsecError):
                b.governor.remove(b.governor.paths(sid))
        with contextlib.suppress(OSError):
            b.governor.remove_base()


def _vm(b: VmBackend, sid: str, **rec: Any) -> _Vm:
    d = os.path.join(b.root_dir, "sb", sid)
    os.makedirs(d, mode=0o700, exist_ok=True)
    return _Vm(sid=sid, spec=SPEC, dir=d, rec=_Record(sid=sid, **rec),
               cg=b.governor.paths(sid))


def test_uid_claimed_by_another_edge_paused_takes_a_new_one_running_is_refused(
        bare: VmBackend) -> None:
    b = bare
    os.makedirs(b.uid_dir, exist_ok=True)
    with open(os.path.join(b.uid_dir, str(b.uid_base)), "w") as f:
        f.write("otherbackend sb-x\n")
    paused = _vm(b, "sb-p", uid=b.uid_base, paused=True, memory_mib=128)
    b._reclaim_uid(paused)
    assert paused.rec.uid != b.uid_base
    with open(os.path.join(b.uid_dir, str(paused.rec.uid))) as f:
        assert f.read() == f"{b.key} sb-p\n"
    with open(os.path.join(paused.dir, "vm.json"), "rb") as f:   # the new uid is recorded
        assert msgspec.json.decode(f.read(), type=_Record).uid == paused.rec.uid
    running = _vm(b, "sb-r", uid=b.uid_base, pid=1, memory_mib=128)
    with pytest.raises(BackendError, match="must not share a uid"):
        b._reclaim_uid(running)
    with open(os.path.join(b.uid_dir, str(b.uid_base))) as f:
        assert f.read() == "otherbackend sb-x\n"                  # left to its owner


async def test_pmem_gc_keeps_copies_live_vms_use(bare: VmBackend, tmp_path: Any) -> None:
    b = bare
    used, gone = (os.path.join(str(tmp_path), n) for n in ("used.erofs", "gone.erofs"))
    for p in (used, gone):
        with open(p, "wb") as f:  # noqa: ASYNC230
            f.write(os.urandom(3 << 20))                   # not 2 MiB aligned: copied
    pmem = os.path.join(b.root_dir, "pmem")
    keep = prepare_pmem_layer(used, pmem).path
    drop = prepare_pmem_layer(gone, pmem).path
    vm = _vm(b, "sb-live", uid=b.uid_base, paused=True, layer_files=[used])
    b._vms[vm.sid] = vm
    try:
        await b.reconcile({vm.sid})
        assert os.path.exists(keep) and not os.path.exists(drop)
    finally:
        b._vms.clear()
    await b.reconcile(set())
    assert os.listdir(pmem) == []


def test_a_paused_record_is_on_disk_before_it_is_named(
        bare: VmBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A paused sandbox outlives a power loss (mem.bin is fsynced) and adopt drops one
    whose vm.json does not decode: a paused record is fsynced before its rename, the
    sandbox's directory after it."""
    vm = _vm(bare, "sb-p", uid=bare.uid_base, paused=True, memory_mib=128)
    calls = record_syscalls(monkeypatch)
    bare._save(vm)
    assert_durable(calls, os.path.join(vm.dir, "vm.json"))
    with open(os.path.join(vm.dir, "vm.json"), "rb") as f:
        assert msgspec.json.decode(f.read(), type=_Record).paused


def test_packed_and_padded_layers_are_on_disk_before_they_are_named(
        bare: VmBackend, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The EROFS file packed from an image directory and the padded pmem copy of a layer
    are reused by name (and size) alone: each is fsynced before its rename, its cache
    directory after it."""
    src = os.path.join(str(tmp_path), "tree")
    os.makedirs(src)
    with open(os.path.join(src, "f"), "wb") as f:
        f.write(os.urandom(10_000))
    layer = os.path.join(str(tmp_path), "l.erofs")
    with open(layer, "wb") as f:
        f.write(os.urandom(3 << 20))                       # not 2 MiB aligned: copied
    calls = record_syscalls(monkeypatch)
    assert_durable(calls, bare._pack_dir(src))
    assert_durable(calls, prepare_pmem_layer(layer, os.path.join(bare.root_dir, "pmem")).path)


def test_scratch_is_reserved_and_a_disk_beyond_the_filesystem_is_refused(
        bare: VmBackend) -> None:
    b = bare
    vm = _vm(b, "sb-s", uid=b.uid_base, memory_mib=128, disk_bytes=16 << 20)
    path = os.path.join(vm.dir, "scratch.img")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        b._reserve_scratch(vm, fd)
        st = os.fstat(fd)
        assert st.st_size == 16 << 20
        if fstatfs_type(fd) != TMPFS_MAGIC:                     # (tmpfs: checked only)
            assert st.st_blocks * 512 >= 16 << 20              # allocated, not sparse
        vm.rec.disk_bytes = 1 << 60
        with pytest.raises(CapacityExceeded, match="disk_bytes"):
            b._reserve_scratch(vm, fd)
    finally:
        os.close(fd)


# -- a real guest: the edge killed after the memory file, before the record ------------

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
root, store, kernel, initrd, sid = sys.argv[1:6]
class Edge(VmBackend):
    armed = False
    def _save(self, vm):          # pause: mem.bin complete, vm.json not yet "paused"
        if self.armed and vm.rec.paused:
            os.kill(os.getpid(), signal.SIGKILL)
        super()._save(vm)
async def main():
    b = Edge(root_dir=root, images=StoreImages(LayerStore(store), MountCache()),
             kernel=kernel, initrd=initrd)
    await b.create(sid, SandboxSpec(image="base", memory_bytes=128 << 20,
                                    disk_bytes=32 << 20, backend="vm", project="default"))
    await b.write_file(sid, "/root/mine", b"1")
    print("ready", flush=True)
    b.armed = True
    await b.pause(sid)
asyncio.run(main())
"""


@pytest.mark.parametrize("cgroups_swept", [False, True], ids=["cgroups-kept", "cgroups-swept"])
async def test_edge_killed_after_the_memory_file_adopts_the_sandbox_paused(
        vm_backend: VmBackend, vm_store: Any, boot_files: tuple[str, str],
        cgroups_swept: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``cgroups-swept``: a paused VM has no process in its cgroups, so a host reboot or
    a container edge started while this edge was down (census.idle_names sweeps the
    empty cgroups of a name whose claimer died) removes them. CI failed exactly so:
    the killed edge had taken the name over, another worker's start swept the paused
    sandbox's cgroups, and the resume's QEMU could not join them ("Exception occurred
    in preexec_fn"). The resume makes them again, limits and all. (The killed edge
    here no longer claims the name; a restarted edge re-claims it at reconcile.)"""
    b = vm_backend
    sid = SandboxId("sb-fxvm2-savedpause")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _EDGE, b.root_dir, vm_store.root, *boot_files, sid, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await p.communicate()
    assert p.returncode == -signal.SIGKILL and b"ready" in out, err[-2000:]
    d = os.path.join(b.root_dir, "sb", sid)
    with open(os.path.join(d, "vm.json"), "rb") as f:  # noqa: ASYNC230
        assert not msgspec.json.decode(f.read(), type=_Record).paused
    assert not b._qemu_pids().get(sid)
    if cgroups_swept:
        swept = b.governor.paths(sid)
        assert b.governor.exists(swept)
        b.governor.remove(swept)
        assert not any(os.path.isdir(x) for x in swept.dirs.values())
    assert await b.adopt(sid, SPEC)
    assert b._vms[sid].rec.paused
    await b.reconcile({sid})
    if cgroups_swept:
        # QEMU failing to join a missing cgroup says so (was: "Exception occurred in
        # preexec_fn"), and the failed resume loses nothing: still paused, resumable
        with monkeypatch.context() as m:
            m.setattr(b.governor, "exists", lambda cg: True)
            with pytest.raises(BackendError, match="joining its cgroup failed"):
                await b.resume(sid)
        assert b._vms[sid].rec.paused and os.path.exists(os.path.join(d, "mem.bin"))
    await b.resume(sid)
    assert await b.read_file(sid, "/root/mine") == b"1"
    cg = b._vms[sid].cg
    assert b.governor.exists(cg)
    assert b.governor.pids(cg)                          # QEMU runs inside them
    limit = os.path.join(cg.dirs["unified"], "memory.max") if cg.version == 2 else \
        os.path.join(cg.dirs["memory"], "memory.limit_in_bytes")
    with open(limit) as f:  # noqa: ASYNC230
        assert int(f.read()) < 1 << 40                  # the limit was written again


def test_a_uid_claim_appears_whole_and_a_torn_one_is_freed(bare: VmBackend) -> None:
    """A claim used to be created empty (O_EXCL) and then written: a kill -9 in between
    left a file naming nobody, which no backend ever released (a uid slot lost for
    good). A claim now appears whole (linked from a written temp file); the empty
    claims an older edge left are freed once a minute old, as are stray temps."""
    b = bare
    uid = b._alloc_uid("sb-a")
    with open(os.path.join(b.uid_dir, str(uid))) as f:
        assert f.read() == f"{b.key} sb-a\n"
    assert [n for n in os.listdir(b.uid_dir) if not n.isdigit()] == []   # no temp left
    torn, fresh_torn = b.uid_base + 50, b.uid_base + 51
    for n in (torn, fresh_torn):
        open(os.path.join(b.uid_dir, str(n)), "w").close()
    stray = os.path.join(b.uid_dir, ".claim-1-deadbeef")
    with open(stray, "w") as f:
        f.write(f"{b.key} sb-x\n")
    old = time.time() - 120
    for p in (os.path.join(b.uid_dir, str(torn)), stray):
        os.utime(p, (old, old))
    b._stale_uid_claims({"sb-a"})
    left = set(os.listdir(b.uid_dir))
    assert str(torn) not in left and ".claim-1-deadbeef" not in left
    assert {str(uid), str(fresh_torn)} <= left       # a fresh empty one may be mid-claim
    b._release_uid(uid, "sb-a")
    assert str(uid) not in os.listdir(b.uid_dir)


def test_the_stale_claim_sweep_never_frees_a_claim_being_made(
        bare: VmBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Red team 23b B1: the sweep (a worker thread) freed a claim of ours whose uid was
    not in ``_uids`` - and a claim being made is linked before its uid is added, so a
    sweep landing in between freed it: the next VM got the same uid. The sweep here runs
    exactly in that window (from inside the link); the claim must survive it."""
    b = bare
    real_link = os.link
    sweeps: list[threading.Thread] = []

    def link_then_sweep(src: str, dst: str) -> None:
        real_link(src, dst)
        if os.path.basename(dst).isdigit() and not sweeps:
            t = threading.Thread(target=b._stale_uid_claims, args=(set(),))
            sweeps.append(t)
            t.start()
            t.join(0.3)       # the old code: the sweep ran to its end right here

    monkeypatch.setattr(os, "link", link_then_sweep)
    uid = b._alloc_uid("sb-new")
    monkeypatch.setattr(os, "link", real_link)
    assert sweeps, "the sweep never ran inside the claim's window"
    sweeps[0].join(5)
    assert not sweeps[0].is_alive()
    with open(os.path.join(b.uid_dir, str(uid))) as f:
        assert f.read() == f"{b.key} sb-new\n"
    assert b._alloc_uid("sb-other") != uid        # the uid is still held


async def test_an_answered_resume_never_comes_back_paused(
        bare: VmBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adopt takes a ``mem.bin`` as "paused, whatever the record says"; resume unlinked
    it without making the unlink durable, so a power cut after an answered resume could
    bring the sandbox back as the paused one (its later work silently gone). The real
    unlink must be followed by an fsync of the sandbox's directory before resume
    returns. QEMU itself is out of this test (its start is the boundary: stubbed)."""
    from types import SimpleNamespace

    from tests.syscall_order import record_syscalls

    b = bare
    vm = _vm(b, "sb-res", uid=b._alloc_uid("sb-res"), paused=True, boot_id="boot-1")
    b._vms["sb-res"] = vm
    mem = os.path.join(vm.dir, "mem.bin")
    with open(mem, "wb") as f:  # noqa: ASYNC230
        f.write(b"guest memory")

    async def start(v: _Vm, *, incoming: str) -> None:
        v.link = SimpleNamespace(hello_reply=SimpleNamespace(boot_id="boot-1"))

    async def nothing(*_: Any) -> None:
        return None

    monkeypatch.setattr(b, "_qemu_pids", dict)
    monkeypatch.setattr(b, "_start", start)
    monkeypatch.setattr(b, "_sync_clock", nothing)
    monkeypatch.setattr(b.governor, "after_resume", lambda cg: None)
    calls = record_syscalls(monkeypatch)
    real_unlink = os.unlink

    def unlink(path: Any, *a: Any, **kw: Any) -> None:
        calls.append(("unlink", os.path.realpath(path)))
        real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", unlink)
    await b._resume_locked(vm)
    vm.link = None
    assert not os.path.exists(mem) and not vm.rec.paused
    gone = calls.index(("unlink", os.path.realpath(mem)))
    assert ("fsync", os.path.realpath(vm.dir)) in calls[gone + 1:], calls


async def test_reconcile_claims_the_cgroup_name_back_from_a_dead_claimer(
        bare: VmBackend) -> None:
    """An edge killed after another process on its root claimed the name (a start that
    died) left the binding to a dead claimer: any container edge's start then swept
    this backend's empty cgroups (census.idle_names) - a paused VM's, its base. The
    backend reconciling the root at start takes the name back."""
    from dsec.edge.backends.container.census import (
        NAMES_DIR,
        _binding,
        idle_names,
        process_identity,
    )

    name = bare.governor.name
    with open(os.path.join(NAMES_DIR, name), "w") as f:   # noqa: ASYNC230
        f.write(f"{bare.root_dir}\n999999 1\n")            # a claimer that is dead
    bound = _binding(NAMES_DIR, name)
    assert bound is not None
    assert idle_names({name: bound}, exists=os.path.isdir, alive=lambda o: False) == [name]
    await bare.reconcile(set())
    assert _binding(NAMES_DIR, name) == (bare.root_dir, process_identity(os.getpid()))


async def test_reconcile_removes_a_partial_cgroup_set(bare: VmBackend) -> None:
    """A create or teardown cut off between hierarchies leaves some of a sandbox's
    cgroup dirs: reconcile used to act only when all were there (``exists``), so the
    rest stayed for good. Any one present is now killed and removed (``present``)."""
    cg = bare.governor.paths("sb-partial")
    one = next(iter(cg.dirs.values()))
    os.mkdir(one)
    assert bare.governor.present(cg) and not bare.governor.exists(cg)
    left = await bare.reconcile(set())
    assert [x.sandbox_id for x in left] == ["sb-partial"] and "cgroup" in left[0].what
    assert not os.path.exists(one)
