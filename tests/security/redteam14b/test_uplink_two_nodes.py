"""Two edges on one host with ``--net-uplink host`` (``dsec up --edges 2 --net-uplink
host``, which uplink.py's docstring says is supported: "two edges on one host").

Attack/fault: none needed - both nodes' uplinks take the same DEFAULT_LINK
169.254.213.0/30, so the host holds 169.254.213.1/30 on two devices and the router
address 169.254.213.2 (the host table's masquerade source) is ambiguous: the host routes
every reply for either node to whichever connected route comes first.

Expected safe behaviour: each node's router reaches the test internet through its own
uplink (or the second attach is refused with a clear error naming the clash).
Observed: the second node's traffic silently goes nowhere (its replies are routed to the
first node's router netns - another node's flows, possibly another tenant's), while attach
succeeded.
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


def test_second_node_on_one_host_reaches_out_or_is_refused(host: FakeHost) -> None:
    r1 = host_router(host, "t1")
    try:
        assert connect_from(r1.fd, ALLOWED, 80, b"one").startswith("ok ")
        try:
            r2 = host_router(host, "t2")
        except BackendError:
            return  # refused with an error: safe
        try:
            got = connect_from(r2.fd, ALLOWED, 80, b"two", timeout=2.0)
            assert got.startswith("ok "), (
                f"node t2's router cannot reach the internet through its own host uplink "
                f"while t1's is up (same link {r2.uplink.link if hasattr(r2, 'uplink') else '?'}"
                f" on both): {got}")
        finally:
            r2.close()
    finally:
        r1.close()
