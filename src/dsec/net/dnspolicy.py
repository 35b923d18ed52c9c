"""What the edge's resolver answers, and what it pins (pure: no sockets, injected clock).

The resolver (net/resolver.py) is the only DNS server a sandbox on a slot can reach: every
packet to port 53 is DNAT'ed to it (plan-14 §4.3). For each query it asks :func:`decide`:

- only ``A``/``AAAA`` for names the sandbox's policy allows (and no deny entry matches);
  anything else is ``REFUSED`` and **never forwarded**, so unlisted names cannot carry
  data out (DNS tunnelling) and the upstream never learns them;
- ``AAAA`` is answered like ``A`` on a node whose slots have IPv6 (``ipv6``), and the
  v6 addresses pinned the same way; elsewhere NOERROR with no data (clients fall back at
  once), in every mode;
- answers are filtered: addresses that are never reachable (loopback, link-local with the
  cloud metadata address, multicast, the pool, the node's own) are dropped always,
  private ones unless a CIDR entry of the policy names them (DNS rebinding); nothing left
  is ``REFUSED``;
- each kept address is **pinned** into the sandbox's sets for the rule's protocols and
  ports before the answer is sent (the first ``connect()`` never races the pin), for
  ``max(TTL, 60 s) + 30 s`` capped at an hour, and re-pinned only when the kernel's copy
  would expire first (a cache hit usually pins nothing).

Mode ``open`` forwards every name and type (an open sandbox reaches any public resolver
anyway) but still filters answers, and pins nothing (any public address is reachable).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from dsec.net.nftwire import Addr, Pin4, Proto
from dsec.wire.netpolicy import embedded_ipv4

__all__ = [
    "AAAA",
    "MAX_NAME_BYTES",
    "A",
    "Answer",
    "DnsPolicy",
    "Forward",
    "NameRule",
    "PinBook",
    "Refuse",
    "TokenBucket",
    "decide",
    "filter_answer",
    "pins_for",
]

A: Final = 1
AAAA: Final = 28
MAX_NAME_BYTES: Final = 253
MAX_LABEL_BYTES: Final = 63
PIN_FLOOR_S: Final = 60.0
PIN_GRACE_S: Final = 30.0
PIN_CAP_S: Final = 3600.0


@dataclass(frozen=True, slots=True)
class NameRule:
    """A name the sandbox may resolve: ``name`` exactly, or (``wildcard``) any name
    below it; answers are pinned for ``protos`` x ``ports`` (None: every port)."""

    name: str
    wildcard: bool = False
    protos: tuple[Proto, ...] = ("tcp", "udp")
    ports: tuple[int, int] | None = None

    def matches(self, qname: str) -> bool:
        q = qname.lower().removesuffix(".")
        return q.endswith("." + self.name) if self.wildcard else q == self.name


@dataclass(frozen=True, slots=True)
class DnsPolicy:
    """The resolver's view of one sandbox's policy."""

    allow: tuple[NameRule, ...] = ()
    deny: tuple[NameRule, ...] = ()
    open: bool = False
    #: private networks the policy names by CIDR (answers inside them are kept)
    private_ok: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()


@dataclass(frozen=True, slots=True)
class Refuse:
    rcode: Literal["REFUSED", "SERVFAIL", "NOERROR"]
    why: str


@dataclass(frozen=True, slots=True)
class Forward:
    """Ask the upstream (or the cache) for ``name``/``qtype``; ``rules``: the matching
    allow rules whose protocols/ports the answer is pinned for."""

    name: str
    qtype: int
    rules: tuple[NameRule, ...]


@dataclass(frozen=True, slots=True)
class Answer:
    addresses: tuple[Addr, ...]
    ttl: int
    pins: tuple[Pin4, ...]


def _name_ok(qname: str) -> str:
    """"" if the name is well formed, else why not."""
    q = qname.removesuffix(".")
    if len(q.encode()) > MAX_NAME_BYTES:
        return f"name longer than {MAX_NAME_BYTES} bytes"
    if any(len(label.encode()) > MAX_LABEL_BYTES or not label for label in q.split(".")):
        return f"a label is empty or longer than {MAX_LABEL_BYTES} bytes"
    return ""


def decide(policy: DnsPolicy, qname: str, qtype: int, *, ipv6: bool = False
           ) -> Refuse | Forward:
    """First step for a query: refuse it, or forward it (cache or upstream). ``ipv6``:
    the asking sandbox's slot has IPv6 (else AAAA is answered empty, in every mode: an
    address it cannot reach would only cost it a connect timeout)."""
    bad = _name_ok(qname)
    if bad:
        return Refuse("REFUSED", bad)
    if any(r.matches(qname) for r in policy.deny):
        return Refuse("REFUSED", "the name matches a deny entry")
    if policy.open:
        if qtype == AAAA and not ipv6:
            return Refuse("NOERROR", "no IPv6 on this node")
        return Forward(qname.lower(), qtype, ())
    rules = tuple(r for r in policy.allow if r.matches(qname))
    if not rules:
        return Refuse("REFUSED", "the name is not in the policy")
    if qtype == AAAA and not ipv6:
        return Refuse("NOERROR", "no IPv6 on this node")
    if qtype not in (A, AAAA):
        return Refuse("REFUSED", f"query type {qtype} is not answered (only A and AAAA)")
    return Forward(qname.lower(), qtype, rules)


Net = ipaddress.IPv4Network | ipaddress.IPv6Network


def filter_answer(
    addresses: Iterable[Addr], *, never: Sequence[Net], private: Sequence[Net],
    private_ok: Sequence[Net],
) -> tuple[Addr, ...]:
    """The answer's addresses a sandbox may be given (rebinding filter), either family
    (an address is only ever compared with networks of its own; an IPv6 address that
    spells an IPv4 one, NAT64/6to4/Teredo/IPv4-compatible, with ``never`` IPv4 too). Integer range checks
    (``address in network`` objects cost ~6 ms for a 300-address answer, on the loop,
    per cached query)."""
    def ranges(nets: Sequence[Net]) -> list[tuple[int, int, int]]:
        return [(n.version, int(n.network_address), int(n.broadcast_address)) for n in nets]
    nv, pv, ok = ranges(never), ranges(private), ranges(private_ok)
    out: list[Addr] = []
    seen: set[tuple[int, int]] = set()
    for a in addresses:
        v, x = a.version, int(a)
        if (v, x) in seen or any(w == v and lo <= x <= hi for w, lo, hi in nv):
            continue
        if v == 6 and any(  # an IPv4 it spells (NAT64, 6to4, Teredo) judged as IPv4
                w == 4 and int(e.network_address) <= hi and lo <= int(e.broadcast_address)
                for e in embedded_ipv4(ipaddress.IPv6Network(a)) for w, lo, hi in nv):
            continue
        if any(w == v and lo <= x <= hi for w, lo, hi in pv) and not any(
                w == v and lo <= x <= hi for w, lo, hi in ok):
            continue
        seen.add((v, x))
        out.append(a)
    return tuple(out)


def pin_seconds(ttl: float) -> float:
    return min(max(ttl, PIN_FLOOR_S) + PIN_GRACE_S, PIN_CAP_S)


def pins_for(addresses: Iterable[Addr], rules: Iterable[NameRule],
             ttl: float) -> list[Pin4]:
    """The set elements that make ``addresses`` reachable as the rules say."""
    ms = int(pin_seconds(ttl) * 1000)
    out: list[Pin4] = []
    for a in addresses:
        for r in rules:
            for proto in r.protos:
                if r.ports is None:
                    out.append(Pin4(a, proto, None, ms))
                else:
                    lo, hi = r.ports
                    out.extend(Pin4(a, proto, p, ms) for p in range(lo, hi + 1))
    return list(dict.fromkeys(out))


@dataclass
class PinBook:
    """When each pin of each slot expires in the kernel (as far as we set it), so a
    repeated answer re-pins only what would expire before the answer's TTL runs out."""

    expiry: dict[tuple[int, Addr, Proto, int | None], float] = field(
        default_factory=dict)

    def needed(self, slot: int, pins: Iterable[Pin4], now: float, ttl: float) -> list[Pin4]:
        out = []
        for p in pins:
            key = (slot, p.address, p.proto, p.port)
            if self.expiry.get(key, 0.0) < now + ttl + 1:
                out.append(p)
        return out

    def pinned(self, slot: int, pins: Iterable[Pin4], now: float) -> None:
        for p in pins:
            self.expiry[(slot, p.address, p.proto, p.port)] = now + p.timeout_ms / 1000

    def forget(self, slot: int) -> None:
        """The slot's pin sets were flushed (recycle)."""
        for key in [k for k in self.expiry if k[0] == slot]:
            del self.expiry[key]

    def count(self, slot: int, now: float) -> int:
        return sum(1 for k, t in self.expiry.items() if k[0] == slot and t > now)


@dataclass
class TokenBucket:
    """``rate`` tokens per second up to ``burst``; injected clock values."""

    rate: float
    burst: float
    tokens: float = -1.0
    at: float = 0.0

    def take(self, now: float, n: float = 1.0) -> bool:
        if self.tokens < 0:
            self.tokens, self.at = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False
