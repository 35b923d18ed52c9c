"""Red team 26 H's SysV fix (density.cap_sysv_ipc) writes a member's shmmax, shmall and
msgmni from an edge thread that setns's into the member's ipc namespace. A sandbox with
user_namespace=True has an ipc namespace owned by its own user namespace, and the
kernel gives that namespace's ipc sysctls to *its* root (ipc_permissions: the owner
bits for the ns's root uid, the "other" bits - read-only - for anyone else, the
host's root included): the write fails with EACCES and the create fails. So on a node
with memory_group_size > 1, **no sandbox with user_namespace=True can be created** -
the isolation option that maps root inside to an unprivileged host uid is what the
density trade takes away.

Repro: a grouped backend (memory_group_size=2) creates a user_namespace sandbox.

Fix: set the caps from inside (nsexec's create step, root of the new user namespace,
before the capability drop), or keep user_namespace sandboxes out of groups.
"""

from __future__ import annotations

import os

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import new_sid

from .conftest import spec

pytestmark = [pytest.mark.root]


async def test_user_namespace_sandbox_on_a_grouped_node(grouped: ContainerBackend) -> None:
    b = grouped
    sid = new_sid()
    try:
        await b.create(sid, spec("p", 64, user_namespace=True))
    except Exception as exc:
        raise AssertionError(f"a user_namespace sandbox cannot be created on a node with "
                             f"memory_group_size=2: {exc!r}") from exc
    # (fixed by keeping it out of groups: a memory cgroup of its own, its limit the
    # bound, so its ipc namespace needs no caps - dsec.edge.memgroups.groupable)
    r = await b.exec(sid, ExecRequest(shell="hog sysctl", timeout_s=30))
    assert r.exit_code == 0, r
    assert b.memory_group_of(sid) == ""
    assert os.path.basename(b.box(sid).cg.dirs["memory"]) == sid
