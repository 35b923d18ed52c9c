"""The egress policy's types (dsec.wire.netpolicy): every limit of plan-14 §6.2 refused
with its field (and its limit where it has one), at construction and at decode through
the requests that carry a policy (CreateSandbox, NetworkUpdate, CreateOnNode) in both
encodings; the canonical form round-trips; the old modes still decode."""

from __future__ import annotations

import ipaddress
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsec.errors import InvalidArgument
from dsec.wire import netpolicy as np_
from dsec.wire.calls import CreateOnNode, CreateSandbox, NetworkUpdate, NetworkUpdateOnNode
from dsec.wire.netpolicy import NetworkPolicy, Rule, parse_rule
from dsec.wire.spec import SandboxSpec

SID = "sb-0123456789ab-n1"


def _policy(**kw: Any) -> dict[str, Any]:
    return {"mode": "policy", **kw}


# (raw policy, field named, limit or None, words in the message)
REFUSED: list[tuple[dict[str, Any], str, int | None, str]] = [
    (_policy(allow=[f"h{i}.example.com" for i in range(257)]), "network.allow", 256,
     "257 entries, over the limit of 256"),
    (_policy(deny=[f"10.{i // 256}.{i % 256}.0/24" for i in range(257)]), "network.deny",
     256, "over the limit of 256"),
    (_policy(allow=["a.org", ""]), "network.allow[1]", None, "is empty"),
    (_policy(allow=["   "]), "network.allow[0]", None, "is empty"),
    (_policy(allow=[" pypi.org"]), "network.allow[0]", None, "whitespace"),
    (_policy(allow=["pypi..org"]), "network.allow[0]", None, "empty label"),
    (_policy(allow=["-bad.org"]), "network.allow[0]", None, "invalid label"),
    (_policy(allow=["a_b.org"]), "network.allow[0]", None, "invalid label"),
    (_policy(allow=["localhost"]), "network.allow[0]", None, "single label"),
    (_policy(allow=[("a" * 64) + ".org"]), "network.allow[0]", 63, "label of 64 bytes"),
    (_policy(allow=[".".join(["abcdefgh"] * 29) + ".org"]), "network.allow[0]", 253,
     "over the 253-byte limit"),
    (_policy(allow=["x" * 600]), "network.allow[0]", 512, "over the limit of 512"),
    (_policy(allow=["*"]), "network.allow[0]", None, "use mode 'open'"),
    (_policy(allow=["*.com"]), "network.allow[0]", None, "mode 'open'"),
    (_policy(allow=["a.*.com"]), "network.allow[0]", None, "leading '*.'"),
    (_policy(allow=["**.a.com"]), "network.allow[0]", None, "'*'"),
    (_policy(allow=["203.0.113.5/24"]), "network.allow[0]", None,
     "did you mean 203.0.113.0/24?"),
    (_policy(allow=["10.0.0.0/33"]), "network.allow[0]", None, "not a valid IP"),
    (_policy(allow=["[::ffff:1.2.3.4]"]), "network.allow[0]", None, "IPv4-mapped"),
    (_policy(allow=["2001:db8::1"]), "network.allow[0]", None, "in brackets"),
    (_policy(allow=["[1.2.3.4]"]), "network.allow[0]", None, "brackets are for IPv6"),
    (_policy(allow=["0.0.0.0/0"]), "network.allow[0]", None, "use mode 'open'"),
    (_policy(allow=["[::/0]"]), "network.allow[0]", None, "use mode 'open'"),
    (_policy(allow=["169.254.169.254"]), "network.allow[0]", None,
     "never reachable, whatever the policy says (metadata/link-local)"),
    (_policy(allow=["127.0.0.1:8080"]), "network.allow[0]", None, "loopback"),
    (_policy(allow=["[::1]"]), "network.allow[0]", None, "never reachable"),
    (_policy(allow=["[fe80::1]"]), "network.allow[0]", None, "never reachable"),
    (_policy(allow=["224.0.0.1"]), "network.allow[0]", None, "never reachable"),
    (_policy(allow=["0.0.0.0"]), "network.allow[0]", None, "never reachable"),
    (_policy(allow=["10.213.0.4"]), "network.allow[0]", None, "sandbox:<id>"),
    (_policy(allow=["a.org:0"]), "network.allow[0]", 65535, "ports are 1..65535"),
    (_policy(allow=["a.org:65536"]), "network.allow[0]", 65535, "ports are 1..65535"),
    (_policy(allow=["a.org:443x"]), "network.allow[0]", None, "invalid port"),
    (_policy(allow=["a.org:9000-8000"]), "network.allow[0]", None, "backwards"),
    (_policy(allow=["example.com:8000-9000"]), "network.allow[0]", 16,
     "spans 1001 ports; a domain entry takes one port, a range of at most 16"),
    (_policy(allow=["*.example.com:1-100"]), "network.allow[0]", 16, "spans 100 ports"),
    (_policy(allow=["a.org:443/icmp"]), "network.allow[0]", None,
     "unknown protocol 'icmp' in network.allow[0] 'a.org:443/icmp': use tcp or udp"),
    (_policy(allow=["sandbox:nope"]), "network.allow[0]", None, "does not name a sandbox"),
    ({"mode": "none", "allow": ["a.org"]}, "network.allow", None, "under mode 'none'"),
    ({"mode": "none", "deny": ["a.org"]}, "network.deny", None, "under mode 'none'"),
    ({"mode": "open", "allow": ["pypi.org"]}, "network.allow[0]", None,
     "under mode 'open' adds nothing"),
    ({"mode": "open", "allow": ["203.0.113.0/24"]}, "network.allow[0]", None,
     "only to add private ranges"),
    ({"mode": "open", "deny": ["evil.org"]}, "network.deny[0]", None,
     "cannot be denied by name under mode 'open'"),
    (_policy(max_connections=0), "network.max_connections", 65536, "1..65536"),
    (_policy(max_connections=65537), "network.max_connections", 65536, "1..65536"),
    (_policy(rate_mbit=0), "network.rate_mbit", 100000, "1..100000"),
    (_policy(rate_mbit=100001), "network.rate_mbit", 100000, "1..100000"),
]


@pytest.mark.parametrize("raw,field,limit,words", REFUSED,
                         ids=[f"{i}-{r[1]}" for i, r in enumerate(REFUSED)])
def test_each_limit_is_refused_with_its_field_everywhere_a_policy_enters(
        raw: dict[str, Any], field: str, limit: int | None, words: str) -> None:
    """Built and validated, decoded inside a create (msgpack and JSON, at every door
    the type is the decoder), and as a network_update's policy: the same refusal."""
    with pytest.raises(InvalidArgument) as ei:
        msgspec.convert(raw, NetworkPolicy).validate()
    assert words in ei.value.message, ei.value.message
    assert ei.value.detail["field"] == field
    assert ei.value.detail.get("limit") == limit, ei.value.detail
    assert len(ei.value.message) < 400, "the message echoes the whole value"
    for codec in (msgspec.msgpack, msgspec.json):
        body = codec.encode({"spec": {"image": "base", "network": raw}})
        with pytest.raises(msgspec.ValidationError) as de:
            codec.decode(body, type=CreateSandbox)
        cause = de.value.__cause__
        assert isinstance(cause, InvalidArgument) and cause.detail["field"] == field
        assert cause.message == ei.value.message
        upd = codec.encode({"id": SID, "policy": raw})
        with pytest.raises(msgspec.ValidationError) as ue:
            codec.decode(upd, type=NetworkUpdate)
        cause = ue.value.__cause__
        assert isinstance(cause, InvalidArgument)
        assert cause.detail["field"] == field.replace("network", "policy", 1)
    with pytest.raises(InvalidArgument):
        SandboxSpec(network=msgspec.convert(raw, NetworkPolicy)).validate()


def test_unknown_fields_and_modes_are_refused_by_name() -> None:
    for codec in (msgspec.msgpack, msgspec.json):
        with pytest.raises(msgspec.ValidationError, match="allow_out"):
            codec.decode(codec.encode({"id": SID, "policy": {"mode": "policy",
                                                              "allow_out": ["a.org"]}}),
                         type=NetworkUpdate)
        with pytest.raises(msgspec.ValidationError, match="mode"):
            codec.decode(codec.encode({"mode": "everything"}), type=NetworkPolicy)


def test_ceiling_deny_is_validated_on_the_edge_requests() -> None:
    with pytest.raises(InvalidArgument, match=r"ceiling.deny\[1\]"):
        CreateOnNode(spec=SandboxSpec(), ceiling_deny=("a.org", "bad..org"))
    with pytest.raises(msgspec.ValidationError, match="empty label"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(
            {"id": SID, "policy": {"mode": "none"}, "ceiling_deny": ["x..y"]}),
            type=NetworkUpdateOnNode)


def test_canonical_form_lowercases_punycodes_narrows_and_deduplicates() -> None:
    p = NetworkPolicy(mode="policy", allow=(
        "PyPI.org.", "pypi.org", "pypi.org:1-65535", "bücher.de:443/TCP", "*.Example.COM:80-81",
        "203.0.113.7/32", "[2001:DB8::]/32:53/udp", "[2001:db8::1]:443",
        f"sandbox:{SID}:8000/tcp"), deny=("pypi.org:22", "pypi.org:22"))
    c = p.validate()
    assert c.allow == ("pypi.org", "xn--bcher-kva.de:443/tcp", "*.example.com:80-81",
                       "203.0.113.7", "[2001:db8::/32]:53/udp", "[2001:db8::1]:443",
                       f"sandbox:{SID}:8000/tcp")
    assert c.deny == ("pypi.org:22",)
    assert c.validate() is c, "the canonical form is a fixed point"
    # a create and an update carry the canonical form on
    create = CreateSandbox(spec=SandboxSpec(network=p))
    assert create.spec.network == c
    assert NetworkUpdate(id=SID, policy=p).policy == c


def test_legacy_modes_decode() -> None:
    """Specs stored (journals, registries) and requests of the previous release: the
    default "loopback" is "none" now; the old "none" too; "allowlist" (refused by every
    backend before, so never stored) reads as "policy"."""
    for old, new in (("loopback", "none"), ("none", "none"), ("allowlist", "policy")):
        for codec in (msgspec.msgpack, msgspec.json):
            got = codec.decode(codec.encode({"mode": old}), type=NetworkPolicy)
            assert got.mode == new and got.net_mode == new
            spec = codec.decode(codec.encode({"image": "x", "network": {"mode": old}}),
                                type=SandboxSpec)
            assert spec.network is not None and spec.network.mode == new
    assert NetworkPolicy(mode="allowlist", allow=("pypi.org:443",)).validate() == \
        NetworkPolicy(mode="policy", allow=("pypi.org:443",))
    assert NetworkPolicy.of("loopback") == NetworkPolicy()
    assert NetworkPolicy.of(None) is None
    with pytest.raises(InvalidArgument, match="is not a mode"):
        NetworkPolicy.of("everything")


def test_a_spec_without_network_leaves_it_to_the_server() -> None:
    spec = msgspec.json.decode(b'{"image": "x"}', type=SandboxSpec)
    assert spec.network is None and spec.net == NetworkPolicy()
    assert b"network" not in msgspec.msgpack.encode(spec)


def test_a_stored_policy_decodes_whatever_the_limits_say() -> None:
    """A record does not validate: a journal written under looser limits stays readable."""
    raw = {"image": "x", "network": {"mode": "policy", "allow": ["x" * 600]}}
    spec = msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=SandboxSpec)
    assert spec.network is not None and spec.network.allow == ("x" * 600,)


# ------------------------------------------------------------------ properties
_label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
_tld = st.from_regex(r"[a-z][a-z0-9]{0,5}", fullmatch=True)
_domain = st.tuples(st.lists(_label, min_size=1, max_size=3), _tld).map(
    lambda t: ".".join([*t[0], t[1]]))
_ports = st.one_of(
    st.none(),
    st.integers(1, 65535).map(lambda p: (p, p)),
    st.tuples(st.integers(1, 65535), st.integers(0, 15)).map(
        lambda t: (t[0], min(65535, t[0] + t[1]))))
_wide_ports = st.one_of(_ports, st.tuples(st.integers(1, 65535), st.integers(1, 65535)).map(
    lambda t: (min(t), max(t))))
_proto = st.sampled_from([None, "tcp", "udp"])


@st.composite
def rules(draw: st.DrawFn) -> Rule:
    kind = draw(st.sampled_from(["domain", "wildcard", "cidr4", "cidr6", "sandbox"]))
    proto = draw(_proto)
    if kind in ("domain", "wildcard"):
        ports = draw(_ports)
        return Rule(kind, draw(_domain), None, None if ports == (1, 65535) else ports, proto)
    ports = draw(_wide_ports)
    ports = None if ports == (1, 65535) else ports
    if kind == "sandbox":
        token = draw(st.from_regex(r"[0-9a-f]{12}", fullmatch=True))
        return Rule("sandbox", f"sb-{token}-n1", None, ports, proto)
    if kind == "cidr4":
        addr = ipaddress.IPv4Address(draw(st.integers(0, 2**32 - 1)))
        net: np_.IPNet = ipaddress.IPv4Network((addr, draw(st.integers(1, 32))), strict=False)
    else:
        addr6 = ipaddress.IPv6Address(draw(st.integers(0, 2**128 - 1)))
        net = ipaddress.IPv6Network((addr6, draw(st.integers(1, 128))), strict=False)
    return Rule("cidr", str(net), net, ports, proto)


@given(rules())
def test_a_rule_round_trips_through_its_text(rule: Rule) -> None:
    assert parse_rule(str(rule)) == rule


@given(rules(), st.booleans())
def test_the_text_is_case_and_dot_insensitive(rule: Rule, dot: bool) -> None:
    text = str(rule)
    if rule.kind in ("domain", "wildcard"):
        host, _, rest = text.partition(":") if ":" in text else (text, "", "")
        shouted = host.upper() + ("." if dot and "/" not in host else "")
        text2 = shouted + (":" + rest if rest else "")
        assert parse_rule(text2) == rule


@given(st.lists(rules(), max_size=12))
def test_validate_is_canonical_and_idempotent(rs: list[Rule]) -> None:
    """Entries that may stand in an allow list: validate keeps each once, in order."""
    ok = [r for r in rs if not (r.net is not None and any(
        r.net.version == n.version and r.net.subnet_of(n)
        for n, _ in np_.NEVER_REACHABLE))
        # an IPv6 spelling of a never-reachable IPv4 (NAT64, 6to4, Teredo): refused too
        and not (isinstance(r.net, ipaddress.IPv6Network)
                 and np_.never_reachable_embedded(r.net) is not None)]
    p = NetworkPolicy(mode="policy", allow=tuple(str(r) for r in ok) * 2)
    c = p.validate()
    assert c.allow == tuple(dict.fromkeys(str(r) for r in ok))
    assert c.validate() is c
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(c), type=NetworkPolicy)
    assert again == c


def test_validate_remembers_successes_only_and_refusals_name_their_field() -> None:
    """validate() keeps what passed (a burst of creates with one policy parses it once);
    a refusal is never remembered and names the field it was asked under each time."""
    from dsec.wire import netpolicy

    p = NetworkPolicy(mode="policy", allow=("Example.COM:443/tcp", "203.0.113.0/24"))
    c = p.validate()
    assert netpolicy._VALIDATED[p] is c and p.validate() is c
    assert c.allow == ("example.com:443/tcp", "203.0.113.0/24")
    bad = NetworkPolicy(mode="policy", allow=("203.0.113.1/24",))
    for where in ("network", "policy"):
        with pytest.raises(InvalidArgument) as e:
            bad.validate(where)
        assert e.value.detail["field"] == f"{where}.allow[0]"
    assert bad not in netpolicy._VALIDATED
    # built by hand with lists (not hashable): validated, canonical tuples, not kept
    listed = NetworkPolicy(mode="policy", allow=["Example.COM:443/tcp"])  # type: ignore[arg-type]
    assert listed.validate().allow == ("example.com:443/tcp",)
