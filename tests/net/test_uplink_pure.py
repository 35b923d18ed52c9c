"""The host uplink's pure parts (net/uplink.py): the forward-chain check, the egress
device, the record of what forwarding was, the names."""

from __future__ import annotations

from typing import Any

from dsec.net.uplink import (
    blocking_forward_chains,
    default_route_device,
    forward_fix,
    forwarding_was,
    host_ruleset,
    host_table_name,
    link_in_use,
    local_addresses,
    uplink_ifname,
)

UP = "dsu0123456789"


def chain(family: str, table: str, name: str, hook: str, policy: str) -> dict[str, Any]:
    return {"chain": {"family": family, "table": table, "name": name, "handle": 1,
                      "type": "filter", "hook": hook, "prio": 0, "policy": policy}}


def accept_rule(family: str, table: str, chain_: str, key: str, dev: str) -> dict[str, Any]:
    return {"rule": {"family": family, "table": table, "chain": chain_, "handle": 5, "expr": [
        {"match": {"op": "==", "left": {"meta": {"key": key}}, "right": dev}},
        {"accept": None}]}}


def test_drop_policy_forward_chain_blocks_until_it_accepts_the_uplink_both_ways() -> None:
    base = [{"metainfo": {}}, chain("ip", "filter", "FORWARD", "forward", "drop"),
            chain("ip", "filter", "INPUT", "input", "drop"),
            chain("inet", "other", "fw", "forward", "accept"),
            chain("inet", "dsec_n1", "forward", "forward", "drop")]
    rs = {"nftables": base}
    assert blocking_forward_chains(rs, uplink=UP, own_table="dsec_n1") == [
        ("ip", "filter", "FORWARD")]
    half = {"nftables": [*base, accept_rule("ip", "filter", "FORWARD", "iifname", UP)]}
    assert blocking_forward_chains(half, uplink=UP, own_table="dsec_n1") != []
    other_dev = {"nftables": [*base, accept_rule("ip", "filter", "FORWARD", "iifname", "x"),
                              accept_rule("ip", "filter", "FORWARD", "oifname", "x")]}
    assert blocking_forward_chains(other_dev, uplink=UP, own_table="dsec_n1") != []
    both = {"nftables": [*half["nftables"],
                         accept_rule("ip", "filter", "FORWARD", "oifname", UP)]}
    assert blocking_forward_chains(both, uplink=UP, own_table="dsec_n1") == []


def test_forward_fix_names_chain_and_rules() -> None:
    msg = forward_fix([("ip", "filter", "FORWARD")], UP)
    assert "policy drop (ip filter FORWARD)" in msg
    assert f'nft insert rule ip filter FORWARD iifname "{UP}" accept' in msg
    assert f"iptables -I FORWARD -i {UP} -j ACCEPT" in msg


def test_default_route_device_lowest_metric() -> None:
    text = ("Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\n"
            "eth1\t00000000\t0102000A\t0003\t0\t0\t200\t00000000\n"
            "eth0\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"
            "eth2\t00000000\t0102000A\t0003\t0\t0\t100\t00000000\n")
    assert default_route_device(text) == "eth2"
    assert default_route_device(text.splitlines()[0] + "\n") is None


def test_forwarding_was_prefers_own_record_then_others_on_same_device() -> None:
    own = 'table inet dsec_a {\n\tcomment "dsec uplink dsuA: egress=eth0 forwarding_was=0"\n}'
    other = 'table inet dsec_b {\n\tcomment "dsec uplink dsuB: egress=eth0 forwarding_was=1"\n}'
    dev = 'table inet dsec_c {\n\tcomment "dsec uplink dsuC: egress=eth9 forwarding_was=1"\n}'
    assert forwarding_was({"dsec_b": other, "dsec_a": own}, egress="eth0",
                          own_table="dsec_a") == 0
    assert forwarding_was({"dsec_b": other}, egress="eth0", own_table="dsec_a") == 1
    assert forwarding_was({"dsec_c": dev}, egress="eth0", own_table="dsec_a") is None
    assert forwarding_was({}, egress="eth0", own_table="dsec_a") is None


def test_host_ruleset_shape() -> None:
    rs = host_ruleset(table="dsec_n", uplink=UP, egress="eth0", router_ip="169.254.213.2",
                      egress_forwarding_was=0)
    assert f'iifname "{UP}" fib daddr type {{ local, broadcast, multicast, anycast }}' in rs
    assert "priority -150" in rs  # before any DNAT rewrites a host address
    assert 'ip saddr 169.254.213.2 oifname "eth0" masquerade' in rs
    assert 'iifname "eth0" oifname != "dsu*" counter drop' in rs
    again = host_ruleset(table="dsec_n", uplink=UP, egress="eth0",
                         router_ip="169.254.213.2", egress_forwarding_was=1)
    assert 'oifname != "dsu*"' not in again  # the host forwarded already: not dsec's call


def test_names() -> None:
    assert host_table_name("node_1") == "dsec_node_1"
    assert host_table_name("a-b.c").startswith("dsec_") and "-" not in host_table_name("a-b.c")
    assert len(uplink_ifname("x" * 200)) <= 15


def test_host_uplink_offers_no_ipv6() -> None:
    """Fail closed: --net-ipv6 auto asks has_ipv6() and gets no IPv6 over a host uplink
    (routing it would make the egress device ignore router advertisements)."""
    import pytest

    from dsec.errors import BackendError
    from dsec.net.uplink import HostUplink

    up = HostUplink(-1, "n1")
    assert up.has_ipv6() is False
    assert str(up.router_ip6).startswith("fd00:d5ec:")
    with pytest.raises(BackendError, match="--net-ipv6 off"):
        up.attach(None, ipv6=True)  # type: ignore[arg-type]


def test_local_addresses_and_link_in_use() -> None:
    trie = ("Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 169.254.213.1\n        /32 host LOCAL\n"
            "     |-- 169.254.213.3\n        /32 link BROADCAST\n"
            "     |-- 192.0.2.1\n        /32 host LOCAL\n")
    assert local_addresses(trie) == {"169.254.213.1", "192.0.2.1"}
    assert link_in_use("169.254.213.0/30", {"169.254.213.1", "192.0.2.1"}) == "169.254.213.1"
    assert link_in_use("169.254.213.4/30", {"169.254.213.1", "192.0.2.1"}) is None
