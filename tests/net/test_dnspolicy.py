"""The resolver's decisions, pure: refusals, rebinding filter, pins and their timeouts."""

from __future__ import annotations

import ipaddress

from dsec.net.dnspolicy import (
    AAAA,
    A,
    DnsPolicy,
    Forward,
    NameRule,
    PinBook,
    Refuse,
    TokenBucket,
    decide,
    filter_answer,
    pin_seconds,
    pins_for,
)
from dsec.net.nftrules import NEVER4, PRIVATE4
from dsec.net.nftwire import Pin4

IP = ipaddress.IPv4Address
NET = ipaddress.IPv4Network
POLICY = DnsPolicy(allow=(NameRule("pypi.org", ports=(443, 443), protos=("tcp",)),
                          NameRule("pythonhosted.org", wildcard=True)),
                   deny=(NameRule("evil.pythonhosted.org"),))


def test_refusals() -> None:
    assert decide(POLICY, "github.com.", A) == Refuse("REFUSED", "the name is not in the policy")
    assert decide(POLICY, "evil.pythonhosted.org", A).rcode == "REFUSED"  # type: ignore[union-attr]
    assert decide(POLICY, "pypi.org", 16) == Refuse(
        "REFUSED", "query type 16 is not answered (only A and AAAA)")
    assert decide(POLICY, "pypi.org", AAAA) == Refuse("NOERROR", "no IPv6 on this node")
    assert "253" in decide(POLICY, ".".join(["a" * 63] * 4) + ".pythonhosted.org", A).why  # type: ignore[union-attr]
    assert "label" in decide(POLICY, "a..pythonhosted.org", A).why  # type: ignore[union-attr]
    # the wildcard covers names below it, not the bare name
    assert decide(POLICY, "pythonhosted.org", A).rcode == "REFUSED"  # type: ignore[union-attr]


def test_forward_carries_the_matching_rules() -> None:
    d = decide(POLICY, "Files.PythonHosted.org.", A)
    assert isinstance(d, Forward)
    assert d.name == "files.pythonhosted.org." and [r.name for r in d.rules] == ["pythonhosted.org"]
    assert isinstance(decide(DnsPolicy(open=True), "anything.example", 16), Forward)
    assert decide(DnsPolicy(open=True, deny=(NameRule("x.example"),)), "x.example", A).rcode \
        == "REFUSED"  # type: ignore[union-attr]


def test_rebinding_filter() -> None:
    never = [NET(n) for n in (*NEVER4, "10.213.0.0/16", "203.0.113.254/32")]
    private = [NET(n) for n in PRIVATE4]
    addrs = [IP(a) for a in ("127.0.0.1", "169.254.169.254", "10.213.0.5", "203.0.113.254",
                             "10.1.2.3", "192.168.1.1", "203.0.113.1", "203.0.113.1")]
    assert filter_answer(addrs, never=never, private=private, private_ok=()) == (IP("203.0.113.1"),)
    assert filter_answer(addrs, never=never, private=private,
                         private_ok=(NET("10.1.2.0/24"),)) == (IP("10.1.2.3"), IP("203.0.113.1"))
    # a CIDR entry never unlocks the never set
    assert filter_answer([IP("10.213.0.5")], never=never, private=private,
                         private_ok=(NET("10.0.0.0/8"),)) == ()


def test_pin_timeouts_floor_grace_cap() -> None:
    assert pin_seconds(5) == 90 and pin_seconds(300) == 330 and pin_seconds(86400) == 3600
    pins = pins_for([IP("203.0.113.1")], [NameRule("a.test", protos=("tcp", "udp"),
                                                   ports=(80, 81))], ttl=5)
    assert [(p.proto, p.port) for p in pins] == [("tcp", 80), ("tcp", 81), ("udp", 80),
                                                 ("udp", 81)]
    assert {p.timeout_ms for p in pins} == {90_000}
    assert pins_for([IP("203.0.113.1")], [NameRule("a.test", protos=("tcp",))], 60) == [
        Pin4(IP("203.0.113.1"), "tcp", None, 90_000)]


def test_pin_book_repins_only_what_would_expire() -> None:
    book = PinBook()
    pins = pins_for([IP("203.0.113.1")], [NameRule("a.test", protos=("tcp",), ports=(443, 443))],
                    ttl=60)
    assert book.needed(3, pins, now=100.0, ttl=60) == pins
    book.pinned(3, pins, now=100.0)  # expires at 190
    assert book.needed(3, pins, now=110.0, ttl=50) == []  # cache hit: nothing to pin
    assert book.needed(3, pins, now=150.0, ttl=60) == pins  # would lapse before the TTL
    assert book.count(3, now=150.0) == 1 and book.count(3, now=200.0) == 0
    book.forget(3)
    assert book.needed(3, pins, now=110.0, ttl=50) == pins


def test_token_bucket() -> None:
    b = TokenBucket(rate=2, burst=3)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert b.take(0.4) is False and b.take(0.6) is True


def test_aaaa_spelling_a_never_reachable_ipv4_is_refused() -> None:
    """An AAAA answer that spells a never-reachable IPv4 (NAT64, 6to4, Teredo,
    IPv4-compatible) is judged as that IPv4, even where a policy names the NAT64 range
    (REDTEAM-14b #6)."""
    import ipaddress as ip

    from dsec.net.dnspolicy import filter_answer
    never = [ip.ip_network("169.254.0.0/16"), ip.ip_network("127.0.0.0/8")]
    nat64 = [ip.ip_network("64:ff9b::/96")]
    answer = [ip.ip_address(a) for a in (
        "64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::1", "::7f00:1", "2001:0:a9fe:a9fe::1",
        "64:ff9b::cb00:7101", "2001:db8::1")]
    got = filter_answer(answer, never=never, private=nat64, private_ok=nat64)
    assert [str(a) for a in got] == ["64:ff9b::cb00:7101", "2001:db8::1"]
