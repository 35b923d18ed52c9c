"""Slot addressing: slot index <-> veth name, /31 pair, resolver address (pure).

A node's router netns owns a private IPv4 pool (``10.213.0.0/16`` by default). Slot ``i``
is the point-to-point /31 ``pool + 2i``: the even address is the router's end (``dsv<i>``),
the odd one the sandbox's ``eth0``. The last /31 of the pool is not a slot: its upper
address is the DNS resolver's (on the router's ``lo``). A /31 per sandbox (RFC 3021) gives
each one its own L2 segment: no ARP between tenants, nothing to spoof but the one address,
and the anti-spoof rule of its chain pins even that.

IPv6 (a node started with ``--net-ipv6 auto`` whose uplink has IPv6): slot ``i`` is also
the /127 ``pool6 + 2i`` of the ULA ``fd00:d5ec::/48`` (router end even, sandbox end odd,
RFC 6164), the IPv4 layout's twin. A /127 rather than a /64 per slot: the link holds
exactly the two addresses dsec gave it, so there is nothing to autoconfigure (no router
advertisements, no SLAAC or privacy addresses a sandbox could pick), the anti-spoof rule
is one exact address as on IPv4, the router's neighbour cache holds one entry per slot,
and address <-> slot stays arithmetic. The addresses skip duplicate address detection
(both ends are dsec's), so a slot is usable the moment it is built. The router's uplink link
(``UPLINK_LINK6``) sits in a /64 of the default pool far above any slot; the pool and the
uplink's addresses are never reachable from a slot.

The pool is private to each router netns, so two edges on one host may use the same pool;
the inverse (address -> slot) is what the resolver uses to name the asking sandbox and what
reconcile uses to find a live sandbox's slot from its ``eth0``.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Final

from dsec.errors import InvalidArgument

__all__ = [
    "DEFAULT_POOL",
    "DEFAULT_POOL6",
    "POOL_RANGES",
    "ROUTER_IFINDEX_BASE",
    "SLOT_PREFIX",
    "UPLINK_LINK6",
    "Pool",
    "SlotAddr",
]

DEFAULT_POOL: Final = "10.213.0.0/16"
#: Where a pool may lie: the private ranges (RFC 1918, shared address space RFC 6598,
#: benchmarking RFC 2544). Anything else is refused (REDTEAM-14b #9): "this network",
#: loopback, link-local (the metadata address, the uplink links 169.254.213.0/24),
#: multicast/reserved, the whole space (never4 would then hold every destination) and
#: public ranges (sandboxes would squat real addresses, and never4 - which holds the
#: pool - would make those real destinations unreachable for every sandbox).
POOL_RANGES: Final = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                      "198.18.0.0/15")

DEFAULT_POOL6: Final = "fd00:d5ec::/48"
#: The router's uplink link when it carries IPv6 (peer ::1, router ::2): inside the pool
#: (so never reachable from a slot) and far above any slot index.
UPLINK_LINK6: Final = "fd00:d5ec:0:ffff::/126"
# Router-side veth names: "dsv<slot>" (IFNAMSIZ 16: "dsv" + up to 5 digits fits easily).
SLOT_PREFIX: Final = "dsv"
# The router's end of slot i gets ifindex BASE + i (ifindexes are per netns; an explicit
# index lets one rtnetlink batch create the veth and address it without a lookup: E8).
ROUTER_IFINDEX_BASE: Final = 1000
# The sandbox's end is always "eth0" with ifindex 2 in its own netns (lo is 1).
SANDBOX_IFNAME: Final = "eth0"
SANDBOX_IFINDEX: Final = 2


@dataclass(frozen=True, slots=True)
class SlotAddr:
    """Where slot ``index`` lives: names and addresses of its veth pair."""

    index: int
    router_ip: ipaddress.IPv4Address
    sandbox_ip: ipaddress.IPv4Address
    #: the /127 of the slot in the IPv6 pool (used only on a node with IPv6)
    router_ip6: ipaddress.IPv6Address
    sandbox_ip6: ipaddress.IPv6Address

    @property
    def ifname(self) -> str:
        """The router-side veth (also the key of the ``out``/``in`` verdict maps)."""
        return f"{SLOT_PREFIX}{self.index}"

    @property
    def router_ifindex(self) -> int:
        return ROUTER_IFINDEX_BASE + self.index

    @property
    def chain_prefix(self) -> str:
        """Prefix of this slot's nft objects: ``s17o``, ``s17a4``..."""
        return f"s{self.index}"


class Pool:
    """Arithmetic over the node's slot pool (an IPv4 network of at least 4 addresses)."""

    def __init__(self, cidr: str = DEFAULT_POOL, cidr6: str = DEFAULT_POOL6) -> None:
        try:
            net = ipaddress.IPv4Network(cidr, strict=True)
        except ValueError as exc:
            raise InvalidArgument(
                f"net pool {cidr!r} is not an IPv4 network ({exc}); e.g. {DEFAULT_POOL}",
                field="net_pool",
            ) from exc
        if net.prefixlen > 30:
            raise InvalidArgument(
                f"net pool {cidr} holds {net.num_addresses} addresses; a pool needs at "
                "least a /30 (one slot and the resolver)",
                field="net_pool",
            )
        if not any(net.subnet_of(ipaddress.IPv4Network(r)) for r in POOL_RANGES):
            raise InvalidArgument(
                f"net pool {cidr} is not inside a private range ({', '.join(POOL_RANGES)}):"
                " sandboxes would take addresses that are real elsewhere (or loopback, "
                "link-local, multicast), and the router never lets a sandbox reach its "
                f"pool; use a private range no host network uses, e.g. {DEFAULT_POOL}",
                field="net_pool",
            )
        try:
            net6 = ipaddress.IPv6Network(cidr6, strict=True)
        except ValueError as exc:
            raise InvalidArgument(
                f"net pool {cidr6!r} is not an IPv6 network ({exc}); e.g. {DEFAULT_POOL6}",
                field="net_pool6",
            ) from exc
        if net6.prefixlen > 64:
            raise InvalidArgument(
                f"IPv6 net pool {cidr6} is longer than a /64; give a /64 or shorter "
                f"(e.g. {DEFAULT_POOL6})", field="net_pool6")
        self.network = net
        self.network6 = net6
        self._base = int(net.network_address)
        self._base6 = int(net6.network_address)
        # Every /31 but the last, which holds the resolver.
        self.capacity = net.num_addresses // 2 - 1

    @property
    def resolver(self) -> ipaddress.IPv4Address:
        """The resolver's address: the pool's last-but-one address, on the router's lo."""
        return ipaddress.IPv4Address(self._base + self.network.num_addresses - 2)

    def slot(self, index: int) -> SlotAddr:
        if not 0 <= index < self.capacity:
            raise InvalidArgument(
                f"slot {index} is outside pool {self.network} (slots 0..{self.capacity - 1})",
                field="slot",
            )
        return SlotAddr(
            index=index,
            router_ip=ipaddress.IPv4Address(self._base + 2 * index),
            sandbox_ip=ipaddress.IPv4Address(self._base + 2 * index + 1),
            router_ip6=ipaddress.IPv6Address(self._base6 + 2 * index),
            sandbox_ip6=ipaddress.IPv6Address(self._base6 + 2 * index + 1),
        )

    def slot_of(self, address: str | ipaddress.IPv4Address | ipaddress.IPv6Address
                ) -> int | None:
        """The slot whose *sandbox* end is ``address`` (either family); None for
        anything else (the router's ends, the resolver, addresses outside the pool)."""
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return None
        if ip.version == 6:
            v4 = ip.ipv4_mapped
            if v4 is None:
                off6 = int(ip) - self._base6
                if off6 < 0 or off6 % 2 == 0 or off6 >= 2 * self.capacity:
                    return None
                return off6 // 2
            ip = v4
        off = int(ip) - self._base
        if off < 0 or off % 2 == 0:
            return None
        index = off // 2
        return index if index < self.capacity else None

    @staticmethod
    def slot_of_ifname(ifname: str) -> int | None:
        """``dsv17`` -> 17; None for any other name."""
        if not ifname.startswith(SLOT_PREFIX):
            return None
        digits = ifname[len(SLOT_PREFIX):]
        if not digits.isdigit() or (len(digits) > 1 and digits[0] == "0"):
            return None
        return int(digits)
