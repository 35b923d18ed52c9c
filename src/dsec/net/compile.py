"""From an egress policy to what enforces it: the per-slot set elements of plan-14 §4.2
and the name rules of the DNS resolver. Pure (no kernel, no I/O): the router loads what
this returns in one netlink batch, and an update loads only when :func:`diff` says the
compiled form changed (so a retried ``network_update`` cuts nothing).

Per slot the router keeps interval sets keyed ``address . protocol . port``: ``a4``/``a6``
(allowed CIDRs), ``d4``/``d6`` (denied, checked first: deny wins), ``e4`` (east-west
peers this sandbox may reach) and ``f4`` (peers that may reach it). Domains never become
elements here: the resolver answers only :attr:`Compiled.domains` (minus
:attr:`Compiled.deny_domains`) and pins each answer's addresses into the slot's hash
sets (``q``: exact ports, ``r``: all ports) before it answers.

Validation is the policy type's (:meth:`~dsec.wire.netpolicy.NetworkPolicy.validate`):
on a valid policy this raises nothing.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from dsec.wire.netpolicy import (
    NEVER_REACHABLE,
    IPNet,
    NetMode,
    NetworkPolicy,
    Proto,
    Rule,
    parse_rule,
)

__all__ = [
    "ALL_PORTS",
    "Compiled",
    "DomainRule",
    "Elem",
    "NetDiff",
    "compile",
    "diff",
    "ipv6_entries",
    "ipv6_inert_note",
]

#: The port range of an element that names no port. 0 included: a UDP datagram to port
#: 0 is a flow like any other, and "all ports" means all.
ALL_PORTS: Final = (0, 65535)
SET_NAMES: Final = ("a4", "a6", "d4", "d6", "e4")
#: The never-reachable networks of a node with the default pool.
NEVER_NETS: Final[tuple[IPNet, ...]] = tuple(net for net, _ in NEVER_REACHABLE)


@dataclass(frozen=True, slots=True)
class Elem:
    """One element of an interval set keyed ``address . inet_proto . inet_service``:
    the network, one protocol, and an inclusive port range."""

    net: IPNet
    proto: Proto
    ports: tuple[int, int]

    def key(self) -> tuple[int, int, int, str, tuple[int, int]]:
        return (self.net.version, int(self.net.network_address), self.net.prefixlen,
                self.proto, self.ports)

    def __str__(self) -> str:
        lo, hi = self.ports
        return f"{self.net} . {self.proto} . {lo}-{hi}" if lo != hi else \
            f"{self.net} . {self.proto} . {lo}"


@dataclass(frozen=True, slots=True)
class DomainRule:
    """A name rule for the resolver: ``name`` exactly, or (``wildcard``) any name below
    it; answers are pinned for ``protos`` x ``ports`` (None: every port, the ``r`` set)."""

    name: str
    wildcard: bool
    protos: tuple[Proto, ...]
    ports: tuple[int, int] | None

    def matches(self, qname: str) -> bool:
        q = qname.lower().removesuffix(".")
        return q.endswith("." + self.name) if self.wildcard else q == self.name


@dataclass(frozen=True, slots=True)
class Compiled:
    """What one sandbox's policy becomes on its slot. ``sets`` maps each interval set
    of §4.2 (``a4 a6 d4 d6 e4``) to its :class:`Elem`\\ s; ``inbound``: the ``f4`` set,
    peers that may open flows to this sandbox; ``open``: the slot is in the ``open``
    set (any public address); ``peers``: the sandbox ids its ``sandbox:`` entries name
    (``"*"``: any), for the edge to pair east-west flows both sides named."""

    mode: NetMode
    open: bool
    sets: Mapping[str, frozenset[Elem]]
    inbound: frozenset[ipaddress.IPv4Address] = frozenset()
    domains: tuple[DomainRule, ...] = ()
    deny_domains: tuple[DomainRule, ...] = ()
    peers: frozenset[str] = frozenset()
    max_connections: int | None = None
    rate_mbit: int | None = None
    notes: tuple[str, ...] = field(default=(), compare=False)

    def elements(self, name: str) -> list[Elem]:
        """The elements of set ``name``, in a stable order (for batches and goldens)."""
        return sorted(self.sets.get(name, frozenset()), key=Elem.key)

    def resolves(self, qname: str) -> DomainRule | None:
        """The allow rule a query for ``qname`` is answered under (None: refused)."""
        if any(d.matches(qname) for d in self.deny_domains):
            return None
        for d in self.domains:
            if d.matches(qname):
                return d
        return None


def _elems(rule: Rule, net: IPNet) -> list[Elem]:
    ports = rule.ports or ALL_PORTS
    return [Elem(net, p, ports) for p in rule.protos]


def _inside_never(net: IPNet, never: Sequence[IPNet]) -> bool:
    return any(net.version == n.version and net.subnet_of(n)  # type: ignore[arg-type]
               for n in never)


def compile(policy: NetworkPolicy, *, ceiling_deny: Iterable[str] = (),
            never: Sequence[IPNet] = NEVER_NETS,
            peers: Mapping[str, ipaddress.IPv4Address] = {},
            inbound: Iterable[ipaddress.IPv4Address] = ()) -> Compiled:
    """Compile a *valid* ``policy`` (``validate()`` passed) with the ceilings' deny
    entries. ``never``: networks no allow element may fall wholly inside (the node's
    never-reachable set, its own pool included: the router drops them first anyway, so
    such an element is only noted and left out). ``peers``: the addresses of the
    sandboxes this one names that also name it (the edge pairs them); ``inbound``: the
    addresses of peers that name this one and are named by it (the ``f4`` set)."""
    sets: dict[str, set[Elem]] = {n: set() for n in SET_NAMES}
    mode = policy.net_mode
    allow, deny = policy.rules()
    deny = deny + tuple(parse_rule(t, f"ceiling_deny[{i}]")
                        for i, t in enumerate(ceiling_deny))
    notes: list[str] = []
    if mode == "none":
        # loopback only: nothing reachable, so the ceilings' denies have nothing to cut
        return Compiled(mode=mode, open=False, sets={n: frozenset() for n in SET_NAMES})
    domains: list[DomainRule] = []
    deny_domains: list[DomainRule] = []
    named: set[str] = set()
    for rule in allow:
        if rule.kind == "cidr":
            assert rule.net is not None
            if _inside_never(rule.net, never):
                notes.append(f"{rule} is inside this node's never-reachable set: left out")
                continue
            sets["a4" if rule.net.version == 4 else "a6"].update(_elems(rule, rule.net))
        elif rule.kind == "sandbox":
            named.add(rule.host)
            targets = peers.items() if rule.host == "*" else \
                [(rule.host, peers[rule.host])] if rule.host in peers else []
            for _, addr in targets:
                sets["e4"].update(_elems(rule, ipaddress.IPv4Network(addr)))
        else:
            domains.append(DomainRule(rule.host, rule.kind == "wildcard", rule.protos,
                                      rule.ports))
    for rule in deny:
        if rule.kind == "cidr":
            assert rule.net is not None
            sets["d4" if rule.net.version == 4 else "d6"].update(_elems(rule, rule.net))
        elif rule.kind == "sandbox":
            # a denied peer: never paired, whatever the allow side says
            for sid, addr in peers.items():
                if rule.host in ("*", sid):
                    sets["e4"] -= {e for e in sets["e4"]
                                   if e.net == ipaddress.IPv4Network(addr)}
        else:
            deny_domains.append(DomainRule(rule.host, rule.kind == "wildcard", rule.protos,
                                           rule.ports))
    return Compiled(
        mode=mode, open=mode == "open", sets={n: frozenset(v) for n, v in sets.items()},
        inbound=frozenset(inbound),
        domains=tuple(domains), deny_domains=tuple(deny_domains), peers=frozenset(named),
        max_connections=policy.max_connections, rate_mbit=policy.rate_mbit,
        notes=tuple(notes))


def _covered(e: Elem, elems: Iterable[Elem]) -> bool:
    """Some element of ``elems`` admits every flow ``e`` admits."""
    return any(o.proto == e.proto and o.net.version == e.net.version
               and e.net.subnet_of(o.net)  # type: ignore[arg-type]
               and o.ports[0] <= e.ports[0] and e.ports[1] <= o.ports[1] for o in elems)


@dataclass(frozen=True, slots=True)
class NetDiff:
    """What moving a slot from one compiled policy to another changes: per set the
    elements to add and to delete. ``same``: nothing at all (no batch, no generation
    bump, no flow cut); ``cuts``: something was allowed before that may not be now
    (the generation must move so established flows are re-checked)."""

    add: Mapping[str, frozenset[Elem]]
    delete: Mapping[str, frozenset[Elem]]
    same: bool
    cuts: bool


def diff(old: Compiled | None, new: Compiled) -> NetDiff:
    """The change from ``old`` (None: a fresh slot) to ``new``."""
    add: dict[str, frozenset[Elem]] = {}
    delete: dict[str, frozenset[Elem]] = {}
    for name in SET_NAMES:
        before = old.sets.get(name, frozenset()) if old is not None else frozenset()
        after = new.sets.get(name, frozenset())
        if after - before:
            add[name] = after - before
        if before - after:
            delete[name] = before - after
    same = old is not None and not add and not delete and old == new
    cuts = old is not None and not same and (
        any(not _covered(e, new.sets.get(n, frozenset()))
            for n in ("a4", "a6", "e4") for e in delete.get(n, ()))
        or bool(old.inbound - new.inbound)
        or any(add.get(n) for n in ("d4", "d6"))
        or (old.open and not new.open)
        or set(old.domains) - set(new.domains) != set()
        or set(new.deny_domains) - set(old.deny_domains) != set()
        or (new.max_connections or 1 << 30) < (old.max_connections or 1 << 30))
    return NetDiff(add=add, delete=delete, same=same, cuts=cuts)


def ipv6_entries(policy: NetworkPolicy) -> tuple[str, ...]:
    """The policy's IPv6 CIDR entries (allow and deny), as written canonically."""
    allow, deny = policy.rules()
    return tuple(str(r) for r in (*allow, *deny)
                 if r.kind == "cidr" and r.net is not None and r.net.version == 6)


def ipv6_inert_note(policy: NetworkPolicy, node: str) -> str:
    """"" or what a node without IPv6 tells the caller about the policy's v6 entries:
    accepted (a policy does not depend on the node it lands on) but inert there, since
    every v6 packet of its sandboxes is dropped. Never a silent no-op."""
    if policy.net_mode == "none":
        return ""
    v6 = ipv6_entries(policy)
    if not v6:
        return ""
    shown = ", ".join(v6[:5]) + (f" and {len(v6) - 5} more" if len(v6) > 5 else "")
    return (f"node {node} has no IPv6 for sandboxes (dsec edge --net-ipv6 off, or an "
            f"uplink without IPv6): the IPv6 entries {shown} are accepted but inert here "
            "(every IPv6 packet is dropped); IPv4 entries and names answer over IPv4")
