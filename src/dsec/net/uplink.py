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
from dsec.net.kernel import Netlink

__all__ = ["UPLINK_IFINDEX", "UPLINK_IFNAME", "NetnsUplink"]

UPLINK_IFNAME: Final = "dsu0"
UPLINK_IFINDEX: Final = 2


@dataclass(frozen=True, slots=True)
class NetnsUplink:
    """The router's uplink into the netns held by ``peer_netns_fd``.

    ``link`` is a /30: its first host is the peer's end (the router's default gateway),
    its second the router's (the address sandboxes are masqueraded to). ``peer_ifname``
    names the peer's end inside the uplink netns (must be unique there).
    """

    peer_netns_fd: int
    peer_ifname: str
    link: str = "169.254.213.0/30"

    @property
    def peer_ip(self) -> ipaddress.IPv4Address:
        return ipaddress.IPv4Network(self.link).network_address + 1

    @property
    def router_ip(self) -> ipaddress.IPv4Address:
        return ipaddress.IPv4Network(self.link).network_address + 2

    @property
    def prefixlen(self) -> int:
        return ipaddress.IPv4Network(self.link).prefixlen

    def attach(self, router_rt: Netlink) -> None:
        """Create the veth (router end ``dsu0``), address and raise both ends, and route
        the router's default via the peer."""
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
        peer_rt = Netlink.route(self.peer_netns_fd)
        try:
            index = _ifindex_in(self.peer_netns_fd, self.peer_ifname)
            s = peer_rt.next_seq(2)
            peer_rt.request(rtwire.messages(
                rtwire.addr_add(s, index, self.peer_ip, self.prefixlen),
                rtwire.link_up(s + 1, index),
            ), [s, s + 1], f"uplink peer {self.peer_ifname}")
        finally:
            peer_rt.close()


def _ifindex_in(netns_fd: int, ifname: str) -> int:
    with netns.entered(netns_fd):
        return socket.if_nametoindex(ifname)
