"""A compromised edge for red-team 16 tests: the real ``dsec edge`` with a valid join,
whose heartbeat also lists the sandbox ids named (one per line) in the file
$RT16_CLAIM, as running sandboxes of project $RT16_PROJECT, and (with
$RT16_SNAPSHOT_PROJECT) claims every snapshot it is asked about as that project's: what
root on a joined host can make its edge say; the apiserver under test is not touched."""

from __future__ import annotations

import os

from dsec.edge import node as _node
from dsec.wire.node import SandboxBrief

_orig = _node.EdgeNode.heartbeat


def _heartbeat(self, *args, **kw):  # type: ignore[no-untyped-def]
    hb = _orig(self, *args, **kw)
    try:
        with open(os.environ.get("RT16_CLAIM", "/nonexistent")) as f:
            ids = f.read().split()
    except FileNotFoundError:
        ids = []
    ids += _phantoms(self.node_id)
    if hb.sandboxes is not None:
        hb.sandboxes.extend(SandboxBrief(i, "running", os.environ.get("RT16_PROJECT",
                                                                      "default"), 0, 1, 1)
                            for i in ids)
    return hb


_node.EdgeNode.heartbeat = _heartbeat  # type: ignore[method-assign]


async def _get_snapshot(self, ref: str):  # type: ignore[no-untyped-def]
    """With $RT16_SNAPSHOT_PROJECT: claim every snapshot id asked about, as that
    project's (the edge holds none of them)."""
    from dsec.wire.spec import SnapshotInfo
    return SnapshotInfo(id=ref, project=os.environ["RT16_SNAPSHOT_PROJECT"],
                        node=self.node_id)


_orig_get = _node.EdgeNode.get


def _get(self, sandbox_id: str):  # type: ignore[no-untyped-def]
    """With $RT16_PHANTOMS (a count) and $RT16_PROJECT: the ids ``sb-<n>-<this node>``
    the heartbeat lists are "running" sandboxes of that project (there are none)."""
    import time

    from dsec.wire.spec import SandboxInfo, SandboxSpec
    if sandbox_id in _phantoms(self.node_id):
        now = time.time()
        return SandboxInfo(id=sandbox_id, node=self.node_id, state="running",
                           spec=SandboxSpec(project=os.environ["RT16_PROJECT"],
                                            backend="simulated"),
                           created_at=now, last_active_at=now)
    return _orig_get(self, sandbox_id)


def _phantoms(node: str) -> list[str]:
    n = int(os.environ.get("RT16_PHANTOMS", "0"))
    return [f"sb-{i:012x}-{node}" for i in range(1, n + 1)]


_node.EdgeNode.get = _get  # type: ignore[method-assign]

if os.environ.get("RT16_SNAPSHOT_PROJECT"):
    _node.EdgeNode.get_snapshot = _get_snapshot  # type: ignore[method-assign]

if __name__ == "__main__":
    from dsec.cli.main import main
    main()
