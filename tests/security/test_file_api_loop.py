"""The container backend's file API walked a sandbox's trees on the edge's event loop
(found by the fncall red team: the fncall backend's same hole is tested in
test_fncall_hostile.py, where removing 300,000 files stopped the whole edge for 25 s).

A sandbox decides how big its trees are; ``remove(recursive=True)`` and ``list_dir`` ran
synchronously inside ``ContainerBackend``'s coroutines, so every other sandbox's exec,
the heartbeats and the connections waited for the walk. They run in the backend's file
threads now (``ContainerBackend._file_op``).
"""

from __future__ import annotations

import asyncio
import os

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest
from tests.security.conftest import PROBE_SPEC, new_sid, sh

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]


async def test_removing_a_huge_container_tree_does_not_stall_other_sandboxes(
        backend: ContainerBackend) -> None:
    a, b = new_sid(), new_sid()
    await backend.create(a, PROBE_SPEC)
    await backend.create(b, PROBE_SPEC)
    r = await backend.exec(a, ExecRequest(
        shell="mkdir /d && cd /d && i=0; while [ $i -lt 40000 ]; do : > f$i; i=$((i+1)); "
              "done; echo made", timeout_s=600))
    assert (r.exit_code, r.stdout) == (0, b"made\n"), r
    removing = asyncio.ensure_future(backend.remove(a, "/d", recursive=True))
    try:
        await asyncio.sleep(0)  # the remove has started
        assert await sh(backend, b, "echo served") == (0, "served\n")
        assert not removing.done(), "another sandbox's exec waited for the remove to finish"
    finally:
        await removing
