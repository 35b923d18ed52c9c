"""The router's way out (shell): a veth from the router netns to an uplink netns.

``netns`` uplink (tests, the demo): the uplink's peer goes into a namespace the caller
holds (one that plays the host or "the internet"), and no object is made in the host's own
netns - tests never touch the host's interfaces, routes, sysctls or tables.

The ``host`` uplink of plan-14 §4.5 (a dsec-owned host table, per-device forwarding) is
the same veth with its peer in the edge's netns plus those host objects; it is not built
yet (docs/networking.md says so).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Final

from dsec.net import netns, rtwire
from dsec.net.addressing import UPLINK_LINK6
from dsec.net.kernel import Netlink

__all__ = ["UPLINK_IFINDEX", "UPLINK_IFNAME", "NetnsUplink", "netns_has_ipv6"]

UPLINK_IFNAME: Final = "dsu0"
UPLINK_IFINDEX: Final = 2


@dataclass(frozen=True, slots=True)
class NetnsUplink:
    """The router's uplink into the netns held by ``peer_netns_fd``.

    ``link`` is a /30: its first host is the peer's end (the router's default gateway),
    its second the router's (the address sandboxes are masqueraded to). ``peer_ifname``
    names the peer's end inside the uplink netns (must be unique there). ``link6``: the
    same link's IPv6 /126 (peer ::1, router ::2), configured only on a router with IPv6.
    """

    peer_netns_fd: int
    peer_ifname: str
    link: str = "169.254.213.0/30"
    link6: str = UPLINK_LINK6

    @property
    def peer_ip6(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Network(self.link6).network_address + 1

    @property
    def router_ip6(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Network(self.link6).network_address + 2

    def has_ipv6(self) -> bool:
        """Whether the uplink's namespace has a global IPv6 address (``--net-ipv6
        auto``: only then do sandboxes get IPv6)."""
        return netns_has_ipv6(self.peer_netns_fd)

    @property
    def peer_ip(self) -> ipaddress.IPv4Address:
        return ipaddress.IPv4Network(self.link).network_address + 1

    @property
    def router_ip(self) -> ipaddress.IPv4Address:
        return ipaddress.IPv4Network(self.link).network_address + 2

    @property
    def prefixlen(self) -> int:
        return ipaddress.IPv4Network(self.link).prefixlen

    def attach(self, router_rt: Netlink, *, ipv6: bool = False) -> None:
        """Create the veth (router end ``dsu0``), address and raise both ends, and route
        the router's default via the peer (``ipv6``: for IPv6 too, over ``link6``)."""
        seq = router_rt.next_seq(4)
        peer_index = 0  # the kernel picks the peer's ifindex in the uplink netns
        router_rt.request(rtwire.messages(
            rtwire.veth_pair(seq, name=UPLINK_IFNAME, index=UPLINK_IFINDEX,
                             peer=self.peer_ifname, peer_index=peer_index,
                             peer_netns_fd=self.peer_netns_fd),
            rtwire.addr_add(seq + 1, UPLINK_IFINDEX, self.router_ip, self.prefixlen),
            rtwire.link_up(seq + 2, UPLINK_IFINDEX),
            rtwire.default_route(seq + 3, self.peer_ip, UPLINK_IFINDEX),
        ), [seq, seq + 1, seq + 2, seq + 3], "router uplink")
        plen6 = ipaddress.IPv6Network(self.link6).prefixlen
        if ipv6:
            s6 = router_rt.next_seq(2)
            router_rt.request(rtwire.messages(
                rtwire.addr_add(s6, UPLINK_IFINDEX, self.router_ip6, plen6),
                rtwire.default_route(s6 + 1, self.peer_ip6, UPLINK_IFINDEX),
            ), [s6, s6 + 1], "router uplink (IPv6)")
        peer_rt = Netlink.route(self.peer_netns_fd)
        try:
            index = _ifindex_in(self.peer_netns_fd, self.peer_ifname)
            n = 3 if ipv6 else 2
            s = peer_rt.next_seq(n)
            msgs = [rtwire.addr_add(s, index, self.peer_ip, self.prefixlen),
                    rtwire.link_up(s + 1, index)]
            if ipv6:
                msgs.append(rtwire.addr_add(s + 2, index, self.peer_ip6, plen6))
            peer_rt.request(rtwire.messages(*msgs), list(range(s, s + n)),
                            f"uplink peer {self.peer_ifname}")
        finally:
            peer_rt.close()


def netns_has_ipv6(netns_fd: int) -> bool:
    """Whether the netns has an IPv6 address of global scope (``if_inet6``'s scope
    column 00; link-local is 20, loopback 10)."""
    with netns.entered(netns_fd):
        try:
            with open("/proc/thread-self/net/if_inet6") as f:
                rows = f.read().split("\n")
        except FileNotFoundError:  # IPv6 disabled in the kernel
            return False
    return any(len(r.split()) >= 4 and r.split()[3] == "00" for r in rows)


def _ifindex_in(netns_fd: int, ifname: str) -> int:
    with netns.entered(netns_fd):
        return socket.if_nametoindex(ifname)
