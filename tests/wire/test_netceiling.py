"""Project network ceilings: ``within`` (pure, property-tested: reflexive, transitive,
``open`` on top and ``none`` at the bottom), the refusal that names the entry and the
project, the ceilings of every ancestor binding (QuotaIndex.network_ceilings), and the
ceilings' deny entries merged."""

from __future__ import annotations

import ipaddress

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsec.control.quota import Quota, QuotaIndex
from dsec.errors import InvalidArgument, PermissionDenied
from dsec.wire.api import QuotaBody
from dsec.wire.calls import QuotaSet
from dsec.wire.netpolicy import (
    NEVER_REACHABLE,
    PRIVATE_RANGES,
    NetworkPolicy,
    Rule,
    ceiling_deny,
    check_within,
    within,
)

NONE = NetworkPolicy()
OPEN = NetworkPolicy(mode="open")


def P(*allow: str, deny: tuple[str, ...] = ()) -> NetworkPolicy:
    return NetworkPolicy(mode="policy", allow=allow, deny=deny).validate()


CEILING = P("pypi.org:443/tcp", "*.pythonhosted.org:443", "203.0.113.0/24",
            "[2001:db8::/32]:443", "sandbox:*:8000-8100/tcp")


@pytest.mark.parametrize("asked", [
    NONE, P(), P("pypi.org:443/tcp"), P("files.pythonhosted.org:443/udp"),
    P("a.b.pythonhosted.org:443/tcp", "*.x.pythonhosted.org:443"), P("203.0.113.8/29:22"),
    P("203.0.113.7:80/udp"), P("[2001:db8:1::/48]:443/tcp"),
    P("sandbox:sb-0123456789ab-n1:8000/tcp"),
    P("pypi.org:443/tcp", deny=("github.com", "0.0.0.0/1")),
])
def test_inside_the_ceiling(asked: NetworkPolicy) -> None:
    assert within(asked, CEILING) is None


@pytest.mark.parametrize("asked,field,entry", [
    (OPEN, "network.mode", "open"),
    (P("github.com:443/tcp"), "network.allow[0]", "github.com:443/tcp"),
    (P("pypi.org:443/tcp", "pypi.org"), "network.allow[1]", "pypi.org"),
    (P("pypi.org:80/tcp"), "network.allow[0]", "pypi.org:80/tcp"),
    (P("pypi.org:443"), "network.allow[0]", "pypi.org:443"),           # udp too
    (P("pythonhosted.org:443/tcp"), "network.allow[0]", "pythonhosted.org:443/tcp"),
    (P("*.org:443/tcp".replace("*.org", "*.ythonhosted.org")), "network.allow[0]",
     "*.ythonhosted.org:443/tcp"),
    (P("203.0.112.0/23"), "network.allow[0]", "203.0.112.0/23"),
    (P("[2001:db9::1]:443"), "network.allow[0]", "[2001:db9::1]:443"),
    (P("sandbox:sb-0123456789ab-n1:22/tcp"), "network.allow[0]",
     "sandbox:sb-0123456789ab-n1:22/tcp"),
])
def test_beyond_the_ceiling_names_the_entry(asked: NetworkPolicy, field: str, entry: str) -> None:
    v = within(asked, CEILING)
    assert v is not None and (v.field, v.entry) == (field, entry)


def test_ceiling_none_admits_only_none_and_open_admits_every_public_thing() -> None:
    assert within(NONE, NONE) is None
    assert within(P("pypi.org"), NONE) is not None
    assert within(OPEN, NONE) is not None
    for asked in (OPEN, P("pypi.org", "*.example.com", "203.0.113.0/24", "[2001:db8::1]")):
        assert within(asked, OPEN) is None
    # ... but not a private range, nor a sandbox, unless the open ceiling names them
    v = within(P("10.1.2.0/24:5432/tcp"), OPEN)
    assert v is not None and v.entry == "10.1.2.0/24:5432/tcp"
    assert within(P("sandbox:sb-0123456789ab-n1"), OPEN) is not None
    wide = NetworkPolicy(mode="open", allow=("10.0.0.0/8", "sandbox:*")).validate()
    assert within(P("10.1.2.0/24:5432/tcp", "sandbox:sb-0123456789ab-n1"), wide) is None
    assert within(NetworkPolicy(mode="open", allow=("10.1.0.0/16",)).validate(), wide) is None


def test_a_ceilings_caps_bind() -> None:
    capped = NetworkPolicy(mode="open", max_connections=64, rate_mbit=10).validate()
    assert within(NetworkPolicy(mode="policy", allow=("pypi.org",), max_connections=8,
                                rate_mbit=10).validate(), capped) is None
    v = within(P("pypi.org"), capped)
    assert v is not None and (v.field, v.entry, v.why) == (
        "network.max_connections", "unset", "caps it at 64")
    v = within(NetworkPolicy(mode="open", max_connections=64, rate_mbit=11), capped)
    assert v is not None and (v.field, v.entry) == ("network.rate_mbit", "11")
    assert within(NONE, capped) is None


def test_the_refusal_names_entry_project_and_what_to_do() -> None:
    ceilings = [("lab", OPEN), ("lab/team-a", P("pypi.org:443/tcp", "*.pythonhosted.org:443/tcp"))]
    check_within(P("pypi.org:443/tcp"), ceilings)
    with pytest.raises(PermissionDenied) as ei:
        check_within(P("pypi.org:443/tcp", "github.com:443/tcp"), ceilings)
    e = ei.value
    assert e.message == (
        "network.allow[1] 'github.com:443/tcp' is outside the network ceiling of project "
        "'lab/team-a' (mode policy; allow: pypi.org:443/tcp, *.pythonhosted.org:443/tcp): "
        "that ceiling allows nothing that covers it; ask an admin of the parent of "
        "'lab/team-a' to widen it")
    assert e.detail == {"field": "network.allow[1]", "entry": "github.com:443/tcp",
                        "project": "lab/team-a"}
    # an ancestor binds even when the project's own ceiling is wider
    with pytest.raises(PermissionDenied, match="project 'lab'"):
        check_within(OPEN, [("lab", P("pypi.org")), ("lab/x", OPEN)])
    with pytest.raises(PermissionDenied, match=r"^policy.allow\[0\]"):
        check_within(P("github.com"), [("lab", P("pypi.org"))], where="policy")


def test_every_ancestor_ceiling_binds_and_their_denies_merge() -> None:
    q = QuotaIndex()
    q.set_quota("lab", Quota(network=NetworkPolicy(mode="open", deny=("203.0.113.0/24",))))
    q.set_quota("lab/a", Quota(max_sandboxes=3, network=P("pypi.org", deny=("198.51.100.1",
                                                                            "203.0.113.0/24"))))
    q.set_quota("lab/a/b", Quota(max_sandboxes=1))
    chain = q.network_ceilings("lab/a/b/c")
    assert [p for p, _ in chain] == ["lab", "lab/a"]
    assert ceiling_deny(chain) == ("203.0.113.0/24", "198.51.100.1")
    assert q.network_ceilings("other") == []
    with pytest.raises(PermissionDenied, match="'lab/a'"):
        check_within(P("github.com"), chain)


def test_a_ceiling_is_validated_where_it_enters_and_stored_canonical() -> None:
    body = QuotaBody(network=NetworkPolicy(mode="policy", allow=("PyPI.org", "pypi.org")))
    assert body.network is not None and body.network.allow == ("pypi.org",)
    for codec in (msgspec.json, msgspec.msgpack):
        raw = codec.encode({"path": "lab", "quota": {"network": {"mode": "policy",
                                                                  "allow": ["x..y"]}}})
        with pytest.raises(msgspec.ValidationError) as ei:
            codec.decode(raw, type=QuotaSet)
        assert isinstance(ei.value.__cause__, InvalidArgument)
        assert ei.value.__cause__.detail["field"] == "quota.network.allow[0]"
    stored = msgspec.to_builtins(Quota(network=body.network))
    assert msgspec.convert(stored, Quota).network == body.network


# ------------------------------------------------------------------ properties
_octet = st.integers(0, 255)
_cidr = st.tuples(st.integers(0, 2**32 - 1), st.integers(4, 32)).map(
    lambda t: ipaddress.IPv4Network((ipaddress.IPv4Address(t[0]), t[1]), strict=False))
_public = _cidr.filter(lambda n: not any(n.overlaps(p) for p in PRIVATE_RANGES
                                         if p.version == 4) and not any(
    n.subnet_of(m) for m, _ in NEVER_REACHABLE if m.version == 4))
_name = st.sampled_from(["a.org", "b.a.org", "c.b.a.org", "x.net"])
_ports = st.sampled_from(["", ":443", ":80", ":440-447"])
_proto = st.sampled_from(["", "/tcp", "/udp"])


@st.composite
def entries(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["domain", "wildcard", "cidr"]))
    host = {"domain": lambda: draw(_name), "wildcard": lambda: "*." + draw(_name),
            "cidr": lambda: str(draw(_public))}[kind]()
    return host + draw(_ports) + draw(_proto)


policies = st.one_of(
    st.just(NONE), st.just(OPEN),
    st.lists(entries(), max_size=5).map(lambda a: P(*a)))


@given(policies)
def test_within_is_reflexive_and_bounded(p: NetworkPolicy) -> None:
    assert within(p, p) is None
    assert within(p, OPEN) is None
    assert within(NONE, p) is None


@given(policies, policies, policies)
def test_within_is_transitive(a: NetworkPolicy, b: NetworkPolicy, c: NetworkPolicy) -> None:
    if within(a, b) is None and within(b, c) is None:
        assert within(a, c) is None


@given(st.lists(entries(), min_size=1, max_size=5), st.data())
def test_dropping_entries_stays_within(allow: list[str], data: st.DataObject) -> None:
    full = P(*allow)
    keep = data.draw(st.lists(st.sampled_from(full.allow), unique=True))
    assert within(P(*keep), full) is None


def _scan_within(r: Rule, c: Rule) -> bool:
    """The rule of ``within`` written as the plain pairwise check (the index must agree)."""
    lo, hi = r.ports or (1, 65535)
    clo, chi = c.ports or (1, 65535)
    if not (clo <= lo and hi <= chi) or (c.proto is not None and r.proto != c.proto):
        return False
    if r.kind == "domain":
        return bool((c.kind == "domain" and c.host == r.host)
                    or (c.kind == "wildcard" and r.host.endswith("." + c.host)))
    if r.kind == "wildcard":
        return c.kind == "wildcard" and (r.host == c.host or r.host.endswith("." + c.host))
    if r.kind == "cidr":
        return bool(c.kind == "cidr" and r.net is not None and c.net is not None
                    and r.net.version == c.net.version and r.net.subnet_of(c.net))
    return c.kind == "sandbox" and c.host in ("*", r.host)


_any_cidr = st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 32)).map(
    lambda t: str(ipaddress.IPv4Network((ipaddress.IPv4Address(t[0] | 1 << 24), max(t[1], 1)),
                                        strict=False)))
_entry_any = st.one_of(entries(), st.tuples(_any_cidr, _ports, _proto).map("".join),
                       st.sampled_from(["sandbox:*", "sandbox:sb-0123456789ab-n1:80/tcp",
                                        "sandbox:sb-0123456789ab-n1", "[2001:db8::/32]",
                                        "[2001:db8:1::/48]:443/udp"]))


@given(st.lists(_entry_any, max_size=6), st.lists(_entry_any, max_size=6))
def test_the_indexed_check_agrees_with_the_pairwise_rule(asked: list[str],
                                                          ceiling: list[str]) -> None:
    def pol(xs: list[str]) -> NetworkPolicy | None:
        try:
            return P(*xs)
        except InvalidArgument:
            return None
    a, c = pol(asked), pol(ceiling)
    if a is None or c is None:
        return
    want = next((f"network.allow[{i}]" for i, r in enumerate(a.rules()[0])
                 if not any(_scan_within(r, x) for x in c.rules()[0])), None)
    got = within(a, c)
    assert (got.field if got else None) == want
