"""A sandbox's egress policy: the types every door decodes, their limits, canonical form
and the project-ceiling check.

A policy is one of three modes: ``"none"`` (loopback only), ``"open"`` (any public
address; private ranges only where an ``allow`` CIDR names them) or ``"policy"`` (only
what ``allow`` names, minus ``deny``). Entries are strings, the form users write and
read back (docs/networking.md)::

    entry := host [":" ports] ["/" proto]
    host  := domain | "*." domain | ipv4 ["/" len] | "[" ipv6 ["/" len] "]"
             | "sandbox:" sandbox-id | "sandbox:*"
    ports := port | port "-" port                  (1..65535)

Like :class:`~dsec.wire.spec.SandboxSpec`, a policy is also a *stored* record (inside
the journaled spec), so it does not validate on decode (a tightened limit must not make
a journal unreadable); the requests that carry it do, in their ``__post_init__``:
``CreateSandbox``/``CreateMany`` through ``spec.validate()``, ``NetworkUpdate`` through
:meth:`NetworkPolicy.validate`, at every door. :meth:`NetworkPolicy.validate` returns the
canonical policy (entries lowercased, punycode, ports and protocol written only when
narrower than all, duplicates dropped), which is what the edge stores and ``get`` shows.

Pure: imports no I/O. The mechanism (nftables sets, the resolver) consumes the parsed
:class:`Rule` objects through :mod:`dsec.net.compile`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Final, Literal, TypeAlias, cast

import msgspec

from dsec.errors import InvalidArgument, PermissionDenied
from dsec.ids import parse_sandbox_id

__all__ = [
    "DEFAULT_NET_POOL",
    "DEFAULT_NET_POOL6",
    "MAX_NET_CONNECTIONS",
    "MAX_NET_DOMAIN_BYTES",
    "MAX_NET_DOMAIN_PORTS",
    "MAX_NET_ENTRY_CHARS",
    "MAX_NET_LABEL_BYTES",
    "MAX_NET_RATE_MBIT",
    "MAX_NET_RULES",
    "NEVER_REACHABLE",
    "PRIVATE_RANGES",
    "IPNet",
    "NetMode",
    "NetworkPolicy",
    "Proto",
    "Rule",
    "RuleKind",
    "Violation",
    "ceiling_deny",
    "check_within",
    "embedded_ipv4",
    "never_reachable_embedded",
    "parse_rule",
    "within",
]

NetMode = Literal["none", "open", "policy"]
# The modes of the release before issue 14, still decoded: "loopback" was the default
# (loopback up, nothing else) and is "none" now; "allowlist" was refused by every
# backend, so no sandbox ever ran with it, and it reads as "policy".
LegacyMode = Literal["loopback", "allowlist"]
_LEGACY: Final[dict[str, NetMode]] = {"loopback": "none", "allowlist": "policy"}
Proto = Literal["tcp", "udp"]
RuleKind = Literal["domain", "wildcard", "cidr", "sandbox"]
IPNet: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network

# Limits (each refusal is InvalidArgument with ``field`` and ``limit``).
MAX_NET_RULES: Final = 256            # entries in allow, and in deny (pipapo sets stay small)
MAX_NET_ENTRY_CHARS: Final = 512      # one entry's text, checked before parsing it
MAX_NET_DOMAIN_BYTES: Final = 253     # a DNS name (RFC 1035), without the trailing dot
MAX_NET_LABEL_BYTES: Final = 63       # one label of it
# A domain's addresses are pinned per port in a hash set (exact ports: 0.006 ms a pin at
# any size, where an interval set cost 0.027-0.293 ms, plan-14 E11), so a domain entry
# spans at most this many ports; wider needs a CIDR or all ports.
MAX_NET_DOMAIN_PORTS: Final = 16
MAX_NET_CONNECTIONS: Final = 65_536   # max_connections: concurrent flows of one sandbox
MAX_NET_RATE_MBIT: Final = 100_000    # rate_mbit: each direction

#: The sandboxes' own address pool by default (an edge's ``--net-pool``): other
#: sandboxes are reached by ``sandbox:`` entries that both sides write, never by address.
DEFAULT_NET_POOL: Final = ipaddress.IPv4Network("10.213.0.0/16")

#: ... and their IPv6 pool (the router's uplink /126 sits inside it, too)
DEFAULT_NET_POOL6: Final = ipaddress.IPv6Network("fd00:d5ec::/48")

_V4 = ipaddress.IPv4Network
_V6 = ipaddress.IPv6Network
#: Never reachable, whatever a policy says (the router drops them before any allow): an
#: ``allow`` entry wholly inside one is refused, since it could never do anything.
NEVER_REACHABLE: Final[tuple[tuple[IPNet, str], ...]] = (
    (_V4("0.0.0.0/8"), "this-network/unspecified"),
    (_V4("127.0.0.0/8"), "loopback"),
    (_V4("169.254.0.0/16"), "metadata/link-local"),
    (_V4("224.0.0.0/3"), "multicast/reserved"),
    # cloud platform endpoints outside link-local (the node's credentials and identity)
    (_V4("168.63.129.16/32"), "Azure platform endpoint (wireserver)"),
    (_V4("100.100.100.200/32"), "Alibaba Cloud metadata"),
    (DEFAULT_NET_POOL, "the sandboxes' own pool; name a sandbox as 'sandbox:<id>'"),
    (_V6("::/128"), "unspecified"),
    (_V6("::1/128"), "loopback"),
    (_V6("fe80::/10"), "link-local"),
    (_V6("fd00:ec2::254/128"), "AWS metadata (IPv6)"),
    (_V6("fd20:ce::254/128"), "GCP metadata (IPv6)"),
    (_V6("ff00::/8"), "multicast"),
    # the local-use NAT64 prefix (RFC 8215): where its IPv4 sits depends on the
    # operator's prefix length (RFC 6052: /32../96), so none of it can be judged
    (_V6("64:ff9b:1::/48"), "local-use NAT64 prefix (its embedded IPv4 cannot be judged)"),
    (DEFAULT_NET_POOL6, ("the sandboxes' own IPv6 pool and uplink; name a sandbox as "
     "'sandbox:<id>'")),
)
#: IPv6 prefixes that carry an IPv4 address (a translator or tunnel on the node's path
#: reaches it): (prefix, first bit of the IPv4 address, XOR mask). Teredo carries two: the
#: server's (bits 32-63) and the client's (bits 96-127, inverted).
_EMBEDDINGS: Final[tuple[tuple[ipaddress.IPv6Network, int, int], ...]] = (
    (_V6("64:ff9b::/96"), 96, 0),                     # NAT64 well-known (RFC 6052)
    (_V6("::/96"), 96, 0),                             # IPv4-compatible (deprecated)
    (_V6("2002::/16"), 16, 0),                         # 6to4 (RFC 3056)
    (_V6("2001::/32"), 32, 0),                         # Teredo server (RFC 4380)
    (_V6("2001::/32"), 96, 0xFFFFFFFF),                # Teredo client (obfuscated)
)


def embedded_ipv4(net: ipaddress.IPv6Network) -> list[ipaddress.IPv4Network]:
    """The IPv4 networks an IPv6 network inside NAT64, 6to4, Teredo or the
    IPv4-compatible prefix reaches (pure): the address bits it fixes, the rest free -
    every IPv4 the embedding could name, so a check against it errs on refusing."""
    out: list[ipaddress.IPv4Network] = []
    for prefix, first, xor in _EMBEDDINGS:
        if not net.overlaps(prefix):
            continue
        if net.prefixlen < prefix.prefixlen:
            # wider than the embedding prefix (``::/1``): like an IPv4 CIDR around a
            # never-reachable range, the router's never6 (which holds the IPv6
            # spellings of every never-reachable IPv4) drops what it must
            continue
        bits = max(0, min(net.prefixlen, first + 32) - first)  # v4 bits the net fixes
        v4 = ((int(net.network_address) >> (96 - first)) & 0xFFFFFFFF) ^ xor
        if xor:  # inverted bits: the fixed ones invert, the free ones stay free
            v4 &= (0xFFFFFFFF << (32 - bits)) & 0xFFFFFFFF if bits else 0
        out.append(_V4((v4, bits), strict=False))
    return out


def never_reachable_embedded(net: ipaddress.IPv6Network) -> str | None:
    """Why ``net`` reaches a never-reachable IPv4 through an embedding, or None."""
    for v4 in embedded_ipv4(net):
        for never, why in NEVER_REACHABLE:
            if isinstance(never, ipaddress.IPv4Network) and v4.overlaps(never):
                return f"it embeds IPv4 {v4}, which covers {never} ({why})"
    return None


#: Private ranges: reachable only where an ``allow`` CIDR names them (mode open included),
#: and a DNS answer pointing into them is refused otherwise (rebinding).
PRIVATE_RANGES: Final[tuple[IPNet, ...]] = (
    _V4("10.0.0.0/8"), _V4("100.64.0.0/10"), _V4("172.16.0.0/12"), _V4("192.168.0.0/16"),
    _V4("198.18.0.0/15"), _V6("fc00::/7"),
)

_ALL_PORTS: Final = (1, 65535)
_LABEL_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_PORTS_RE = re.compile(r"([0-9]{1,5})(?:-([0-9]{1,5}))?")
_NUMERIC_HOST_RE = re.compile(r"[0-9./]+")
_PROTO_RE = re.compile(r"[A-Za-z][A-Za-z0-9-]{0,15}")


@dataclass(frozen=True, slots=True)
class Rule:
    """One parsed entry, what :mod:`dsec.net.compile` and :func:`within` consume.

    ``host``: the domain (``wildcard``: the base after ``*.``), the network's text, or
    the sandbox id (``"*"``: any sandbox). ``ports``: an inclusive range, None = all.
    ``proto``: None = tcp and udp."""

    kind: RuleKind
    host: str
    net: IPNet | None = None
    ports: tuple[int, int] | None = None
    proto: Proto | None = None

    def __str__(self) -> str:
        if self.kind == "wildcard":
            text = f"*.{self.host}"
        elif self.kind == "sandbox":
            text = f"sandbox:{self.host}"
        elif self.kind == "cidr":
            assert self.net is not None
            one = self.net.prefixlen == self.net.max_prefixlen
            addr = str(self.net.network_address) if one else str(self.net)
            text = f"[{addr}]" if self.net.version == 6 else addr
        else:
            text = self.host
        if self.ports is not None:
            lo, hi = self.ports
            text += f":{lo}" if lo == hi else f":{lo}-{hi}"
        if self.proto is not None:
            text += f"/{self.proto}"
        return text

    @property
    def protos(self) -> tuple[Proto, ...]:
        return ("tcp", "udp") if self.proto is None else (self.proto,)

    def port_span(self) -> int:
        lo, hi = self.ports or _ALL_PORTS
        return hi - lo + 1


def _bad(field: str, text: str, why: str, **detail: object) -> InvalidArgument:
    return InvalidArgument(f"{field} {text[:80]!r} {why}", field=field, **detail)


def _domain(field: str, text: str, name: str) -> str:
    """``name`` as a canonical DNS name (lowercase, punycode, no trailing dot)."""
    name = name.removesuffix(".")
    if not name.isascii():
        try:
            name = name.encode("idna").decode("ascii")
        except UnicodeError as exc:
            raise _bad(field, text, f"is not a valid internationalised domain name ({exc})"
                       ) from None
    name = name.lower()
    if len(name) > MAX_NET_DOMAIN_BYTES:
        raise _bad(field, text, f"is {len(name)} bytes long, over the "
                   f"{MAX_NET_DOMAIN_BYTES}-byte limit of a DNS name",
                   size=len(name), limit=MAX_NET_DOMAIN_BYTES)
    labels = name.split(".")
    for label in labels:
        if not label:
            raise _bad(field, text, "has an empty label")
        if len(label) > MAX_NET_LABEL_BYTES:
            raise _bad(field, text, f"has a label of {len(label)} bytes, over the "
                       f"{MAX_NET_LABEL_BYTES}-byte limit", size=len(label),
                       limit=MAX_NET_LABEL_BYTES)
        if "*" in label:
            raise _bad(field, text, "has a '*' inside: a wildcard is one leading '*.' "
                       "before a domain of at least two labels ('*.example.com')")
        if not _LABEL_RE.fullmatch(label):
            raise _bad(field, text, f"has an invalid label {label!r}: labels are letters, "
                       "digits and '-' (not first or last)")
    if len(labels) < 2:
        raise _bad(field, text, "names a single label: write a full domain "
                   "('pypi.org'); use mode 'open' for every public name")
    return name


def _network(field: str, text: str, host: str) -> IPNet:
    try:
        net = ipaddress.ip_network(host, strict=True)
    except ValueError as exc:
        if "host bits set" in str(exc):
            fixed = ipaddress.ip_network(host, strict=False)
            raise _bad(field, text, f"has host bits set: did you mean {fixed}?") from None
        raise _bad(field, text, f"is not a valid IP address or CIDR ({exc})") from None
    if isinstance(net, ipaddress.IPv6Network) and net.network_address.ipv4_mapped is not None:
        raise _bad(field, text, "is an IPv4-mapped IPv6 address: write the IPv4 address")
    return net


def _ports(field: str, text: str, spec: str) -> tuple[int, int] | None:
    m = _PORTS_RE.fullmatch(spec)
    if m is None:
        raise _bad(field, text, f"has an invalid port {spec!r}: write a port (443) or a "
                   "range (8000-8100)")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if not (1 <= lo <= 65535 and 1 <= hi <= 65535):
        raise _bad(field, text, f"has port {lo if not 1 <= lo <= 65535 else hi} out of "
                   "range: ports are 1..65535", limit=65535)
    if lo > hi:
        raise _bad(field, text, f"has the port range {lo}-{hi} backwards: write {hi}-{lo}")
    return None if (lo, hi) == _ALL_PORTS else (lo, hi)


def parse_rule(text: str, field: str = "entry") -> Rule:
    """Parse one entry (the grammar in the module docstring), syntax only: the limits
    that depend on the list or the mode are :meth:`NetworkPolicy.validate`'s. Raises
    :class:`InvalidArgument` naming ``field``."""
    return _parse_rule(text, field)


# Bounded: entries are caller-chosen text (an unbounded cache is a memory leak to feed).
@lru_cache(maxsize=4096)
def _parse_cached(text: str) -> Rule:
    return _parse_rule_uncached(text, "entry")


def _parse_rule(text: str, field: str) -> Rule:
    if not isinstance(text, str):
        raise InvalidArgument(f"{field} must be a string, not {type(text).__name__}",
                              field=field)
    if len(text) > MAX_NET_ENTRY_CHARS:
        raise InvalidArgument(f"{field} is {len(text)} characters long, over the limit of "
                              f"{MAX_NET_ENTRY_CHARS}: {text[:60]!r}...", field=field,
                              size=len(text), limit=MAX_NET_ENTRY_CHARS)
    try:
        return _parse_cached(text)
    except InvalidArgument as exc:
        # parsed once under the neutral name; the error names the caller's field
        raise InvalidArgument(exc.message.replace("entry ", f"{field} ", 1),
                              **{**exc.detail, "field": field}) from None


def _parse_rule_uncached(text: str, field: str) -> Rule:
    if not text.strip():
        raise InvalidArgument(f"{field} is empty: write a domain, a CIDR or "
                              "'sandbox:<id>'", field=field)
    if text != text.strip() or any(c.isspace() for c in text):
        raise _bad(field, text, "contains whitespace")
    rest = text
    proto: Proto | None = None
    head, slash, tail = rest.rpartition("/")
    if slash and _PROTO_RE.fullmatch(tail):
        p = tail.lower()
        if p not in ("tcp", "udp"):
            raise InvalidArgument(
                f"unknown protocol {tail[:20]!r} in {field} {text[:80]!r}: use tcp or udp "
                "(ICMP is never forwarded)", field=field)
        proto = cast(Proto, p)
        rest = head
    ports: tuple[int, int] | None = None
    if rest.lower().startswith("sandbox:"):
        body = rest[len("sandbox:"):]
        sid, colon, port_text = body.partition(":")
        if colon:
            ports = _ports(field, text, port_text)
        if sid != "*":
            try:
                parse_sandbox_id(sid)
            except InvalidArgument:
                raise _bad(field, text, "does not name a sandbox: write 'sandbox:<id>' with "
                           "an id as create returned it (sb-...)") from None
        return Rule("sandbox", sid, None, ports, proto)
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            raise _bad(field, text, "opens '[' without closing it: write IPv6 as "
                       "[2001:db8::1] or [2001:db8::/32]")
        host, after = rest[1:close], rest[close + 1:]
        if after.startswith("/"):        # "[2001:db8::]/32" written outside the brackets
            length, colon, port_text = after[1:].partition(":")
            host = f"{host}/{length}"
        else:
            colon, port_text = after[:1], after[1:]
            if after and colon != ":":
                raise _bad(field, text, "has text after ']' that is not ':ports'")
        if colon:
            ports = _ports(field, text, port_text)
        net = _network(field, text, host)
        if net.version != 6:
            raise _bad(field, text, "puts an IPv4 address in brackets: brackets are for IPv6")
        return Rule("cidr", str(net), net, ports, proto)
    host, colon, port_text = rest.rpartition(":")
    if not colon:
        host, port_text = rest, ""
    elif ":" in host:
        raise _bad(field, text, "looks like an IPv6 address: write it in brackets, "
                   "[2001:db8::1] or [2001:db8::1]:443")
    if colon:
        ports = _ports(field, text, port_text)
    if not host:
        raise _bad(field, text, "has no host before ':'")
    if _NUMERIC_HOST_RE.fullmatch(host):
        net = _network(field, text, host)
        return Rule("cidr", str(net), net, ports, proto)
    if host == "*":
        raise _bad(field, text, "matches every name: use mode 'open' for everything")
    if host.startswith("*."):
        base = _domain(field, text, host[2:])
        if base.count(".") < 1:
            raise _bad(field, text, "covers a whole top-level domain: use mode 'open' for "
                       "everything")
        kind: RuleKind = "wildcard"
        host = base
    else:
        if "*" in host:
            raise _bad(field, text, "has a '*' that is not one leading '*.': wildcards "
                       "cover the subdomains of a domain ('*.example.com')")
        host = _domain(field, text, host)
        kind = "domain"
    return Rule(kind, host, None, ports, proto)


class NetworkPolicy(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True,
                    forbid_unknown_fields=True):
    """A sandbox's egress policy. ``"none"``: loopback only. ``"open"``: any public
    address (never the never-reachable set; private ranges only where an ``allow`` CIDR
    names them). ``"policy"``: only what ``allow`` names, minus ``deny``. The older
    modes still decode: ``"loopback"`` as ``"none"``, ``"allowlist"`` as ``"policy"``.

    ``max_connections``: concurrent flows (None: the node's default, 4,096);
    ``rate_mbit``: bandwidth each direction (None: no cap)."""

    mode: NetMode | LegacyMode = "none"
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    max_connections: int | None = None
    rate_mbit: int | None = None

    def __post_init__(self) -> None:
        legacy = _LEGACY.get(self.mode)
        if legacy is not None:
            msgspec.structs.force_setattr(self, "mode", legacy)

    @classmethod
    def of(cls, value: NetworkPolicy | str | None) -> NetworkPolicy | None:
        """A policy from what callers write: a mode name, a policy, or None (the
        serving side's default)."""
        if value is None or isinstance(value, NetworkPolicy):
            return value
        if isinstance(value, str):
            if value not in ("none", "open", "policy", "loopback", "allowlist"):
                raise InvalidArgument(f"network={value[:40]!r} is not a mode: use 'none', "
                                      "'open' or a NetworkPolicy(mode='policy', allow=...)",
                                      field="network")
            return cls(mode=cast(NetMode, value))
        raise InvalidArgument(f"network must be a mode name or a NetworkPolicy, not "
                              f"{type(value).__name__}", field="network")

    @property
    def net_mode(self) -> NetMode:
        """``mode`` after legacy names were mapped (always one of the three)."""
        return cast(NetMode, self.mode)

    def rules(self) -> tuple[tuple[Rule, ...], tuple[Rule, ...]]:
        """The parsed ``allow`` and ``deny`` entries (syntax only; raises like
        :meth:`validate` on a bad one)."""
        return (tuple(_parse_rule(t, f"network.allow[{i}]") for i, t in enumerate(self.allow)),
                tuple(_parse_rule(t, f"network.deny[{i}]") for i, t in enumerate(self.deny)))

    def validate(self, where: str = "network") -> NetworkPolicy:
        """Check every limit (the ``MAX_NET_*`` constants); raise :class:`InvalidArgument`
        naming the entry (``network.allow[3]``), its text and the fix. Returns the
        canonical policy (self when already canonical).

        A policy that passed is remembered (by value; the outcome depends on nothing
        else, ``where`` only names the field in a refusal): every door and the backend
        validate the same spec again, and a burst of creates with one policy paid
        ~0.2 ms of CPU per create re-parsing a 10-entry policy (pyinstrument,
        ``net_creates_per_s``, the N-F session)."""
        try:
            known = _VALIDATED.get(self)
        except TypeError:  # built by hand with lists (decoding gives tuples): not kept
            return self._validate(where)
        if known is not None:
            return self if known == self else known  # "self when already canonical"
        canonical = self._validate(where)
        if len(_VALIDATED) >= _VALIDATED_KEPT:
            # threads validate too: another may be dropping the same oldest entry
            with contextlib.suppress(RuntimeError, StopIteration, KeyError):
                _VALIDATED.pop(next(iter(_VALIDATED)))
        _VALIDATED[self] = canonical
        return canonical

    def _validate(self, where: str) -> NetworkPolicy:
        mode = self.net_mode
        if mode not in ("none", "open", "policy"):
            raise InvalidArgument(f"{where}.mode={str(mode)[:40]!r} is not a mode: use "
                                  "'none', 'open' or 'policy'", field=f"{where}.mode")
        for name, cap in (("max_connections", MAX_NET_CONNECTIONS),
                          ("rate_mbit", MAX_NET_RATE_MBIT)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not 1 <= v <= cap):
                raise InvalidArgument(f"{where}.{name}={v!r} must be within 1..{cap}, or "
                                      "null", field=f"{where}.{name}", limit=cap)
        lists = {"allow": self.allow, "deny": self.deny}
        canon: dict[str, tuple[str, ...]] = {}
        for which, entries in lists.items():
            field = f"{where}.{which}"
            if len(entries) > MAX_NET_RULES:
                raise InvalidArgument(
                    f"{field} has {len(entries)} entries, over the limit of {MAX_NET_RULES}; "
                    "use CIDRs or wildcards", field=field, size=len(entries),
                    limit=MAX_NET_RULES)
            if entries and mode == "none":
                raise InvalidArgument(
                    f"{field} has entries under mode 'none' (loopback only): use mode "
                    "'policy' to reach what they name", field=field)
            out: dict[str, None] = {}
            for i, text in enumerate(entries):
                f = f"{field}[{i}]"
                rule = _parse_rule(text, f)
                _check_rule(rule, which, mode, f, text)
                out.setdefault(str(rule))
            canon[which] = tuple(out)
        if canon["allow"] == self.allow and canon["deny"] == self.deny:
            return self
        return msgspec.structs.replace(self, allow=canon["allow"], deny=canon["deny"])

    def __str__(self) -> str:
        if self.net_mode != "policy" and not self.allow and not self.deny:
            return self.net_mode
        parts = [f"mode {self.net_mode}"]
        if self.allow:
            parts.append("allow: " + ", ".join(self.allow))
        if self.deny:
            parts.append("deny: " + ", ".join(self.deny))
        return "; ".join(parts)


#: Policies that passed validate(), with their canonical form (bounded: oldest out first).
_VALIDATED: dict[NetworkPolicy, NetworkPolicy] = {}
_VALIDATED_KEPT: Final = 1024


def _check_rule(rule: Rule, which: str, mode: NetMode, field: str, text: str) -> None:
    """The limits of one entry that depend on where it stands (allow/deny, the mode)."""
    if rule.kind in ("domain", "wildcard") and rule.ports is not None:
        span = rule.port_span()
        if span > MAX_NET_DOMAIN_PORTS:
            raise _bad(field, text, f"spans {span} ports; a domain entry takes one port, a "
                       f"range of at most {MAX_NET_DOMAIN_PORTS}, or none (all ports); use a "
                       "CIDR for a wider range", size=span, limit=MAX_NET_DOMAIN_PORTS)
    if which == "allow" and rule.net is not None:
        if rule.net.prefixlen == 0:
            raise _bad(field, text, "allows every address: use mode 'open'")
        for never, why in NEVER_REACHABLE:
            if rule.net.version == never.version and rule.net.subnet_of(never):  # type: ignore[arg-type]
                raise _bad(field, text, f"is never reachable, whatever the policy says "
                           f"({why})")
        if isinstance(rule.net, ipaddress.IPv6Network):
            embedded = never_reachable_embedded(rule.net)
            if embedded is not None:
                raise _bad(field, text, f"is never reachable, whatever the policy says: "
                           f"{embedded}")
    if mode == "open":
        if rule.kind in ("domain", "wildcard"):
            if which == "allow":
                raise _bad(field, text, "under mode 'open' adds nothing: open already "
                           "reaches every public name; drop it or use mode 'policy'")
            raise _bad(field, text, "cannot be denied by name under mode 'open' (its "
                       "addresses stay reachable by address); use mode 'policy', or deny "
                       "its CIDR")
        if which == "allow" and rule.net is not None and not _private(rule.net):
            raise _bad(field, text, "under mode 'open' adds nothing: open already reaches "
                       "every public address; allow CIDRs under open only to add private "
                       "ranges")


def _private(net: IPNet) -> bool:
    return any(net.version == p.version and net.overlaps(p)
               for p in PRIVATE_RANGES)


# ------------------------------------------------------------------ ceilings
@dataclass(frozen=True, slots=True)
class Violation:
    """Why a policy is beyond a ceiling: the entry (``network.allow[2]``) or the mode."""

    field: str
    entry: str
    why: str


def _ports_within(inner: tuple[int, int] | None, outer: tuple[int, int] | None) -> bool:
    lo, hi = inner or _ALL_PORTS
    olo, ohi = outer or _ALL_PORTS
    return olo <= lo and hi <= ohi


@dataclass(frozen=True, slots=True)
class _Cover:
    """A ceiling's ``allow`` entries indexed by what they cover, so :func:`within` walks
    a name's suffixes and a network's prefix lengths instead of scanning every entry for
    every entry asked. Measured (loaded 2-core VM): 256 asked x 256 ceiling entries took
    19.6 ms per create as a scan, ~0.3 ms indexed (the index is cached per ceiling)."""

    names: dict[str, list[Rule]]                     # exact domain -> entries
    wild: dict[str, list[Rule]]                      # wildcard base -> entries
    nets: dict[tuple[int, int, int], list[Rule]]     # (version, prefixlen, network) -> entries
    lens: tuple[tuple[int, int], ...]                # the (version, prefixlen)s present
    sandboxes: dict[str, list[Rule]]                 # sandbox id or "*" -> entries


@lru_cache(maxsize=256)
def _cover(ceiling: NetworkPolicy) -> _Cover:
    cov = _Cover({}, {}, {}, (), {})
    lens: set[tuple[int, int]] = set()
    for c in ceiling.rules()[0]:
        if c.kind == "domain":
            cov.names.setdefault(c.host, []).append(c)
        elif c.kind == "wildcard":
            cov.wild.setdefault(c.host, []).append(c)
        elif c.kind == "sandbox":
            cov.sandboxes.setdefault(c.host, []).append(c)
        else:
            assert c.net is not None
            key = (c.net.version, c.net.prefixlen, int(c.net.network_address))
            cov.nets.setdefault(key, []).append(c)
            lens.add(key[:2])
    return _Cover(cov.names, cov.wild, cov.nets, tuple(sorted(lens)), cov.sandboxes)


def _fits(r: Rule, candidates: Iterable[Rule]) -> bool:
    """Some candidate (already known to cover ``r``'s host) covers its ports and proto."""
    return any(_ports_within(r.ports, c.ports) and (c.proto is None or r.proto == c.proto)
               for c in candidates)


def _covered(r: Rule, cov: _Cover) -> bool:
    """``r`` lies inside one of the ceiling's entries: a name inside the same name or a
    wildcard over one of its parents; a wildcard inside the same or a wider wildcard; a
    network inside a network; a sandbox inside the same id or ``sandbox:*``."""
    if r.kind in ("domain", "wildcard"):
        if r.kind == "domain" and _fits(r, cov.names.get(r.host, ())):
            return True
        labels = r.host.split(".")
        first = 1 if r.kind == "domain" else 0       # *.a.org covers b.a.org, not a.org
        return any(_fits(r, cov.wild.get(".".join(labels[i:]), ()))
                   for i in range(first, len(labels) - 1))
    if r.kind == "cidr":
        assert r.net is not None
        v, plen, bits = r.net.version, r.net.prefixlen, r.net.max_prefixlen
        addr = int(r.net.network_address)
        for cv, clen in cov.lens:
            if cv == v and clen <= plen:
                masked = addr >> (bits - clen) << (bits - clen)
                if _fits(r, cov.nets.get((v, clen, masked), ())):
                    return True
        return False
    return _fits(r, cov.sandboxes.get(r.host, ())) or _fits(r, cov.sandboxes.get("*", ()))


def within(policy: NetworkPolicy, ceiling: NetworkPolicy | None) -> Violation | None:
    """None when ``policy`` asks for no more than ``ceiling`` admits, else the first
    :class:`Violation`. Both are valid policies (``validate`` passed). Ceiling ``none``
    admits only ``none``; ``open`` admits any public destination and every name (a name
    resolving into a private range is refused by the resolver unless a CIDR names it)
    but a private CIDR or a sandbox only where its own ``allow`` covers it; ``policy``
    admits ``none`` or a ``policy`` each of whose ``allow`` entries lies inside one of
    its ``allow`` entries. A ceiling's ``max_connections``/``rate_mbit`` bind too: the
    policy must name a cap no higher (unset is the node's default, not a cap under it).
    ``deny`` entries only narrow, so they are never beyond."""
    if ceiling is None:
        return None
    mode, cmode = policy.net_mode, ceiling.net_mode
    if mode == "none":
        return None
    if cmode == "none":
        return Violation("network.mode", mode, "admits no network (mode 'none')")
    if mode == "open" and cmode == "policy":
        return Violation("network.mode", mode, "admits only what its allow list names")
    for cap in ("max_connections", "rate_mbit"):
        limit, asked = getattr(ceiling, cap), getattr(policy, cap)
        if limit is not None and (asked is None or asked > limit):
            return Violation(f"network.{cap}", "unset" if asked is None else str(asked),
                             f"caps it at {limit}")
    cov = _cover(ceiling)
    allow, _ = policy.rules()
    for i, r in enumerate(allow):
        if cmode == "open" and r.kind in ("domain", "wildcard"):
            continue
        if cmode == "open" and r.kind == "cidr" and r.net is not None and not _private(r.net):
            continue
        if not _covered(r, cov):
            return Violation(f"network.allow[{i}]", str(r), "allows nothing that covers it")
    return None


def check_within(policy: NetworkPolicy, ceilings: Iterable[tuple[str, NetworkPolicy]],
                 *, where: str = "network") -> None:
    """Raise :class:`PermissionDenied` naming the entry and the project when ``policy``
    is beyond one of ``ceilings`` (``(project, ceiling)`` pairs: a project's own and
    every ancestor's, each binding)."""
    for project, ceiling in ceilings:
        v = within(policy, ceiling)
        if v is None:
            continue
        fld = v.field.replace("network", where, 1)
        raise PermissionDenied(
            f"{fld} {v.entry!r} is outside the network ceiling of project {project!r} "
            f"({ceiling}): that ceiling {v.why}; ask an admin of the parent of {project!r} "
            "to widen it", field=fld, entry=v.entry, project=project)


def ceiling_deny(ceilings: Sequence[tuple[str, NetworkPolicy]]) -> tuple[str, ...]:
    """The union of the ceilings' ``deny`` entries, in order, without duplicates: added
    to every policy under them (the edge compiles them with the policy's own)."""
    out: dict[str, None] = {}
    for _, c in ceilings:
        for e in c.deny:
            out.setdefault(e)
    return tuple(out)
