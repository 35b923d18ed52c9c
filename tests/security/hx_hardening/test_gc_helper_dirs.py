"""What tiers leave on the node's disk is collected (hx): the gVisor driver's helper
directories of older contents (``<root>/runsc-helpers/<digest>``: a new one per nsexec,
busybox or seccomp change, none ever removed) and the vm tier's EROFS files packed from
image directories (``<root>/layers``: a new one per changed directory). What a live
sandbox uses stays: a bound helper directory shares its inodes with the sandbox."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends import make_backend
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.backends.container.runsc import stale_helpers
from dsec.edge.backends.vm.backend import stale_packed
from tests.edge.container.conftest import SPEC, _cleanup
from tests.security.conftest import _rmdir_everywhere, new_sid, sh

root = [pytest.mark.root,
        pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]
OLD = time.time() - 7200


def _write(path: str) -> None:
    with open(path, "w") as f:
        f.write("erofs")


def _plant_dir(path: str, *, mode: int = 0o555) -> None:
    os.makedirs(path)
    with open(os.path.join(path, "nsexec"), "w") as f:
        f.write("old")
    os.chmod(path, mode)
    os.utime(path, (OLD, OLD))


def test_stale_helpers_and_packed_are_exact() -> None:
    names = ["a1", "b2", ".build-x", ".build-y"]
    ages = {"a1": 9e9, "b2": 0.0, ".build-x": 601.0, ".build-y": 10.0}
    assert stale_helpers(names, {"b2"}, ages) == [".build-x", "a1"]
    assert stale_packed(["p.erofs", "q.erofs", "r.erofs.1.tmp"], {"q.erofs"},
                        {"p.erofs": 601.0, "q.erofs": 9e9, "r.erofs.1.tmp": 700.0}) == \
        ["p.erofs", "r.erofs.1.tmp"]
    assert stale_packed(["p.erofs"], set(), {"p.erofs": 10.0}) == []


@pytest.fixture
async def gvisor(tmp_path: object, images_dir: str) -> AsyncIterator[ContainerBackend]:
    if shutil.which("runsc") is None:
        pytest.skip("needs runsc (make setup)")
    b = make_backend("gvisor", root_dir=os.path.join(str(tmp_path), "groot"),
                     images=DirectoryImages(images_dir))
    assert isinstance(b, ContainerBackend)
    try:
        yield b
    finally:
        await _cleanup(b)
        _rmdir_everywhere(f"dsec-{b.cgroup_name}")


@root[0]
@root[1]
async def test_old_gvisor_helper_dirs_go_the_bound_one_stays(
        gvisor: ContainerBackend) -> None:
    sid = new_sid()
    await gvisor.create(sid, SPEC)
    parent = os.path.join(gvisor.root_dir, "runsc-helpers")
    live = sorted(n for n in os.listdir(parent) if not n.startswith("."))
    assert len(live) == 1, live
    _plant_dir(os.path.join(parent, "0000deadbeef0000"))     # an older edge's content
    _plant_dir(os.path.join(parent, ".build-crashed"), mode=0o700)
    os.makedirs(os.path.join(parent, ".build-inflight"))      # a maker's, just now
    drv = gvisor._runsc
    assert drv is not None
    drv._helpers.clear()   # as after an upgrade: the live sandbox's dir is not current
    await gvisor.reconcile(set())
    assert sorted(os.listdir(parent)) == [".build-inflight", *live]
    assert await sh(gvisor, sid, "/dev/.dsec/busybox echo ok") == (0, "ok\n")


@root[0]
@root[1]
async def test_vm_packed_layers_not_attached_go(tmp_path: object, images_dir: str) -> None:
    from dsec.edge.backends.vm.backend import VmBackend
    from dsec.edge.backends.vm.guest import kernel_cmdline
    from dsec.wire.spec import ExecRequest
    from tests.edge.vm.conftest import _boot_files

    boot = _boot_files()
    if isinstance(boot, str):
        pytest.skip(boot)
    b = VmBackend(root_dir=os.path.join(str(tmp_path), "vm"),
                  images=DirectoryImages(images_dir), kernel=boot[0], initrd=boot[1],
                  append=kernel_cmdline())
    layers = os.path.join(b.root_dir, "layers")
    sid = new_sid()
    try:
        await b.create(sid, SPEC)
        attached = sorted(os.listdir(layers))
        assert attached and all(n.endswith(".erofs") for n in attached), attached
        for n in attached:   # old, but attached: stays
            os.utime(os.path.join(layers, n), (OLD, OLD))
        for n in ("0123456789abcdef01234567.erofs", "fedcba.erofs.77.tmp"):
            _write(os.path.join(layers, n))   # as the image directory was before
            os.utime(os.path.join(layers, n), (OLD, OLD))
        _write(os.path.join(layers, "fresh.erofs"))   # packed for a create launching now
        await b.reconcile({sid})
        assert sorted(os.listdir(layers)) == sorted([*attached, "fresh.erofs"])
        r = await b.exec(sid, ExecRequest(shell="echo ok", timeout_s=60))
        assert (r.exit_code, r.stdout) == (0, b"ok\n")
        await b.destroy(sid)   # no VM attaches them any more, and they are old
        assert os.listdir(layers) == ["fresh.erofs"]
    finally:
        for s in list(b._vms):
            await b.destroy(s)  # type: ignore[arg-type]
        await b.reconcile(set())
        await b.close()
        with contextlib.suppress(OSError):
            b.governor.remove_base()
