"""Where a registry pull may connect: the allowed-registries policy, applied to every hop
(pure: no I/O).

A pull connects from the apiserver's host wherever a caller's ref, and then the
registry, say: the registry itself, every redirect it answers (blob storage, a CDN),
and the token service its ``WWW-Authenticate: Bearer realm=`` names (credentials go
there). Checking only the ref's host let an allowed registry send the apiserver to any
URL, cloud metadata and loopback services included (red team F16); a ref *name* that
resolves to an internal address got there too (F6). :class:`EgressPolicy` is one rule
for all of them, asked twice per connection:

- :meth:`EgressPolicy.check_host` on the URL's ``host[:port]``, before any request:
  with an operator's list (``ClusterConfig.registries`` plus ``registry_blob_hosts``),
  the host must match one of its patterns; without one (the default), any host but
  ``localhost`` and internal IP literals.
- :meth:`EgressPolicy.check_address` on the address the name resolved to, right before
  the connection is made to *that* address (:class:`dsec.image.distribution.PinnedBackend`
  resolves once and connects to the address it checked, so a DNS answer that changes
  between check and connect - rebinding - is never used): an internal address
  (loopback, link-local, private, unspecified, reserved, multicast; IPv4-mapped IPv6
  judged as its IPv4) is refused unless the host matches an operator's pattern.
"""

from __future__ import annotations

import fnmatch
import ipaddress
from dataclasses import dataclass

from dsec.errors import PermissionDenied
from dsec.image.registry import host_only
from dsec.wire.netpolicy import embedded_ipv4

__all__ = ["EgressPolicy", "is_internal", "match_host"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


#: IPv6 ranges Python 3.11 calls global that are not: the local-use NAT64 prefix
#: (RFC 8215: where its IPv4 sits depends on the operator's prefix length, so it cannot
#: be judged) and deprecated site-local (still routed where configured)
_NOT_GLOBAL6 = (ipaddress.IPv6Network("64:ff9b:1::/48"), ipaddress.IPv6Network("fec0::/10"))


def is_internal(ip: IPAddress) -> bool:
    """An address of the apiserver's own neighbourhood: anything not globally routable
    (loopback, link-local - cloud metadata -, private, CGNAT, unspecified, reserved) and
    multicast. An IPv6 address that carries an IPv4 one - mapped, NAT64 (a NAT64 gateway
    on the path delivers it to that IPv4), 6to4, IPv4-compatible, Teredo - is internal if
    the IPv4 it carries is: the same embeddings the sandbox policy refuses
    (:func:`dsec.wire.netpolicy.embedded_ipv4`; red team 16 F7 found them passing here)."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return is_internal(ip.ipv4_mapped)
        if any(ip in net for net in _NOT_GLOBAL6):
            return True
        if any(is_internal(v4.network_address)
               for v4 in embedded_ipv4(ipaddress.IPv6Network(ip))):
            return True
    return not ip.is_global or ip.is_multicast


def _ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def hostport(host: str, port: int | None) -> str:
    """``host:port`` as registry refs spell it (IPv6 in brackets)."""
    h = host.strip("[]")
    h = f"[{h}]" if ":" in h else h
    return h if port is None else f"{h}:{port}"


def match_host(host: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``host`` (``name[:port]``) matches one of the fnmatch ``patterns`` (``*``
    and ``?``; brackets are IPv6 literals', ``[::1]:5000``); a pattern without a port
    matches the host on any port."""
    bare = host.rsplit(":", 1)[0] if not host.endswith("]") else host

    def glob(p: str) -> str:      # '[' of an IPv6 literal is itself, not a class
        return p.replace("[", "[[]")
    return any(fnmatch.fnmatchcase(host, glob(p))
               or (":" not in p.lstrip("[").split("]")[-1]
                   and fnmatch.fnmatchcase(bare, glob(p)))
               for p in patterns)


@dataclass(frozen=True, slots=True)
class EgressPolicy:
    """The hosts a registry pull may connect to.

    ``registries``: fnmatch ``host[:port]`` patterns of the registries callers may pull
    from (None: any registry whose address is public). ``blob_hosts``: further patterns
    that only redirects and token realms may go to (a registry's blob CDN or its auth
    service on another host); a ref naming one of them is still refused."""

    registries: tuple[str, ...] | None = None
    blob_hosts: tuple[str, ...] = ()

    def _listed(self, hp: str, *, hop: bool) -> bool:
        if self.registries is None:
            return False
        return match_host(hp, self.registries) or (hop and match_host(hp, self.blob_hosts))

    def check_registry(self, host: str) -> None:
        """A ref's registry ``host[:port]``: listed, or (no list) not internal by its
        spelling (``PermissionDenied`` naming the knob that opens it)."""
        if self.registries is None:
            h = host_only(host)
            ip = _ip(h)
            name = h.lower()
            if name == "localhost" or name.endswith(".localhost") \
                    or (ip is not None and is_internal(ip)):
                raise PermissionDenied(
                    f"this apiserver does not pull from registry {host[:200]!r} by default: "
                    "loopback, link-local and private addresses are the apiserver's own "
                    "network; an operator opens them with `dsec up --registry PATTERN` "
                    "(ClusterConfig.registries)", field="ref")
            return
        if not match_host(host, self.registries):
            raise PermissionDenied(
                f"this apiserver does not pull from registry {host[:200]!r}: it pulls only "
                f"from {', '.join(self.registries) or 'no registry'} (ClusterConfig."
                "registries, `dsec up --registry`); ask its operator, or pull elsewhere and "
                "push to an allowed one", field="ref")

    def check_host(self, host: str, port: int | None, *, what: str) -> None:
        """A hop (``what``: "redirect of <ref>", "token realm of <registry>") to
        ``host:port``, before it is contacted."""
        hp = hostport(host, port)
        if self.registries is None:
            ip = _ip(host)
            name = host.strip("[]").lower()
            if name == "localhost" or name.endswith(".localhost") \
                    or (ip is not None and is_internal(ip)):
                raise PermissionDenied(
                    f"{what} points at {hp[:200]!r}, an address of the apiserver's own "
                    "network; refused without contacting it - an operator opens it with "
                    "`dsec up --registry PATTERN` (ClusterConfig.registries)", field="ref")
            return
        if not self._listed(hp, hop=True):
            listed = (*self.registries, *self.blob_hosts)
            raise PermissionDenied(
                f"{what} points at {hp[:200]!r}, which is neither an allowed registry nor "
                f"an allowed blob host ({', '.join(listed) or 'none'}); refused without "
                "contacting it - an operator who trusts it lists it in ClusterConfig."
                "registry_blob_hosts", field="ref")

    def check_address(self, host: str, port: int | None, ip: IPAddress, *,
                      what: str) -> None:
        """The address ``host`` resolved to, right before connecting to it."""
        if not is_internal(ip):
            return
        hp = hostport(host, port)
        if self._listed(hp, hop=True):
            return
        raise PermissionDenied(
            f"{what}: {hp[:200]!r} resolves to {ip}, an internal address (loopback, "
            "link-local, private or reserved); refused without connecting - an operator "
            "who means it lists the host in `dsec up --registry` (ClusterConfig.registries)",
            field="ref")
