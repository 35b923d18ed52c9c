"""A5 (red21a): the node's pid budget is per backend, and a node runs several tiers.

Each ContainerBackend caps the tasks of all its sandboxes together at
``kernel.pid_max - pids_headroom`` (pids.max on its own parent cgroup). ``dsec edge
--backend container --backend gvisor`` makes two such backends (root_dir
state/container, state/gvisor: two parents, two cgroup names): each gets the whole
budget, so together they may hold ~2x the host's pids (on gVisor's ptrace platform every
sandbox task is a host stub task, plus up to 256 Sentry threads per sandbox). Fork bombs
in a few sandboxes of each tier then take the host's last pids, which the headroom was
meant to keep for the edge and the host. (The vm backend sets no total at all.) Not
demonstrated with a real fork bomb: this machine is shared; the caps themselves are read.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends import make_backend
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.governor import DEFAULT_PIDS_HEADROOM, kernel_pid_max
from tests.edge.container.conftest import _cleanup
from tests.security.conftest import _rmdir_everywhere

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)"),
              pytest.mark.skipif(shutil.which("runsc") is None,
                                 reason="needs runsc (make setup installs it)")]


@pytest.fixture
async def tiers(tmp_path: object, images_dir: str) -> AsyncIterator[list[ContainerBackend]]:
    out: list[ContainerBackend] = []
    try:
        for name in ("container", "gvisor"):     # as cli/edge.py's _backend_opts does
            b = make_backend(name, root_dir=os.path.join(str(tmp_path), name),
                             images=DirectoryImages(images_dir))
            assert isinstance(b, ContainerBackend)
            out.append(b)
        yield out
    finally:
        for b in out:
            await _cleanup(b)
            _rmdir_everywhere(f"dsec-{b.cgroup_name}")


def _parent_pids_max(b: ContainerBackend) -> int:
    with open(os.path.join(b.governor.layout.bases["pids"], "pids.max")) as f:
        v = f.read().strip()
    return 1 << 31 if v == "max" else int(v)


async def test_a_all_tiers_together_keep_the_pid_headroom(
        tiers: list[ContainerBackend]) -> None:
    budget = kernel_pid_max() - DEFAULT_PIDS_HEADROOM
    caps = {b.runtime: _parent_pids_max(b) for b in tiers}
    assert sum(caps.values()) <= budget, (
        f"the sandboxes of the node's tiers may together hold {sum(caps.values())} tasks "
        f"({caps}), over the {budget} the pid headroom allows (kernel.pid_max "
        f"{kernel_pid_max()}): each backend budgets the whole node")
