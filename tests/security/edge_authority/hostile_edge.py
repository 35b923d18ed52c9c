"""A compromised edge: the real ``dsec edge``, patched in its own process the way root on
its host could make it speak (red team 16's hostile_edge.py, for a static edge). The
apiserver under test is not touched.

- ``$HOSTILE_CLAIM`` (a file, ids one per line): the heartbeat also lists those sandbox
  ids (another node's) as running sandboxes of ``$HOSTILE_PROJECT``;
- ``$HOSTILE_PHANTOMS`` (a count): the heartbeat lists ``sb-<n>-<this node>`` ids and
  ``get`` answers them as running sandboxes of ``$HOSTILE_PROJECT`` (there are none);
- ``$HOSTILE_FULL``: it refuses every create as full (so tests know where sandboxes go);
- ``$HOSTILE_SNAPSHOT_PROJECT``: every snapshot id it is asked about is "held" here and
  belongs to that project (it holds none).
"""

from __future__ import annotations

import os
import time
from typing import Any

from dsec.edge import node as _node
from dsec.wire.node import SandboxBrief
from dsec.wire.spec import SandboxInfo, SandboxSpec, SnapshotInfo

_heartbeat = _node.EdgeNode.heartbeat
_get = _node.EdgeNode.get


def _phantoms(node: str) -> list[str]:
    n = int(os.environ.get("HOSTILE_PHANTOMS", "0"))
    return [f"sb-{i:012x}-{node}" for i in range(1, n + 1)]


def heartbeat(self: Any, *args: Any, **kw: Any) -> Any:
    hb = _heartbeat(self, *args, **kw)
    try:
        with open(os.environ.get("HOSTILE_CLAIM", "/nonexistent")) as f:
            ids = f.read().split()
    except FileNotFoundError:
        ids = []
    ids += _phantoms(self.node_id)
    if hb.sandboxes is not None:
        project = os.environ.get("HOSTILE_PROJECT", "default")
        hb.sandboxes.extend(SandboxBrief(i, "running", project, 0, 1, 1) for i in ids)
    return hb


def get(self: Any, sandbox_id: str) -> Any:
    if sandbox_id in _phantoms(self.node_id):
        now = time.time()
        return SandboxInfo(id=sandbox_id, node=self.node_id, state="running",
                           spec=SandboxSpec(project=os.environ["HOSTILE_PROJECT"],
                                            backend="simulated"),
                           created_at=now, last_active_at=now)
    return _get(self, sandbox_id)


async def get_snapshot(self: Any, ref: str) -> SnapshotInfo:
    return SnapshotInfo(id=ref, project=os.environ["HOSTILE_SNAPSHOT_PROJECT"],
                        node=self.node_id, backend="simulated")


async def snapshots(self: Any, **kw: Any) -> list[SnapshotInfo]:
    try:
        with open(os.environ.get("HOSTILE_SNAPSHOTS", "/nonexistent")) as f:  # noqa: ASYNC230
            ids = f.read().split()
    except FileNotFoundError:
        ids = []
    return [SnapshotInfo(id=i, project=os.environ["HOSTILE_SNAPSHOT_PROJECT"],
                         node=self.node_id, backend="simulated") for i in ids]


async def create(self: Any, *args: Any, **kw: Any) -> Any:
    from dsec.errors import CapacityExceeded
    raise CapacityExceeded(f"node {self.node_id} is full (it says)")


_node.EdgeNode.heartbeat = heartbeat  # type: ignore[method-assign]
_node.EdgeNode.get = get  # type: ignore[method-assign]
if os.environ.get("HOSTILE_FULL"):
    _node.EdgeNode.create = create  # type: ignore[method-assign]
if os.environ.get("HOSTILE_SNAPSHOT_PROJECT"):
    _node.EdgeNode.get_snapshot = get_snapshot  # type: ignore[method-assign]
    _node.EdgeNode.snapshots = snapshots  # type: ignore[method-assign]

if __name__ == "__main__":
    from dsec.cli.main import main
    main()
