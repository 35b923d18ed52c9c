"""Host uplink: the host's own addresses are protected by the host table alone (nd,
net/uplink.py HostUplink + cli/edge.py _network: RouterConfig gets no node_addresses).

In host mode the router's never-reachable set holds only NEVER4, the pool and the uplink
/30: the host's addresses (its public/LAN address, anything on lo) are left to the
``inet dsec_<node>`` host table's ``fib daddr type local`` drop, by design
(test_router_itself_never_reaches_a_host_address: "the host table, not the router's
never-set, is what holds"). Anything that flushes the host's ruleset removes that single
layer while the uplink, its forwarding and the sandboxes stay: Debian's
``/etc/nftables.conf`` starts with ``flush ruleset`` (``systemctl reload nftables``),
firewalld/ufw reloads, an admin's ``nft -f`` of a full config. Nothing notices (no watch,
no periodic re-check; only the next edge start re-adds the table).

Attack: a sandbox with policy ``open`` (plain egress, no private CIDR named) connects to
the host's sshd/apiserver/edge ports after the host's firewall was reloaded.
Expected safe behaviour: still refused - the node's own addresses are "never reachable,
whatever the policy says" (issue 14), so the router's never4 should hold them too (read
from the host netns at attach/adopt, refreshed on address changes), or the edge should
detect the missing table and put it back / cut the uplink.
Observed: the decoy listeners on the host accept the connection.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from dsec.net import netns
from dsec.net.nftwire import SlotPolicy
from dsec.net.testhost import DECOY_PORTS, EGRESS_IP, EXTRA_IP, FakeHost, fakehost
from dsec.net.testinternet import Internet
from tests.net.test_uplink_host import connect_from, host_router

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


@pytest.fixture
def host(internet: Internet) -> Iterator[FakeHost]:
    with fakehost(internet) as h:
        yield h


def test_host_addresses_stay_unreachable_after_a_host_firewall_reload(host: FakeHost) -> None:
    r = host_router(host, "t1")
    try:
        s = r.take()
        r.load(s, SlotPolicy(open=True))
        # positive control: with the table in place the host is unreachable
        assert connect_from(s.fd, EGRESS_IP, DECOY_PORTS[0], timeout=0.5).startswith("ERR")
        # the host's firewall is reloaded (`systemctl reload nftables`: flush ruleset)
        with netns.entered(host.fd):
            subprocess.run(["nft", "flush", "ruleset"], check=True)
        time.sleep(2.0)  # give any watchdog a chance
        reached = []
        for ip in (EGRESS_IP, EXTRA_IP):
            for port in DECOY_PORTS:
                out = connect_from(s.fd, ip, port, timeout=0.5)
                if not out.startswith("ERR"):
                    reached.append((ip, port, out))
        assert reached == [] and host.decoy_hits() == [], (
            f"an 'open' slot reached the host's own listeners once the host ruleset was "
            f"flushed (router never-set has no host address): {reached} {host.decoy_hits()}")
    finally:
        r.close()



