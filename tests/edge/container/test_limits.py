"""Node-protecting limits of the container backend: the per-sandbox and node-wide task
caps, and that an idle backend leaves no parent cgroup behind when it closes (disk caps:
test_disk.py)."""

from __future__ import annotations

import os

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.errors import InvalidArgument
from dsec.ids import SandboxId
from dsec.wire.spec import SandboxSpec
from tests.edge.container.conftest import SPEC, _cleanup, new_sid

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


async def test_pids_max_none_gets_the_node_cap_and_more_is_refused(
        tmp_path: object, images_dir: str) -> None:
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(images_dir), max_sandbox_pids=100)
    try:
        sid = new_sid()
        await b.create(sid, SandboxSpec(backend="container", pids_max=None))
        cg = b.governor.paths(sid)
        pids_dir = cg.dirs.get("pids", cg.dirs.get("unified", ""))
        assert _read(os.path.join(pids_dir, "pids.max")) == "100"
        with pytest.raises(InvalidArgument, match="per-sandbox maximum of 100"):
            await b.create(new_sid(), SandboxSpec(backend="container", pids_max=101))
        assert b.sandbox_ids() == [sid]
        assert sorted(os.listdir(os.path.join(b.root_dir, "sb"))) == [sid]
        # all sandboxes together: kernel.pid_max minus the headroom for a backend alone
        # on its host (an edge running several tiers splits it: red team 21, A5,
        # tests/security/redteam21/test_a_tier_pid_budgets.py)
        pid_max = int(_read("/proc/sys/kernel/pid_max"))
        total = int(_read(os.path.join(os.path.dirname(pids_dir), "pids.max")))
        assert total == b.pids_total == pid_max - 4096
    finally:
        await _cleanup(b)


def test_bad_pid_options_are_refused(tmp_path: object, images_dir: str) -> None:
    for kw in ({"max_sandbox_pids": 0}, {"pids_headroom": 1 << 40}, {"pids_headroom": -1}):
        with pytest.raises(InvalidArgument):
            ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                             images=DirectoryImages(images_dir), **kw)  # type: ignore[arg-type]


def _cgroup_dirs_named(leaf: str) -> list[str]:
    found = []
    for top in os.listdir("/sys/fs/cgroup"):
        for dirpath, dirnames, _ in os.walk(os.path.join("/sys/fs/cgroup", top)):
            if dirpath.count("/") > 8:
                dirnames[:] = []
            elif leaf in dirnames:
                found.append(os.path.join(dirpath, leaf))
                dirnames.remove(leaf)
    return found


@pytest.mark.parametrize("runtime", ["native", "runc", "runsc"])
async def test_idle_close_removes_the_parent_cgroups_and_busy_close_keeps_them(
        tmp_path: object, images_dir: str, runtime: str) -> None:
    import shutil
    if runtime != "native" and shutil.which(runtime) is None:
        pytest.skip(f"needs {runtime}")
    root = os.path.join(str(tmp_path), "root")
    b = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir),
                         runtime=runtime)  # type: ignore[arg-type]
    leaf = f"dsec-{b.cgroup_name}"
    sid = new_sid()
    try:
        await b.create(sid, SPEC)
        await b.close()  # stopping with a sandbox left: it must stay adoptable
        assert _cgroup_dirs_named(leaf)
        b = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir),
                             runtime=runtime)  # type: ignore[arg-type]
        assert await b.adopt(SandboxId(sid), SPEC)
        await b.destroy(SandboxId(sid))
        await b.close()
        assert _cgroup_dirs_named(leaf) == []
    finally:
        await _cleanup(b)
