"""The router's way out: a veth from the router netns to the host or to a test netns.

Two kinds (plan-14 §4.5), both a /30 veth whose router end is ``dsu0``:

``NetnsUplink`` (tests, the demo): the peer goes into a namespace the caller holds (one
that plays "the internet"), and no object is made anywhere else - tests never touch the
host's interfaces, routes, sysctls or tables.

``HostUplink`` (production, ``dsec edge --net-uplink host``): the peer goes into the
host's netns (the edge's own; a test hands it a netns that *plays* the host, so the very
same code is exercised without touching the real one), plus what it takes to route the
router's traffic out of the host and nothing else:

- a dsec-owned table ``inet dsec_<node>``: ``prerouting`` drops whatever comes in on the
  uplink for an address of the host itself (``fib daddr type local``: the apiserver, the
  edge's port, sshd, anything bound to 0.0.0.0 - the router's own never-reachable set
  cannot know every host address, the kernel's fib does); ``forward`` lets the uplink out
  of the egress device and only the replies back; ``postrouting`` masquerades the router's
  address out of the egress device;
- per-device ``forwarding=1`` on the uplink and the egress device (both are needed when
  ``all.forwarding`` is 0, E6); when the egress device did not forward before, the table
  also drops what else would now be forwarded from it, so the host forwards nothing it did
  not forward before but the sandboxes' replies;
- a check first that no other forward-hook base chain has policy drop (Docker's and ufw's
  ``FORWARD``): a packet must be accepted by *every* base chain on a hook, so such a chain
  would silently drop the sandboxes' traffic. The check fails naming the chain and the two
  rules to add to it (it passes once that chain accepts the uplink both ways).

``detach()`` (the router calls it on close) removes the table and the veth and puts the
egress device's ``forwarding`` back - unless another dsec table still needs it (two edges
on one host): each table records in its comment what the egress device had before the
first of them, so the last one out restores it. A crash leaves the table and the sysctl;
the next start of the same node replaces the table and reads the original value from it.
Legacy (non-nft) iptables chains are not seen by the check: docs/networking.md says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import logging
import re
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from dsec.errors import BackendError
from dsec.net import netns, rtwire
from dsec.net.addressing import UPLINK_LINK6
from dsec.net.kernel import Netlink, Nft

__all__ = [
    "UPLINK_IFINDEX",
    "UPLINK_IFNAME",
    "HostUplink",
    "NetnsUplink",
    "Uplink",
    "blocking_forward_chains",
    "default_route_device",
    "dsec_tables",
    "forward_fix",
    "forwarding_was",
    "host_ruleset",
    "host_table_name",
    "link_in_use",
    "local_addresses",
    "netns_has_ipv6",
    "owner_tag",
    "uplink_ifname",
]

log = logging.getLogger(__name__)

UPLINK_IFNAME: Final = "dsu0"
UPLINK_IFINDEX: Final = 2
DEFAULT_LINK: Final = "169.254.213.0/30"
#: how long an uplink waits for its /30 to be freed by a router closed just before
LINK_FREE_WAIT_S: Final = 3.0
#: the uplink's IPv6 /126 (nf's addressing.UPLINK_LINK6): a host uplink carries no IPv6
#: (see HostUplink.has_ipv6), the addresses only name what the router never reaches
HOST_LINK6: Final = UPLINK_LINK6
#: host tables of dsec's uplinks are named ``dsec_<node>``; the prefix finds the others
HOST_TABLE_PREFIX: Final = "dsec_"
_NAME_OK = re.compile(r"[A-Za-z0-9_]{1,40}")
_WAS = re.compile(r"egress=(\S+) forwarding_was=([01])")
#: what an egress device name may hold to be spliced into an nft rule and a sysctl path
_IFNAME_OK = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")


class Uplink(Protocol):
    """What the router needs of an uplink."""

    @property
    def peer_ip(self) -> ipaddress.IPv4Address: ...

    @property
    def router_ip(self) -> ipaddress.IPv4Address: ...

    @property
    def peer_ip6(self) -> ipaddress.IPv6Address: ...

    @property
    def router_ip6(self) -> ipaddress.IPv6Address: ...

    def has_ipv6(self) -> bool: ...

    def attach(self, router_rt: Netlink, *, ipv6: bool = False) -> None: ...

    def adopt(self) -> None: ...

    def detach(self) -> None: ...

    def guarded_addresses(self) -> tuple[str, ...]: ...

    def check(self) -> str | None: ...


def _owned(node: str, owner: str) -> str:
    return hashlib.sha256(f"{owner}\0{node}".encode()).hexdigest()


def uplink_ifname(node: str, owner: str = "") -> str:
    """The peer's device name for node ``node`` of router ``owner`` (15 bytes at most).
    ``owner`` (the pinned router's path, i.e. the state dir) keeps two clusters on one
    host apart when both have a node ``edge-0`` (REDTEAM-14b #4); "" for a router held by
    its process only (the node id alone, as before)."""
    if not owner:
        return "dsu" + hashlib.sha256(node.encode()).hexdigest()[:10]
    return "dsu" + _owned(node, owner)[:10]


def host_table_name(node: str, owner: str = "") -> str:
    """``dsec_<node>`` when the node id is a valid nft name and there is no ``owner``,
    else ``dsec_<hash of owner and node>`` (the node and owner are in the comment)."""
    if not owner:
        if _NAME_OK.fullmatch(node):
            return HOST_TABLE_PREFIX + node
        return HOST_TABLE_PREFIX + hashlib.sha256(node.encode()).hexdigest()[:12]
    return HOST_TABLE_PREFIX + _owned(node, owner)[:16]


def owner_tag(owner: str) -> str:
    """What a host table's comment records of its owner (nft-comment-safe); pure."""
    return hashlib.sha256(owner.encode()).hexdigest()[:12] if owner else "-"


def _link(link: str) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(link)


def local_addresses(fib_trie: str) -> set[str]:
    """The addresses a ``/proc/net/fib_trie`` text holds as local (``/32 host LOCAL``);
    pure."""
    lines = fib_trie.splitlines()
    return {lines[i - 1].split()[-1] for i, line in enumerate(lines)
            if "/32 host LOCAL" in line and i > 0}


def link_in_use(link: str, local: set[str]) -> str | None:
    """An address of ``link`` (the uplink's /30) already local in the peer's netns, or
    None; pure. Two uplinks on one /30 in one namespace route each other's replies to the
    wrong router."""
    for a in local:
        try:
            if ipaddress.IPv4Address(a) in _link(link):
                return a
        except ValueError:
            continue
    return None


def _veth(router_rt: Netlink, *, peer_netns_fd: int, peer_ifname: str, link: str,
          link6: str | None = None) -> None:
    """Create the veth (router end ``dsu0``, peer ``peer_ifname`` inside ``peer_netns_fd``),
    address and raise both ends, and route the router's default via the peer (``link6``:
    for IPv6 too, over that /126). Refused when the link's /30 is in use in the peer's
    netns already (another edge's uplink)."""
    net = _link(link)
    peer_ip, router_ip = net.network_address + 1, net.network_address + 2
    deadline = time.monotonic() + LINK_FREE_WAIT_S
    while True:
        with netns.entered(peer_netns_fd), open("/proc/thread-self/net/fib_trie") as f:
            used = link_in_use(link, local_addresses(f.read()))
        if used is None or time.monotonic() > deadline:
            break
        # a router closed just before (a restart) loses its veth in the kernel's
        # asynchronous netns cleanup: its peer's address goes a moment later
        time.sleep(0.05)
    if used is not None:
        raise BackendError(
            f"the uplink link {link} is in use where its peer {peer_ifname} would go "
            f"({used} is an address there already: another edge's uplink?); give each "
            "edge of a host its own (dsec edge --net-link CIDR; dsec up does)")
    seq = router_rt.next_seq(4)
    router_rt.request(rtwire.messages(
        rtwire.veth_pair(seq, name=UPLINK_IFNAME, index=UPLINK_IFINDEX,
                         peer=peer_ifname, peer_index=0,  # the kernel picks it
                         peer_netns_fd=peer_netns_fd),
        rtwire.addr_add(seq + 1, UPLINK_IFINDEX, router_ip, net.prefixlen),
        rtwire.link_up(seq + 2, UPLINK_IFINDEX),
        rtwire.default_route(seq + 3, peer_ip, UPLINK_IFINDEX),
    ), [seq, seq + 1, seq + 2, seq + 3], "router uplink")
    net6 = None if link6 is None else ipaddress.IPv6Network(link6)
    if net6 is not None:
        s6 = router_rt.next_seq(2)
        router_rt.request(rtwire.messages(
            rtwire.addr_add(s6, UPLINK_IFINDEX, net6.network_address + 2, net6.prefixlen),
            rtwire.default_route(s6 + 1, net6.network_address + 1, UPLINK_IFINDEX),
        ), [s6, s6 + 1], "router uplink (IPv6)")
    peer_rt = Netlink.route(peer_netns_fd)
    try:
        index = _ifindex_in(peer_netns_fd, peer_ifname)
        n = 2 if net6 is None else 3
        s = peer_rt.next_seq(n)
        msgs = [rtwire.addr_add(s, index, peer_ip, net.prefixlen),
                rtwire.link_up(s + 1, index)]
        if net6 is not None:
            msgs.append(rtwire.addr_add(s + 2, index, net6.network_address + 1,
                                        net6.prefixlen))
        peer_rt.request(rtwire.messages(*msgs), list(range(s, s + n)),
                        f"uplink peer {peer_ifname}")
    finally:
        peer_rt.close()


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
    link: str = DEFAULT_LINK
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
        return _link(self.link).network_address + 1

    @property
    def router_ip(self) -> ipaddress.IPv4Address:
        return _link(self.link).network_address + 2

    @property
    def prefixlen(self) -> int:
        return _link(self.link).prefixlen

    def attach(self, router_rt: Netlink, *, ipv6: bool = False) -> None:
        _veth(router_rt, peer_netns_fd=self.peer_netns_fd, peer_ifname=self.peer_ifname,
              link=self.link, link6=self.link6 if ipv6 else None)

    def adopt(self) -> None:
        """Nothing: the veth kept with a reopened router is all there is."""

    def detach(self) -> None:
        """Nothing: the peer goes with the router's netns."""

    def guarded_addresses(self) -> tuple[str, ...]:
        """Nothing: the peer netns is the caller's (a test's internet), not a host."""
        return ()

    def check(self) -> str | None:
        """Nothing to watch: no object lives outside the router's netns."""
        return None


# ---------------------------------------------------------------------------------------
# host mode: pure parts


def host_ruleset(*, table: str, uplink: str, egress: str, router_ip: str,
                 egress_forwarding_was: int, owner: str = "-") -> str:
    """The host table of a ``host`` uplink, from scratch (libnftables input, one
    transaction). The comment keeps what the egress device's ``forwarding`` was before the
    first dsec uplink on this host changed it (``detach`` of the last one restores it)."""
    t = f"inet {table}"
    lines = [
        f"add table {t}",
        f"delete table {t}",
        (f'add table {t} {{ comment "dsec uplink {uplink}: egress={egress} '
         f'forwarding_was={egress_forwarding_was} owner={owner}"; }}'),
        # Before DNAT (priority -150 < dstnat): an address of the host is dropped even
        # when a port-forwarding rule (Docker's) would have rewritten it.
        f"add chain {t} pre {{ type filter hook prerouting priority -150; policy accept; }}",
        (f'add rule {t} pre iifname "{uplink}" '
         "fib daddr type { local, broadcast, multicast, anycast } counter drop"),
        f"add chain {t} forward {{ type filter hook forward priority 0; policy accept; }}",
        f'add rule {t} forward iifname "{uplink}" oifname "{egress}" accept',
        f'add rule {t} forward iifname "{egress}" oifname "{uplink}" ct state established,related accept',
        f'add rule {t} forward iifname "{uplink}" counter drop',
        f'add rule {t} forward oifname "{uplink}" counter drop',
    ]
    if egress_forwarding_was == 0:
        # The egress device forwards only because of dsec: nothing but dsec's replies.
        lines.append(f'add rule {t} forward iifname "{egress}" oifname != "dsu*" counter drop')
    lines += [
        f"add chain {t} post {{ type nat hook postrouting priority srcnat; }}",
        f'add rule {t} post ip saddr {router_ip} oifname "{egress}" masquerade',
    ]
    return "\n".join(lines) + "\n"


def _objects(ruleset: Mapping[str, Any], kind: str) -> list[dict[str, Any]]:
    return [o[kind] for o in ruleset.get("nftables", ()) if isinstance(o, dict) and kind in o]


def _names_device(rule: Mapping[str, Any], key: str, ifname: str) -> bool:
    """Does ``rule`` match ``meta <key> == ifname`` and accept?"""
    exprs = rule.get("expr") or []
    matched = any(
        isinstance(e, dict) and "match" in e
        and e["match"].get("left") == {"meta": {"key": key}}
        and e["match"].get("right") == ifname and e["match"].get("op") in ("==", "in")
        for e in exprs)
    return matched and any(isinstance(e, dict) and "accept" in e for e in exprs)


def blocking_forward_chains(ruleset: Mapping[str, Any], *, uplink: str,
                            own_table: str) -> list[tuple[str, str, str]]:
    """Forward-hook base chains with policy drop that would drop the uplink's traffic:
    ``(family, table, chain)`` each, those of dsec's own tables and those that already
    accept the uplink both ways (``iifname`` and ``oifname`` accept rules) excluded."""
    rules = _objects(ruleset, "rule")
    out = []
    for c in _objects(ruleset, "chain"):
        if c.get("hook") != "forward" or c.get("policy") != "drop":
            continue
        if c.get("table") == own_table:
            continue
        mine = [r for r in rules if (r.get("family"), r.get("table"), r.get("chain"))
                == (c.get("family"), c.get("table"), c.get("name"))]
        if (any(_names_device(r, "iifname", uplink) for r in mine)
                and any(_names_device(r, "oifname", uplink) for r in mine)):
            continue
        out.append((str(c.get("family")), str(c.get("table")), str(c.get("name"))))
    return out


def forward_fix(chains: Iterable[tuple[str, str, str]], uplink: str) -> str:
    """The message of a failed forward check: the chains and the rules to add."""
    lines = []
    for fam, table, chain in chains:
        lines.append(f"  nft insert rule {fam} {table} {chain} iifname \"{uplink}\" accept")
        lines.append(f"  nft insert rule {fam} {table} {chain} oifname \"{uplink}\" "
                     "ct state established,related accept")
    names = ", ".join(f"{f} {t} {c}" for f, t, c in chains)
    return (f"the host has a forward chain with policy drop ({names}): it would drop every "
            f"packet of the sandboxes' uplink {uplink}. Let the uplink through it first "
            "(with iptables: iptables -I FORWARD -i " + uplink + " -j ACCEPT; iptables -I "
            "FORWARD -o " + uplink + " -m conntrack --ctstate ESTABLISHED,RELATED -j "
            "ACCEPT; Docker: chain DOCKER-USER), e.g.:\n" + "\n".join(lines))


def dsec_tables(ruleset: Mapping[str, Any]) -> list[str]:
    """Names of the ``inet dsec_*`` tables in a JSON listing."""
    return [str(t.get("name")) for t in _objects(ruleset, "table")
            if t.get("family") == "inet" and str(t.get("name", "")).startswith(HOST_TABLE_PREFIX)]


def forwarding_was(listings: Mapping[str, str], *, egress: str,
                   own_table: str) -> int | None:
    """What the egress device forwarded before the first dsec uplink changed it, as the
    comments of the dsec tables (``{name: its plain listing}``) record it: this node's own
    (stale, after a crash) first, then any other's. None: no table records ``egress``."""
    order = sorted(listings, key=lambda n: n != own_table)
    for name in order:
        m = _WAS.search(listings[name])
        if m and m.group(1) == egress:
            return int(m.group(2))
    return None


def default_route_device(proc_net_route: str) -> str | None:
    """The device of the IPv4 default route in a ``/proc/net/route`` text (lowest
    metric), or None."""
    best: tuple[int, str] | None = None
    for line in proc_net_route.splitlines()[1:]:
        f = line.split()
        if len(f) >= 8 and f[1] == "00000000" and f[7] == "00000000":
            metric = int(f[6])
            if best is None or metric < best[0]:
                best = (metric, f[0])
    return None if best is None else best[1]


# ---------------------------------------------------------------------------------------
# host mode: the shell


@dataclass(slots=True)
class HostUplink:
    """The router's uplink into the host netns held by ``host_netns_fd`` (production: the
    edge's own, ``netns.current_netns()``; tests: a netns that plays the host).

    ``egress`` is the device traffic leaves the host by (default: the one of the host's
    IPv4 default route, read at attach). What is on the host is the state: ``detach``
    reads the table's record (what the egress device forwarded before), so it undoes a
    previous process's uplink as well as this one's.
    """

    host_netns_fd: int
    node: str
    egress: str | None = None
    link: str = DEFAULT_LINK
    #: what makes this router unique on the host (the pinned router's path; "" for a
    #: router held by its process only): part of the device and table names
    owner: str = ""
    #: the egress device in use (after attach/adopt)
    _egress_dev: str | None = field(default=None, init=False)
    #: what the egress device forwarded before dsec, known before the table records it
    _restore_to: int | None = field(default=None, init=False)
    #: the peer was taken down by :meth:`check` (a guard it could not restore)
    _down: bool = field(default=False, init=False)
    #: attach found another live router's link of our name: nothing here is ours, so
    #: ``detach`` (the router's close after the failed attach) leaves the host alone
    _refused: bool = field(default=False, init=False)

    @property
    def peer_ifname(self) -> str:
        return uplink_ifname(self.node, self.owner)

    @property
    def table(self) -> str:
        return host_table_name(self.node, self.owner)

    @property
    def peer_ip(self) -> ipaddress.IPv4Address:
        return _link(self.link).network_address + 1

    @property
    def router_ip(self) -> ipaddress.IPv4Address:
        return _link(self.link).network_address + 2

    @property
    def egress_device(self) -> str | None:
        """The egress device in use (after attach)."""
        return self._egress_dev

    @property
    def peer_ip6(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Network(HOST_LINK6).network_address + 1

    @property
    def router_ip6(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Network(HOST_LINK6).network_address + 2

    def has_ipv6(self) -> bool:
        """False: sandboxes get no IPv6 through the host uplink (``--net-ipv6 auto``
        leaves it off). Routing it would take per-device IPv6 ``forwarding=1`` on the
        egress device, which makes the kernel ignore router advertisements there
        (``accept_ra=1``): a host configured by SLAAC would lose its default route.
        Doing it safely (``accept_ra=2`` first, NAT66 in the host table) is left for later;
        fail closed meanwhile."""
        return False

    def changes(self) -> str:
        """What attach changes on the host, for the edge's log."""
        egress = self._egress_dev
        if egress is None:
            try:
                egress = self._egress(self.egress)
            except BackendError:
                egress = "?"
        return (f"host uplink: veth {self.peer_ifname} ({self.peer_ip}/"
                f"{_link(self.link).prefixlen}), nft table inet {self.table} (drops the "
                "uplink's packets to any host address; forwards it out of "
                f"{egress} only, masqueraded), sysctl "
                f"net.ipv4.conf.{{{self.peer_ifname},{egress}}}.forwarding=1"
                "; undone when the router goes")

    def _read_sysctl(self, path: str) -> str:
        with netns.entered(self.host_netns_fd), open(f"/proc/sys/{path}") as f:
            return f.read().strip()

    def attach(self, router_rt: Netlink, *, ipv6: bool = False) -> None:
        """Make the veth and the host's objects (after a crash: replacing what the
        crashed run left)."""
        if ipv6:
            raise BackendError("IPv6 is not routed through the host uplink (see "
                               "HostUplink.has_ipv6); run the edge with --net-ipv6 off")
        self._refuse_live_link()  # before anything of the host is touched
        try:
            self._prepare_host(router_rt)
        except BaseException:
            self.detach()
            raise

    def adopt(self) -> None:
        """A router kept from a previous edge of this node still has its uplink veth:
        check the host again and put the table and sysctls in place (idempotent)."""
        self._prepare_host(None)

    def _prepare_host(self, router_rt: Netlink | None) -> None:
        nft = Nft(self.host_netns_fd, json=True)
        try:
            uplink = self.peer_ifname
            ruleset = json.loads(nft("list ruleset") or "{}")
            blocking = blocking_forward_chains(ruleset, uplink=uplink, own_table=self.table)
            if blocking:
                raise BackendError(forward_fix(blocking, uplink))
            egress = self._egress(self.egress)
            now = int(self._read_sysctl(f"net/ipv4/conf/{egress}/forwarding"))
            was = forwarding_was(self._listings(ruleset), egress=egress, own_table=self.table)
            self._restore_to = now if was is None else was
            self._egress_dev = egress
            # The table first (it matches the uplink by name, before the link exists):
            # no packet from the uplink ever meets the host without it.
            nft(host_ruleset(table=self.table, uplink=uplink, egress=egress,
                             router_ip=str(self.router_ip),
                             egress_forwarding_was=self._restore_to,
                             owner=owner_tag(self.owner)))
            netns.write_sysctl(self.host_netns_fd, f"net/ipv4/conf/{egress}/forwarding", "1")
            if router_rt is not None:
                _veth(router_rt, peer_netns_fd=self.host_netns_fd, peer_ifname=uplink,
                      link=self.link)
            netns.write_sysctl(self.host_netns_fd, f"net/ipv4/conf/{uplink}/forwarding", "1")
        finally:
            nft.close()
        log.info("%s", self.changes())

    def guarded_addresses(self) -> tuple[str, ...]:
        """The host's own IPv4 addresses (every local address of its netns but loopback,
        which NEVER4 holds), for the router's never-reachable set: the second layer
        beside the host table's ``fib daddr type local`` drop, which a host firewall
        reload (``flush ruleset``) removes (REDTEAM-14b #3). Read from the kernel's local
        fib (what ``fib daddr type local`` itself consults); the router re-reads it on
        every watch (:meth:`Router.watch_uplink`), so an address added later joins."""
        with netns.entered(self.host_netns_fd), open("/proc/thread-self/net/fib_trie") as f:
            local = local_addresses(f.read())
        out = []
        for a in local:
            try:
                ip = ipaddress.IPv4Address(a)
            except ValueError:
                continue
            if not ip.is_loopback and ip not in _link(self.link):
                out.append(str(ip))
        return tuple(sorted(out, key=lambda a: ipaddress.IPv4Address(a)))

    def check(self) -> str | None:
        """The host-side objects another program may have removed since attach: this
        node's table (a firewall reload's ``flush ruleset``), the forwarding sysctls
        (``sysctl --system``), and a forward chain with policy drop added later (Docker
        started after the edge). What was missing is put back (the table, the sysctls)
        and said (returned, logged); when it cannot be (a blocking chain), the uplink
        peer is taken down - the sandboxes lose egress, never the host's guard - until a
        later check finds it right again. None: all in place."""
        nft = Nft(self.host_netns_fd, json=True)
        try:
            ruleset = json.loads(nft("list ruleset") or "{}")
        finally:
            nft.close()
        wrong = []
        if self.table not in dsec_tables(ruleset):
            wrong.append(f"host table inet {self.table} gone")
        egress = self._egress_dev
        for dev in (self.peer_ifname, egress):
            if dev is None:
                continue
            try:
                if self._read_sysctl(f"net/ipv4/conf/{dev}/forwarding") != "1":
                    wrong.append(f"{dev} forwarding reset")
            except OSError:
                continue
        blocking = blocking_forward_chains(ruleset, uplink=self.peer_ifname,
                                           own_table=self.table)
        if not wrong and not blocking and not self._down:
            return None
        try:
            self._prepare_host(None)
        except (BackendError, OSError) as exc:
            was_down = self._down
            self._set_peer_up(False)
            what = (f"host uplink {self.peer_ifname} taken down ({'; '.join(wrong) or 'check'}"
                    f", cannot restore: {exc})")
            if not was_down:  # said once, not every poll
                log.error("%s", what)
                return what
            return None
        if self._down:
            self._set_peer_up(True)
            wrong.append("uplink brought back up")
        what = f"host uplink {self.peer_ifname} restored: {'; '.join(wrong)}"
        log.warning("%s", what)
        return what

    def _set_peer_up(self, up: bool) -> None:
        try:
            index = _ifindex_in(self.host_netns_fd, self.peer_ifname)
        except OSError:
            return
        rt = Netlink.route(self.host_netns_fd)
        try:
            seq = rt.next_seq()
            msg = rtwire.link_up(seq, index) if up else rtwire.link_down(seq, index)
            rt.request(msg, [seq], f"set uplink {self.peer_ifname} {'up' if up else 'down'}")
        finally:
            rt.close()
        self._down = not up

    def _egress(self, egress: str | None) -> str:
        if egress is None:
            with netns.entered(self.host_netns_fd), open("/proc/thread-self/net/route") as f:
                egress = default_route_device(f.read())
            if egress is None:
                raise BackendError(
                    "the host has no IPv4 default route to send the sandboxes' traffic out "
                    "of: name the egress device (dsec edge --net-egress DEV)")
        if not _IFNAME_OK.fullmatch(egress) or egress in (".", ".."):
            raise BackendError(f"egress device name {egress!r} is not one dsec can use in "
                               "an nft rule (letters, digits, _ . : @ -; at most 15)")
        try:
            with netns.entered(self.host_netns_fd):
                socket.if_nametoindex(egress)
        except OSError as exc:
            raise BackendError(f"egress device {egress!r} does not exist on the host "
                               "(dsec edge --net-egress DEV)") from exc
        return egress

    def _listings(self, ruleset: Mapping[str, Any]) -> dict[str, str]:
        """The plain listing of every dsec table (JSON output leaves out table comments
        in nftables 1.0.6)."""
        names = dsec_tables(ruleset)
        if not names:
            return {}
        text = Nft(self.host_netns_fd)
        try:
            out = {}
            for n in names:
                with contextlib.suppress(BackendError):  # gone meanwhile
                    out[n] = text(f"list table inet {n}")
            return out
        finally:
            text.close()

    def _refuse_live_link(self) -> None:
        """A link of our name on the host at attach is never deleted: a veth goes with
        its peer's netns, so one that stays has a live router behind it - another edge
        with this node id and owner (two clusters with node ``edge-0`` and no state dir,
        or the same state dir twice). A router that just closed (a restart) loses its
        link in the kernel's asynchronous netns cleanup: wait for that a moment first."""
        deadline = time.monotonic() + LINK_FREE_WAIT_S
        while True:
            try:
                with netns.entered(self.host_netns_fd):
                    socket.if_nametoindex(self.peer_ifname)
            except OSError:
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self._refused = True
        raise BackendError(
            f"the host already has the uplink link {self.peer_ifname} of node {self.node!r}"
            f" (owner {self.owner or 'none: no state dir'}), held by a live router: another"
            " edge with the same node id runs on this host. dsec does not remove it; stop "
            "that edge, or give this one its own --node-id or --state-dir")

    def _remove_stale_link(self, uplink: str) -> None:
        """A link of our name left by a crashed run of this node (the name is ours)."""
        try:
            with netns.entered(self.host_netns_fd):
                index = socket.if_nametoindex(uplink)
        except OSError:
            return
        self._del_link(index)

    def _del_link(self, index: int) -> None:
        rt = Netlink.route(self.host_netns_fd)
        try:
            seq = rt.next_seq()
            rt.request(rtwire.link_del(seq, index), [seq], f"delete uplink {self.peer_ifname}")
        finally:
            rt.close()

    def detach(self) -> None:
        """Remove this node's table and veth from the host and put the egress device's
        ``forwarding`` back to what the table recorded (unless another dsec table on the
        same device still needs it). Each step on its own: one failing does not keep the
        rest in place. Nothing after a refused attach: those objects are another
        router's."""
        if self._refused:
            return
        errors: list[str] = []
        nft = Nft(self.host_netns_fd, json=True)
        try:
            listings = self._listings(json.loads(nft("list tables") or "{}"))
            mine = listings.pop(self.table, None)
            m = _WAS.search(mine or "")
            egress, was = ((m.group(1), int(m.group(2))) if m
                           else (self._egress_dev, self._restore_to))
            if mine is not None:
                try:
                    nft(f"delete table inet {self.table}")
                except BackendError as exc:
                    errors.append(str(exc))
            try:
                self._remove_stale_link(self.peer_ifname)
            except BackendError as exc:
                errors.append(str(exc))
            if egress is not None and was is not None and forwarding_was(
                    listings, egress=egress, own_table=self.table) is None:
                # the last dsec uplink on this device
                try:
                    netns.write_sysctl(self.host_netns_fd,
                                       f"net/ipv4/conf/{egress}/forwarding", str(was))
                except OSError as exc:
                    errors.append(f"restore {egress} forwarding={was}: {exc}")
            self._restore_to = None
        finally:
            nft.close()
        if errors:
            log.warning("host uplink teardown incomplete: %s", "; ".join(errors))


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
