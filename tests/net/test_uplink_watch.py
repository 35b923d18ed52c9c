"""The host uplink's names per owner (REDTEAM-14b #4) and its watch (#3): what guards the host survives another
program flushing the host's ruleset or resetting its sysctls, and a host address added
after attach joins the router's never-reachable set. All in the fake host's netns."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from dsec.net import netns
from dsec.net.nftwire import SlotPolicy
from dsec.net.router import Router, RouterConfig
from dsec.net.testhost import DECOY_PORTS, EGRESS, FakeHost, fakehost
from dsec.net.testinternet import ALLOWED, Internet
from dsec.net.uplink import HostUplink, host_table_name, owner_tag
from tests.net.test_uplink_host import connect_from, host_router

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


@pytest.fixture
def host(internet: Internet) -> Iterator[FakeHost]:
    with fakehost(internet) as h:
        yield h


def _in_host(h: FakeHost, *cmd: str) -> str:
    with netns.entered(h.fd):
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def test_watch_puts_back_a_flushed_table_and_reset_sysctls(host: FakeHost) -> None:
    r = host_router(host, "t1")
    try:
        assert r.watch_uplink() is None  # all in place: nothing said
        _in_host(host, "nft", "flush", "ruleset")
        netns.write_sysctl(host.fd, f"net/ipv4/conf/{EGRESS}/forwarding", "0")
        said = r.watch_uplink()
        assert said is not None and "gone" in said and "forwarding reset" in said
        assert f"table inet {r.uplink.table}" in _in_host(host, "nft", "list", "tables")  # type: ignore[attr-defined]
        assert connect_from(r.fd, ALLOWED, 80, b"x").startswith("ok ")
    finally:
        r.close()


def test_blocking_chain_added_later_takes_the_uplink_down_until_fixed(host: FakeHost) -> None:
    r = host_router(host, "t1")
    try:
        _in_host(host, "nft", "add table ip docker; add chain ip docker FORWARD "
                 "{ type filter hook forward priority 0; policy drop; }")
        said = r.watch_uplink()
        assert said is not None and "taken down" in said
        assert connect_from(r.fd, ALLOWED, 80, b"x").startswith("ERR")
        assert r.watch_uplink() is None  # said once, not every poll
        _in_host(host, "nft", "delete", "table", "ip", "docker")
        said = r.watch_uplink()
        assert said is not None and "back up" in said
        assert connect_from(r.fd, ALLOWED, 80, b"x", timeout=2.0).startswith("ok ")
    finally:
        r.close()


def test_host_address_added_later_is_never_reachable(host: FakeHost) -> None:
    r = host_router(host, "t1")
    try:
        s = r.take()
        r.load(s, SlotPolicy(open=True))
        _in_host(host, "ip", "addr", "add", "198.51.100.77/32", "dev", "lo")
        said = r.watch_uplink()
        assert said is not None and "198.51.100.77" in said
        _in_host(host, "nft", "flush", "ruleset")  # the host table's layer gone: never4 holds
        for port in DECOY_PORTS:
            assert connect_from(s.fd, "198.51.100.77", port, timeout=0.5).startswith("ERR")
        assert host.decoy_hits() == []
    finally:
        r.close()


def test_two_clusters_with_node_edge_0_get_their_own_names(host: FakeHost) -> None:
    """REDTEAM-14b #4: names come from the node and the router's owner (its pinned path);
    the table's comment records the owner; one cluster's stop leaves the other's alone."""
    def make(owner: str, link: str) -> Router:
        return Router.create(RouterConfig(pool_min=2, build_batch=2),
                             HostUplink(host.fd, "edge-0", link=link, owner=owner))
    a = make("/c1/state/net/router", "169.254.213.0/30")
    try:
        b = make("/c2/state/net/router", "169.254.213.4/30")
        try:
            ta, tb = (host_table_name("edge-0", o) for o in ("/c1/state/net/router",
                                                               "/c2/state/net/router"))
            assert ta != tb
            listing = _in_host(host, "nft", "list", "table", "inet", ta)
            assert f"owner={owner_tag('/c1/state/net/router')}" in listing
            assert connect_from(a.fd, ALLOWED, 80, b"a").startswith("ok ")
            assert connect_from(b.fd, ALLOWED, 80, b"b").startswith("ok ")
        finally:
            b.close()
        assert connect_from(a.fd, ALLOWED, 80, b"a2").startswith("ok ")
        assert f"table inet {ta}" in _in_host(host, "nft", "list", "tables")
    finally:
        a.close()
