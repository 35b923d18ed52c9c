"""The same SDK program against plain ``dsec up`` (one machine) and against a cluster of
three test hosts (network namespaces, a real ``dsec edge`` with its own layer store and
container backend in each, the apiserver in a namespace of its own): same results, and
on the hosts the sandboxes really are spread over the hosts' edges."""

from __future__ import annotations

from collections.abc import Callable

from dsec.cluster.hosts import HostCluster
from dsec.cluster.local import LocalCluster
from tests.cluster.hosts_program import sdk_program
from tests.conftest import requires_root

pytestmark = requires_root


def _check(seen: dict[str, object], n: int) -> None:
    assert len(set(seen["ids"])) == n  # type: ignore[arg-type]
    assert seen["outputs"] == [(3, f"hello-{i}".encode(), b"err") for i in range(n)]
    assert seen["files"] == [f"note {i}\n" for i in range(n)]
    assert seen["paused_state"] == "paused" and seen["resumed_state"] == "running"
    assert seen["after_resume"] == b"note 0\n"
    assert seen["snapshot"] is True
    assert seen["gone"] == ["destroyed"] * n


def test_sdk_program_on_dsec_up() -> None:
    with LocalCluster(backend="container", subprocess=True) as cl, cl.client() as c:
        seen = sdk_program(c)
    _check(seen, 3)


def test_sdk_program_on_three_hosts(host_cluster: Callable[..., HostCluster]) -> None:
    hc = host_cluster(hosts=3)
    with hc.client(timeout=30) as c:
        seen = sdk_program(c, n=6)
    _check(seen, 6)
    hosts = {hc.host_of(i) for i in seen["ids"]}  # type: ignore[attr-defined]
    assert hosts <= set(hc.node_ids) and len(hosts) >= 2, hosts
    # the edges agree: nothing is left on any host
    assert {n: hc.edge_ids(n) for n in hc.node_ids} == {n: [] for n in hc.node_ids}
