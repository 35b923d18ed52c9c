"""The policy compiler (dsec.net.compile): golden element sets for representative
policies, the ceilings' denies, never/private handling, open mode, east-west pairing,
and diff (what an update loads, and whether it must cut flows)."""

from __future__ import annotations

import ipaddress

from hypothesis import given
from hypothesis import strategies as st

from dsec.net.compile import ALL_PORTS, DomainRule, Elem, compile, diff
from dsec.wire.netpolicy import NetworkPolicy

V4 = ipaddress.IPv4Network
V6 = ipaddress.IPv6Network
A = "sb-0000000000aa-n1"
B = "sb-0000000000bb-n1"


def _pol(mode: str = "policy", allow: tuple[str, ...] = (), deny: tuple[str, ...] = (),
         **kw: int) -> NetworkPolicy:
    return NetworkPolicy(mode=mode, allow=allow, deny=deny, **kw).validate()


def _text(c: object, name: str) -> list[str]:
    return [str(e) for e in c.elements(name)]  # type: ignore[attr-defined]


def test_none_compiles_to_nothing() -> None:
    c = compile(_pol("none"), ceiling_deny=("203.0.113.0/24",))
    assert c.mode == "none" and not c.open
    assert all(not v for v in c.sets.values()) and not c.domains and not c.inbound


def test_a_representative_policy() -> None:
    c = compile(_pol(allow=("pypi.org:443/tcp", "*.pythonhosted.org:443",
                            "203.0.113.0/24:8000-8100", "198.51.100.7:53/udp",
                            "[2001:db8::/32]:443/udp"),
                     deny=("203.0.113.128/25", "evil.pypi.org"),
                     max_connections=64, rate_mbit=100))
    assert not c.open and c.mode == "policy"
    assert _text(c, "a4") == ["198.51.100.7/32 . udp . 53",
                              "203.0.113.0/24 . tcp . 8000-8100",
                              "203.0.113.0/24 . udp . 8000-8100"]
    assert _text(c, "a6") == ["2001:db8::/32 . udp . 443"]
    assert _text(c, "d4") == ["203.0.113.128/25 . tcp . 0-65535",
                              "203.0.113.128/25 . udp . 0-65535"]
    assert c.elements("d6") == [] and c.elements("e4") == []
    assert c.domains == (DomainRule("pypi.org", False, ("tcp",), (443, 443)),
                         DomainRule("pythonhosted.org", True, ("tcp", "udp"), (443, 443)))
    assert c.deny_domains == (DomainRule("evil.pypi.org", False, ("tcp", "udp"), None),)
    assert (c.max_connections, c.rate_mbit) == (64, 100)


def test_the_resolver_rules_match_names_and_deny_wins() -> None:
    c = compile(_pol(allow=("pypi.org", "*.example.com"), deny=("bad.example.com",)),
                ceiling_deny=("*.corp.example.com",))
    assert c.resolves("PyPI.org.") is not None
    assert c.resolves("files.pypi.org") is None, "an exact name covers no subdomain"
    assert c.resolves("a.example.com") is not None
    assert c.resolves("example.com") is None, "a wildcard covers subdomains only"
    assert c.resolves("bad.example.com") is None
    assert c.resolves("x.corp.example.com") is None, "the ceiling's deny binds"
    assert c.resolves("pypi.org.evil.net") is None


def test_ceiling_denies_are_added_to_the_policy_own() -> None:
    c = compile(_pol(allow=("203.0.113.0/24",), deny=("203.0.113.9",)),
                ceiling_deny=("203.0.113.64/26:22/tcp", "[2001:db8::/48]"))
    assert _text(c, "d4") == ["203.0.113.9/32 . tcp . 0-65535", "203.0.113.9/32 . udp . 0-65535",
                              "203.0.113.64/26 . tcp . 22"]
    assert _text(c, "d6") == ["2001:db8::/48 . tcp . 0-65535", "2001:db8::/48 . udp . 0-65535"]


def test_open_mode_is_a_flag_and_its_allows_are_private_ranges() -> None:
    c = compile(_pol("open", allow=("10.1.2.0/24:5432/tcp",), deny=("203.0.113.0/24",)))
    assert c.open and c.mode == "open"
    assert _text(c, "a4") == ["10.1.2.0/24 . tcp . 5432"]
    assert _text(c, "d4") == ["203.0.113.0/24 . tcp . 0-65535", "203.0.113.0/24 . udp . 0-65535"]
    assert c.domains == ()


def test_an_allow_inside_the_node_never_set_is_left_out() -> None:
    """A node whose pool is not the default: the wire type cannot know it; the compiler
    is told and drops the element (the router drops the traffic first anyway)."""
    c = compile(_pol(allow=("10.50.0.0/24", "203.0.113.1")), never=(V4("10.50.0.0/16"),))
    assert _text(c, "a4") == ["203.0.113.1/32 . tcp . 0-65535", "203.0.113.1/32 . udp . 0-65535"]
    assert c.notes and "10.50.0.0/24" in c.notes[0]


def test_east_west_only_towards_peers_the_edge_paired() -> None:
    a, b = ipaddress.IPv4Address("10.213.0.3"), ipaddress.IPv4Address("10.213.0.5")
    pol = _pol(allow=(f"sandbox:{A}:8000/tcp", f"sandbox:{B}"))
    alone = compile(pol)
    assert alone.peers == {A, B} and alone.elements("e4") == []
    paired = compile(pol, peers={A: a}, inbound=[a])
    assert _text(paired, "e4") == ["10.213.0.3/32 . tcp . 8000"]
    assert paired.inbound == {a}
    anyone = compile(_pol(allow=("sandbox:*:80/tcp",), deny=(f"sandbox:{B}",)),
                     peers={A: a, B: b})
    assert _text(anyone, "e4") == ["10.213.0.3/32 . tcp . 80"], "a denied peer is not paired"


def test_diff_of_equal_policies_is_nothing() -> None:
    p = _pol(allow=("pypi.org:443", "203.0.113.0/24"))
    d = diff(compile(p), compile(_pol(allow=("203.0.113.0/24", "PyPI.org:443"))))
    assert d.same and not d.cuts and not d.add and not d.delete


def test_diff_of_a_narrowing_cuts_and_of_a_widening_does_not() -> None:
    wide = compile(_pol(allow=("203.0.113.0/24", "pypi.org")))
    narrow = compile(_pol(allow=("203.0.113.0/25",)))
    d = diff(wide, narrow)
    assert d.cuts and not d.same
    assert {str(e) for e in d.delete["a4"]} == {"203.0.113.0/24 . tcp . 0-65535",
                                                 "203.0.113.0/24 . udp . 0-65535"}
    assert {str(e) for e in d.add["a4"]} == {"203.0.113.0/25 . tcp . 0-65535",
                                              "203.0.113.0/25 . udp . 0-65535"}
    up = diff(narrow, wide)
    assert not up.cuts and not up.same
    assert diff(compile(_pol("open")), compile(_pol("policy"))).cuts
    assert diff(compile(_pol(allow=("a.org",))), compile(_pol(allow=("a.org",),
                                                             deny=("1.2.3.4",)))).cuts
    fresh = diff(None, wide)
    assert not fresh.same and not fresh.cuts and set(fresh.add) == {"a4"}


_cidr = st.tuples(st.integers(0, 2**32 - 1), st.integers(8, 32)).map(
    lambda t: str(V4((ipaddress.IPv4Address(t[0]), t[1]), strict=False)))
_entry = st.tuples(_cidr, st.sampled_from(["", ":443", ":8000-8100"]),
                   st.sampled_from(["", "/tcp", "/udp"])).map("".join)


@given(st.lists(_entry, max_size=8), st.lists(_entry, max_size=8))
def test_compile_then_diff_reproduces_the_new_sets(a: list[str], b: list[str]) -> None:
    """Applying diff(old, new) to old's elements gives exactly new's, for any pair."""
    never = [n for n in (V4("0.0.0.0/8"), V4("127.0.0.0/8"), V4("169.254.0.0/16"),
                         V4("224.0.0.0/3"), V4("10.213.0.0/16"))]

    def ok(e: str) -> bool:
        net = V4(e.split(":")[0].split("/t")[0].split("/u")[0])
        return not any(net.subnet_of(n) for n in never)
    old = compile(_pol(allow=tuple(x for x in a if ok(x))))
    new = compile(_pol(allow=tuple(x for x in b if ok(x))))
    d = diff(old, new)
    for name in ("a4", "d4"):
        got = (set(old.sets[name]) - d.delete.get(name, frozenset())) | d.add.get(name, set())
        assert got == set(new.sets[name])
    assert d.same == (old == new)
    assert all(e.ports == ALL_PORTS or e.ports[0] >= 1 for e in new.sets["a4"])
    assert all(isinstance(e, Elem) for e in new.sets["a4"])
