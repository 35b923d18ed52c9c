"""Pure parts of the router: addressing, the slot table, the nf_tables/rtnetlink encoders."""

from __future__ import annotations

import ipaddress
import socket
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsec.errors import InternalError, InvalidArgument
from dsec.net import nftrules, rtwire
from dsec.net.addressing import Pool
from dsec.net.nftwire import (
    NFT_MSG_DELSETELEM,
    NFT_MSG_NEWSETELEM,
    NFTA_SET_ELEM_KEY_END,
    Dest4,
    NftBatch,
    SlotPolicy,
    interval4,
    key_ifname,
)
from dsec.net.slots import SLOT_TRANSITIONS, BuildSlots, Drain, DropSlot, SlotEvent, SlotTable

# -------------------------------------------------------------------- addressing


def test_pool_slots_are_31s_and_resolver_is_last() -> None:
    p = Pool("10.213.0.0/16")
    assert p.capacity == 32767
    s = p.slot(17)
    assert (str(s.router_ip), str(s.sandbox_ip), s.ifname) == ("10.213.0.34", "10.213.0.35", "dsv17")
    assert str(p.resolver) == "10.213.255.254"
    last = p.slot(p.capacity - 1)
    assert str(last.sandbox_ip) == "10.213.255.253"
    with pytest.raises(InvalidArgument, match="outside pool"):
        p.slot(p.capacity)


@given(st.integers(min_value=0, max_value=32766))
def test_slot_of_inverts_slot(i: int) -> None:
    p = Pool()
    a = p.slot(i)
    assert p.slot_of(a.sandbox_ip) == i
    assert p.slot_of(a.router_ip) is None  # the router's end names no sandbox
    assert Pool.slot_of_ifname(a.ifname) == i


def test_slot_of_rejects_everything_else() -> None:
    p = Pool("10.213.0.0/16")
    for addr in ("10.213.255.254", "10.213.255.255", "10.214.0.1", "not-an-ip", "10.212.255.255"):
        assert p.slot_of(addr) is None, addr
    for name in ("dsu0", "dsv", "dsv01", "dsvx", "eth0"):
        assert Pool.slot_of_ifname(name) is None, name


def test_pool_refuses_bad_networks() -> None:
    with pytest.raises(InvalidArgument, match="not an IPv4 network"):
        Pool("10.213.0.1/16")
    with pytest.raises(InvalidArgument, match="at least a /30"):
        Pool("10.213.0.0/31")


# -------------------------------------------------------------------- slot table


def test_every_illegal_event_raises_naming_slot_event_state() -> None:
    events = ["built", "build_failed", "take", "policy_loaded", "released", "drained",
              "drain_failed", "lost", "shrink"]
    for state, allowed in SLOT_TRANSITIONS.items():
        for ev in events:
            if ev in allowed:
                continue
            t = SlotTable(capacity=8, pool_min=0)
            if state != "gone":
                t.state[3] = state
                if state == "free":
                    t._free.append(3)
            with pytest.raises(InternalError) as ei:
                t.handle(SlotEvent(ev, 3))  # type: ignore[arg-type]
            assert f"slot 3 (dsv3): event '{ev}' in state '{state}'" in ei.value.message


def test_refill_take_release_drain_cycle() -> None:
    t = SlotTable(capacity=100, pool_min=4, build_batch=3)
    [b] = t.refill()
    assert b == BuildSlots(slots=(0, 1, 2), objects=(0, 1, 2))  # capped by build_batch
    assert t.handle(*(SlotEvent("built", i) for i in b.slots)) == []
    assert t.take() == 0
    assert t.state[0] == "assigned"
    assert t.handle(SlotEvent("released", 0)) == [Drain(0)]
    assert t.state[0] == "draining"
    assert t.handle(SlotEvent("drained", 0)) == []
    # a drained slot goes to the back of the free queue
    assert t._free[-1] == 0


def test_refill_keeps_pool_min_ahead_and_reuses_objects() -> None:
    t = SlotTable(capacity=10, pool_min=2, build_batch=64)
    [b] = t.refill()
    assert b.slots == (0, 1) and b.objects == (0, 1)
    t.handle(SlotEvent("built", 0), SlotEvent("built", 1))
    assert t.refill() == []
    s = t.take()
    assert s == 0
    [b2] = t.refill()  # topped up in a chunk of pool_min, not one at a time
    assert b2.slots == (2, 3)
    # a lost slot is dropped; its index comes back later without new nft objects
    assert t.handle(SlotEvent("lost", 0)) == [DropSlot(0)]
    t.handle(SlotEvent("built", 2))
    t.take()
    t.take()
    [b3] = t.refill()
    assert b3.slots == (0, 4) and b3.objects == (4,)


def test_build_failure_is_forgotten_without_drop() -> None:
    t = SlotTable(capacity=4, pool_min=1)
    [b] = t.refill()
    assert t.handle(SlotEvent("build_failed", b.slots[0])) == []
    assert b.slots[0] not in t.state


def test_full_pool_reserves_nothing() -> None:
    t = SlotTable(capacity=2, pool_min=0)
    b = t.reserve(5)
    assert b is not None and b.slots == (0, 1)
    assert t.reserve(1) is None


# -------------------------------------------------------------------- encoders


def test_interval_element_key_layout() -> None:
    raw = interval4(Dest4.of("203.0.113.16/30", "tcp", (80, 90)))
    key = socket.inet_aton("203.0.113.16") + bytes([6, 0, 0, 0]) + struct.pack("!H", 80) + b"\0\0"
    end = socket.inet_aton("203.0.113.19") + bytes([6, 0, 0, 0]) + struct.pack("!H", 90) + b"\0\0"
    assert key in raw and end in raw
    # KEY_END attribute is present (interval/concatenated sets need it)
    assert struct.pack("=HH", 4 + 4 + 12, NFTA_SET_ELEM_KEY_END | 0x8000) in raw


def test_dest4_str_and_all_ports() -> None:
    assert str(Dest4.of("203.0.113.1/32", "udp", (53, 53))) == "203.0.113.1:53/udp"
    assert str(Dest4.of("203.0.113.0/24", "tcp")) == "203.0.113.0-203.0.113.255/tcp"
    assert Dest4.of("203.0.113.0/24", "tcp").port_hi == 65535


def test_batch_encoding_frames_one_transaction() -> None:
    b = NftBatch("dsec", seq=100)
    b.flush("s0a4").add("s0a4", [interval4(Dest4.of("203.0.113.1/32", "tcp", (80, 80)))] * 2)
    data, seqs = b.encode()
    assert seqs == [101, 102]
    msgs = []
    off = 0
    while off < len(data):
        ln, kind, _flags, seq, _ = struct.unpack_from("=IHHII", data, off)
        msgs.append((kind, seq))
        off += ln
    assert msgs == [(0x10, 100), ((10 << 8) | NFT_MSG_DELSETELEM, 101),
                    ((10 << 8) | NFT_MSG_NEWSETELEM, 102), (0x11, 103)]
    assert b.describe(102) == "add to set dsec/s0a4"
    # duplicates were collapsed (the kernel refuses an interval twice)
    assert data.count(socket.inet_aton("203.0.113.1") + bytes([6, 0, 0, 0])) == 2  # key + key_end


def test_long_element_lists_are_split() -> None:
    b = NftBatch("dsec")
    elems = [interval4(Dest4.of(f"198.51.{i // 256}.{i % 256}/32", "tcp")) for i in range(1200)]
    b.add("s1a4", elems)
    assert len(b) == 3


def test_parse_acks_reads_errors_and_acks() -> None:
    def err(seq: int, code: int) -> bytes:
        body = struct.pack("=i", -code) + struct.pack("=IHHII", 16, 0, 0, seq, 0)
        return struct.pack("=IHHII", 16 + len(body), 2, 0, seq, 0) + body
    acks = rtwire.parse_acks(err(5, 0) + err(6, 17) + struct.pack("=IHHII", 16, 3, 0, 7, 0))
    assert [(a.seq, a.error) for a in acks] == [(5, 0), (6, 17)]
    assert acks[1].message == "File exists"


def test_ifname_key_is_padded_and_bounded() -> None:
    assert key_ifname("dsv3") == b"dsv3" + b"\0" * 12
    with pytest.raises(ValueError):
        key_ifname("x" * 16)


def test_load_batch_swaps_generation_and_refuses_zero() -> None:
    p = Pool()
    b = nftrules.load_batch(NftBatch("dsec"), p.slot(3), SlotPolicy(
        allow4=(Dest4.of("203.0.113.0/24", "tcp", (443, 443)),), open=True), 7)
    names = [b.describe(b.seq + 1 + i) for i in range(len(b))]
    n = len(nftrules.POLICY_SETS)
    assert names[:n] == [f"delete from/flush set dsec/s3{k}" for k in nftrules.POLICY_SETS]
    assert "add to set dsec/s3g" in names and "add to set dsec/s3open" in names
    with pytest.raises(ValueError, match="generation must be positive"):
        nftrules.load_batch(NftBatch("dsec"), p.slot(3), SlotPolicy(), 0)


def test_base_ruleset_collapses_never_set() -> None:
    text = nftrules.base_ruleset(pool=Pool(), uplink="dsu0",
                                 node_addresses=("169.254.213.2", "192.0.2.10"))
    never = next(line for line in text.splitlines() if "never4" in line)
    # 169.254.213.2 lies inside 169.254.0.0/16: collapsed, not listed twice (the kernel
    # refuses overlapping intervals)
    assert "169.254.213.2" not in never and "192.0.2.10/32" in never
    assert "10.213.0.0/16" in never
    assert f"dnat ip to {Pool().resolver}" in text
    assert ipaddress.IPv4Network("198.18.0.0/15") and "198.18.0.0/15" in text


# -------------------------------------------------------------------- disjoint elements

_dest = st.builds(
    lambda a, n, p, lo, span: Dest4(ipaddress.IPv4Address(a), ipaddress.IPv4Address(a + n), p,
                                    lo, min(65535, lo + span)),
    st.integers(0, 40), st.integers(0, 12), st.sampled_from(["tcp", "udp"]),
    st.integers(0, 30), st.integers(0, 12))


def _admits(ds: tuple[Dest4, ...] | list[Dest4], ip: int, proto: str, port: int) -> bool:
    return any(int(d.first) <= ip <= int(d.last) and d.proto == proto
               and d.port_lo <= port <= d.port_hi for d in ds)


@given(st.lists(_dest, max_size=8))
def test_disjoint_admits_the_same_flows_without_overlap(ds: list[Dest4]) -> None:
    from dsec.net.nftwire import disjoint

    out = disjoint(ds)
    for ip in range(55):
        for proto in ("tcp", "udp"):
            for port in range(45):
                assert _admits(out, ip, proto, port) == _admits(ds, ip, proto, port)
    for i, a in enumerate(out):
        for b in out[i + 1:]:
            overlap = (a.proto == b.proto and int(a.first) <= int(b.last)
                       and int(b.first) <= int(a.last) and a.port_lo <= b.port_hi
                       and b.port_lo <= a.port_hi)
            assert not overlap, (a, b)


def test_platform_endpoints_are_never_reachable() -> None:
    """The router's never set and the wire's NEVER_REACHABLE agree, and hold the cloud
    platform endpoints outside link-local (REDTEAM-14 "noticed": Azure's wireserver)."""
    from dsec.net.nftrules import NEVER4
    from dsec.wire.netpolicy import NEVER_REACHABLE, NetworkPolicy
    wire4 = {str(n) for n, _ in NEVER_REACHABLE if n.version == 4}
    assert set(NEVER4) <= wire4
    for addr in ("168.63.129.16", "100.100.100.200", "169.254.169.254"):
        assert any(ipaddress.IPv4Address(addr) in ipaddress.IPv4Network(n) for n in NEVER4)
        with pytest.raises(InvalidArgument, match="never reachable"):
            NetworkPolicy(mode="policy", allow=(f"{addr}:80/tcp",)).validate()
    with pytest.raises(InvalidArgument, match="never reachable"):
        NetworkPolicy(mode="policy", allow=("[fd00:ec2::254]:80/tcp",)).validate()


def test_disjoint_stops_at_its_limit() -> None:
    """A split that passes the limit stops there (the work a refused policy costs is
    bounded), and the same split without a limit is unchanged."""
    from dsec.net.nftwire import Dest4, TooManyElements, disjoint
    a = ipaddress.IPv4Address
    wide = [Dest4(a("1.0.0.0"), a("1.255.255.255"), "tcp", 2 * i + 1, 2 * i + 1)
            for i in range(128)]
    hosts = [Dest4(a(f"1.{i}.{i}.{i}"), a(f"1.{i}.{i}.{i}"), "tcp", 2 * i + 2, 2 * i + 2)
             for i in range(1, 129)]
    with pytest.raises(TooManyElements) as got:
        disjoint(wide + hosts, limit=4096)
    assert 4096 < got.value.count <= 4096 + 129
    small = wide[:3] + hosts[:2]
    assert disjoint(small, limit=4096) == disjoint(small)


def test_load_batch_on_an_empty_slot_flushes_nothing() -> None:
    """A slot fresh from the pool (generation 0: built empty or drained) is loaded with
    adds only; any other load flushes first (else the old tenant's elements stay)."""
    p = Pool()
    pol = SlotPolicy(allow4=(Dest4.of("203.0.113.0/24", "tcp", (443, 443)),))
    fresh = nftrules.load_batch(NftBatch("dsec"), p.slot(3), pol, 7, flush_pins=True,
                                empty=True)
    names = [fresh.describe(fresh.seq + 1 + i) for i in range(len(fresh))]
    # (the router-wide high-water mark ``hwm`` is replaced by every load: not a slot set)
    assert not any(n.startswith("delete") and not n.endswith("/hwm") for n in names), names
    assert "add to set dsec/s3a4" in names and "add to set dsec/s3g" in names
    again = nftrules.load_batch(NftBatch("dsec"), p.slot(3), pol, 8, flush_pins=True)
    flushed = {again.describe(again.seq + 1 + i) for i in range(len(again))}
    assert {f"delete from/flush set dsec/s3{k}" for k in
            (*nftrules.POLICY_SETS, *nftrules.PIN_SETS)} <= flushed
    # a router without IPv6 has no v6 sets: a policy's v6 elements are not loaded
    pol6 = SlotPolicy(allow6=(Dest4.of("2001:db8::/32", "tcp"),))
    off = nftrules.load_batch(NftBatch("dsec"), p.slot(3), pol6, 9)
    on = nftrules.load_batch(NftBatch("dsec"), p.slot(3), pol6, 9, ipv6=True)
    assert not any("s3a6" in off.describe(off.seq + 1 + i) for i in range(len(off)))
    assert "add to set dsec/s3a6" in {on.describe(on.seq + 1 + i) for i in range(len(on))}


def test_a_slot_is_assumed_empty_only_when_known() -> None:
    """Slot.empty defaults to False: a slot made any other way than a fresh build or a
    drain (e.g. adopted after an edge restart) gets its sets flushed by the next load."""
    from dsec.net.router import Slot
    assert Slot(addr=Pool().slot(0), fd=-1).empty is False
