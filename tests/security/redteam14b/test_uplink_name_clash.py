"""Two clusters on one host: the host uplink's names come from the node id alone (nd,
net/uplink.py uplink_ifname/host_table_name; cluster/runtime.py names every `dsec up`
edge "edge-0", "edge-1", ...).

Two `dsec up --net-uplink host` runs on one machine (two users, two projects' admins,
each with their own state dir) both have a node "edge-0": the same host table
``inet dsec_<hash(edge-0)>`` and the same uplink device ``dsu<hash(edge-0)>``. The second
one's attach takes the first one's live veth for "a link of our name left by a crashed run
of this node" (_remove_stale_link) and deletes it, and replaces its host table.

Attack (another tenant's admin on the same host, or just a second cluster): start a
second edge with the same node id and host uplink.
Expected safe behaviour: the first cluster's router keeps reaching the internet (names
unique per router/state dir, or the second attach refused because the name is held by a
live router).
Observed: the first router's uplink is gone: its sandboxes are cut off with no event, and
the second cluster's stop later deletes the table both needed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from dsec.errors import BackendError
from dsec.net.testhost import FakeHost, fakehost
from dsec.net.testinternet import ALLOWED, Internet
from tests.net.test_uplink_host import connect_from, host_router

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


@pytest.fixture
def host(internet: Internet) -> Iterator[FakeHost]:
    with fakehost(internet) as h:
        yield h


def test_a_second_cluster_with_the_same_node_id_leaves_the_first_alone(host: FakeHost) -> None:
    first = host_router(host, "edge-0")       # cluster one's `dsec up`, node edge-0
    try:
        assert connect_from(first.fd, ALLOWED, 80, b"one").startswith("ok ")
        try:
            second = host_router(host, "edge-0")  # cluster two's `dsec up`, node edge-0
        except BackendError:
            second = None                          # refused: safe
        try:
            got = connect_from(first.fd, ALLOWED, 80, b"one-again", timeout=2.0)
            assert got.startswith("ok "), (
                f"cluster one's router lost its host uplink when another cluster's edge "
                f"with the same node id attached: {got}")
        finally:
            if second is not None:
                second.close()
    finally:
        first.close()
