"""kill -9 of the edge on a remote test host (issue 16): the host's supervisor restarts
it, it re-adopts its real container sandboxes from its journal, and the apiserver (in
another namespace, across the bridge) serves them again: nothing lost."""

from __future__ import annotations

from collections.abc import Callable

from dsec.cluster.drills import edge_kill
from dsec.cluster.hosts import HostCluster
from tests.conftest import requires_root

pytestmark = requires_root


def test_remote_edge_kill9_readopts(host_cluster: Callable[..., HostCluster]) -> None:
    hc = host_cluster(hosts=2, node_ttl_s=15.0)
    r = edge_kill(hc, "h1")
    print(f"\nHOSTS-COUNTS edge-kill: node={r.node} sandboxes={len(r.before)} "
          f"readopted={r.readopted} lost={r.lost} relinks={r.relinks}")
    assert len(r.before) >= 1
    assert r.new_pid is not None and r.new_pid != r.old_pid
    assert r.readopted == len(r.before) and r.lost == 0
    assert sorted(hc.edge_ids("h1")) == sorted(r.before)
