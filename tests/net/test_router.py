"""The router and its slots in real namespaces, with real nftables (no sandbox yet).

A "sandbox" here is a socket opened inside a slot's netns by the test; the fake internet
(tests/net/internet.py) logs what reached it, so "refused" means nothing arrived there.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import time

import pytest

from dsec.errors import BackendError, ResourceExhausted
from dsec.net import netns
from dsec.net.nftwire import Dest4, SlotPolicy
from dsec.net.router import Router, RouterConfig, Slot
from dsec.net.testinternet import (
    ALLOWED,
    CIDR_IN,
    CIDR_OUT,
    OTHER,
    SIBLING,
    TCP_ECHO_PORT,
    UDP_ECHO_PORT,
    Internet,
    links_in,
)
from dsec.net.uplink import NetnsUplink

pytestmark = pytest.mark.root


def tcp(slot: Slot, host: str, port: int, data: bytes = b"hello\n",
        timeout: float = 3.0) -> bytes | OSError:
    with netns.entered(slot.fd):
        c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.settimeout(timeout)
    try:
        c.connect((host, port))
        c.sendall(data)
        return c.recv(200)
    except OSError as exc:
        return exc
    finally:
        c.close()


def open_conn(slot: Slot, host: str, port: int) -> socket.socket:
    with netns.entered(slot.fd):
        c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.settimeout(3.0)
    c.connect((host, port))
    return c


def udp(slot: Slot, host: str, port: int, data: bytes) -> None:
    with netns.entered(slot.fd):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with u:
        u.sendto(data, (host, port))


def allow(*entries: tuple[str, str, tuple[int, int] | None]) -> SlotPolicy:
    return SlotPolicy(allow4=tuple(Dest4.of(n, p, ports) for n, p, ports in entries))


def items(router: Router, slot: Slot, key: str) -> set[str]:
    text = elements(router, slot, key)
    return {x.strip() for x in text.split(",")} if text else set()


def elements(router: Router, slot: Slot, key: str) -> str:
    kind = "map" if key == "g" else "set"
    text = router.nft(f"list {kind} inet dsec s{slot.index}{key}")
    if "elements = {" not in text:
        return ""
    return " ".join(text.split("elements = {", 1)[1].split("}", 1)[0].split())


# ----------------------------------------------------------------------- the router


def test_base_table_and_uplink(router: Router, internet: Internet) -> None:
    text = router.nft("list table inet dsec")
    for needle in ("chain forward", "policy drop", "chain input", "chain pre", "chain post",
                   "masquerade", "dnat ip to 10.213.255.254", "set never4", "10.213.0.0/16",
                   "169.254.0.0/16", "127.0.0.0/8"):
        assert needle in text, needle
    assert "dsu0" in links_in(router.fd)
    assert any(n.startswith("nbup") for n in links_in(internet.fd))
    with open(f"/proc/{os.getpid()}/net/dev") as f:
        assert "dsu0" not in f.read()  # nothing in the host's netns


def test_slot_reaches_only_what_its_policy_allows(router: Router, internet: Internet) -> None:
    s = router.take()
    # nothing loaded: everything is dropped (default deny)
    assert isinstance(tcp(s, ALLOWED, 80, timeout=0.5), OSError)
    assert internet.arrived(dst=ALLOWED, port=80) == []
    gen = router.load(s, allow((f"{ALLOWED}/32", "tcp", (80, 80)),
                               ("203.0.113.16/30", "tcp", (80, 80)),
                               (f"{ALLOWED}/32", "udp", (UDP_ECHO_PORT, UDP_ECHO_PORT))))
    assert gen >= 1
    assert tcp(s, ALLOWED, 80) == f"ok {ALLOWED}:80\n".encode()
    # the internet saw the router's uplink address (masquerade), not the pool
    [hit] = internet.arrived(dst=ALLOWED, port=80, data=b"hello")
    assert hit.src == str(router.uplink.router_ip)
    # other port, other host, CIDR edges
    assert isinstance(tcp(s, ALLOWED, 8080, timeout=0.5), OSError)
    assert isinstance(tcp(s, SIBLING, 80, timeout=0.5), OSError)
    assert tcp(s, CIDR_IN, 80) == f"ok {CIDR_IN}:80\n".encode()
    assert isinstance(tcp(s, CIDR_OUT, 80, timeout=0.5), OSError)
    udp(s, ALLOWED, UDP_ECHO_PORT, b"udp-allowed")
    udp(s, SIBLING, UDP_ECHO_PORT, b"udp-denied")
    udp(s, ALLOWED, UDP_ECHO_PORT + 1, b"udp-other-port")
    assert internet.wait_for(data=b"udp-allowed")
    time.sleep(0.2)
    assert internet.arrived(dst=ALLOWED, port=8080) == []
    assert internet.arrived(dst=SIBLING) == []
    assert internet.arrived(dst=CIDR_OUT) == []
    assert internet.arrived(data=b"udp-denied") == [] and internet.arrived(
        data=b"udp-other-port") == []
    # every dropped packet was counted on the slot's counter
    assert router.counters()[s.index] >= 4


def test_policy_sets_in_the_kernel_match_exactly(router: Router) -> None:
    s = router.take()
    router.load(s, SlotPolicy(
        allow4=(Dest4.of("203.0.113.0/24", "tcp", (443, 443)),
                Dest4.of("198.51.100.7/32", "udp", (1000, 1010))),
        deny4=(Dest4.of("203.0.113.9/32", "tcp", (443, 443)),),
    ))
    assert items(router, s, "a4") == {
        "198.51.100.7 . udp . 1000-1010", "203.0.113.0/24 . tcp . 443"}
    assert items(router, s, "d4") == {"203.0.113.9 . tcp . 443"}
    g1 = s.generation
    assert items(router, s, "l") == {f"0x{g1:08x}"}
    # an update replaces, never merges
    g2 = router.load(s, allow(("198.51.100.0/24", "tcp", None)))
    assert g2 > g1
    assert elements(router, s, "a4") == "198.51.100.0/24 . tcp . 0-65535"
    assert elements(router, s, "d4") == ""
    assert f'"{s.addr.ifname}" : 0x{g2:08x}' in router.nft(f"list map inet dsec s{s.index}g")


def test_a_batch_with_one_bad_element_changes_nothing(router: Router, internet: Internet) -> None:
    s = router.take()
    router.load(s, allow((f"{ALLOWED}/32", "tcp", (80, 80))))
    before = {k: elements(router, s, k) for k in ("a4", "d4", "l")}
    gen = s.generation
    # overlapping intervals in one set: the kernel refuses the element, and with it the
    # flush that came first in the same transaction
    bad = SlotPolicy(allow4=(Dest4.of("198.51.100.0/24", "tcp", (80, 80)),
                             Dest4.of("198.51.100.7/32", "tcp", (80, 80))))
    with pytest.raises(BackendError) as ei:
        router.load(s, bad)
    assert ei.value.detail["errno"] == errno.EEXIST
    assert "s0a4" in ei.value.message or f"s{s.index}a4" in ei.value.message
    assert {k: elements(router, s, k) for k in ("a4", "d4", "l")} == before
    assert s.generation == gen
    assert tcp(s, ALLOWED, 80) == f"ok {ALLOWED}:80\n".encode()  # still enforced as before


def test_update_cuts_live_flows_it_no_longer_allows(router: Router, internet: Internet) -> None:
    s = router.take()
    router.load(s, allow((f"{ALLOWED}/32", "tcp", (TCP_ECHO_PORT, TCP_ECHO_PORT)),
                         (f"{CIDR_IN}/32", "tcp", (TCP_ECHO_PORT, TCP_ECHO_PORT))))
    keep = open_conn(s, CIDR_IN, TCP_ECHO_PORT)
    cut = open_conn(s, ALLOWED, TCP_ECHO_PORT)
    try:
        for c in (keep, cut):
            c.sendall(b"one")
            assert c.recv(10) == b"one"
        router.load(s, allow((f"{CIDR_IN}/32", "tcp", (TCP_ECHO_PORT, TCP_ECHO_PORT))))
        keep.sendall(b"two")
        assert keep.recv(10) == b"two"  # still allowed: re-marked, keeps working
        cut.sendall(b"after-cut")
        cut.settimeout(0.7)
        with pytest.raises(OSError):
            cut.recv(10)
        time.sleep(0.2)
        assert internet.arrived(data=b"after-cut") == []
    finally:
        keep.close()
        cut.close()


def test_anti_spoof_raw_socket_and_icmp(router: Router, internet: Internet) -> None:
    s = router.take()
    router.load(s, allow((f"{ALLOWED}/32", "udp", (UDP_ECHO_PORT, UDP_ECHO_PORT))))
    other = router.take()
    for src in (str(other.addr.sandbox_ip), "198.51.100.99", str(s.addr.sandbox_ip)):
        payload = b"spoofed" + src.encode()
        u = struct.pack("!HHHH", 4444, UDP_ECHO_PORT, 8 + len(payload), 0) + payload
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(u), 1, 0, 64, 17, 0,
                         socket.inet_aton(src), socket.inet_aton(ALLOWED))
        with netns.entered(s.fd):
            raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        with raw:
            raw.sendto(ip + u, (ALLOWED, 0))
    # its own address passes (control), the forged ones never arrive
    assert internet.wait_for(data=b"spoofed" + str(s.addr.sandbox_ip).encode())
    time.sleep(0.2)
    assert internet.arrived(data=b"spoofed" + str(other.addr.sandbox_ip).encode()) == []
    assert internet.arrived(data=b"spoofed198.51.100.99") == []
    # ICMP echo to an allowed address: never forwarded
    with netns.entered(s.fd):
        ic = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    with ic:
        ic.settimeout(0.5)
        ic.sendto(struct.pack("!BBHHH", 8, 0, 0xF7FE, 1, 0), (ALLOWED, 0))
        with pytest.raises(TimeoutError):
            ic.recv(100)


def test_never_reachable_even_in_open_mode(router: Router, internet: Internet) -> None:
    s = router.take()
    router.load(s, SlotPolicy(open=True))
    assert tcp(s, OTHER, 80) == f"ok {OTHER}:80\n".encode()  # any public address
    # the uplink peer (the node), the router, other slots, private ranges: never
    other = router.take()
    for host in (str(router.uplink.peer_ip), str(router.uplink.router_ip),
                 str(s.addr.router_ip), str(other.addr.sandbox_ip), "10.1.2.3", "127.0.0.1"):
        got = tcp(s, host, 80, timeout=0.4)
        assert isinstance(got, OSError), host
    # the router's own resolver address answers on nothing but 53 (nothing listens yet)
    assert isinstance(tcp(s, str(router.pool.resolver), 22, timeout=0.4), OSError)
    # a deny entry wins over open
    router.load(s, SlotPolicy(open=True, deny4=(Dest4.of(f"{OTHER}/32", "tcp", (80, 80)),)))
    assert isinstance(tcp(s, OTHER, 80, timeout=0.5), OSError)


def test_ipv6_is_off_in_slots(router: Router) -> None:
    s = router.take()
    router.load(s, SlotPolicy(open=True))
    with netns.entered(s.fd):
        with open("/proc/sys/net/ipv6/conf/all/disable_ipv6") as f:
            assert f.read().strip() == "1"
        c = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    with c, pytest.raises(OSError):
        c.settimeout(0.5)
        c.connect(("2001:db8::1", 80))


# ----------------------------------------------------------------------- the pool


def test_release_recycles_a_clean_slot(router: Router, internet: Internet) -> None:
    s = router.take()
    router.load(s, allow((f"{ALLOWED}/32", "tcp", (TCP_ECHO_PORT, TCP_ECHO_PORT))))
    old = open_conn(s, ALLOWED, TCP_ECHO_PORT)
    try:
        old.sendall(b"tenant1")
        assert old.recv(10) == b"tenant1"
        index, fd = s.index, s.fd
        router.release(s)
        for k in ("a4", "d4", "l", "g", "q4", "r4"):
            assert elements(router, s, k) == "", k
        assert router.table.state[index] == "free"
        # take the pool empty until the recycled slot comes back
        seen = [router.take() for _ in range(len(router.table._free))]
        again = next(x for x in seen if x.index == index)
        assert again.fd == fd
        router.load(again, allow((f"{SIBLING}/32", "tcp", (80, 80))))
        # loaded without a flush (the drain emptied it): tenant 2's elements only
        assert items(router, again, "a4") == {f"{SIBLING} . tcp . 80"}
        # tenant 1's connection is dead for tenant 2's generation; tenant 2's policy only
        old.sendall(b"leftover")
        old.settimeout(0.7)
        with pytest.raises(OSError):
            old.recv(10)
        assert isinstance(tcp(again, ALLOWED, TCP_ECHO_PORT, timeout=0.5), OSError)
        assert tcp(again, SIBLING, 80) == f"ok {SIBLING}:80\n".encode()
        time.sleep(0.2)
        assert internet.arrived(data=b"leftover") == []
    finally:
        old.close()


def test_take_builds_inline_and_refill_keeps_the_minimum(router: Router) -> None:
    taken = [router.take() for _ in range(5)]  # pool_min 2: at least 3 built inline
    assert len({t.index for t in taken}) == 5
    assert router.table.count("free") == 0
    assert router.refill() == 2
    assert router.table.count("free") == 2
    assert sorted(n for n in links_in(router.fd) if n.startswith("dsv")) == sorted(
        f"dsv{i}" for i in range(7))


def test_lost_slot_is_dropped_and_rebuilt_without_new_objects(router: Router) -> None:
    s = router.take()
    router.load(s, allow((f"{ALLOWED}/32", "tcp", (80, 80))))
    index = s.index
    router.lose(s)
    assert f"dsv{index}" not in links_in(router.fd)
    assert elements(router, s, "a4") == ""
    while router.table.count("free"):
        router.take()
    again = router.take()  # lowest index again, objects reused (no duplicate rules)
    assert again.index == index
    chain = router.nft(f"list chain inet dsec s{index}o")
    assert chain.count("counter name") == 1


def test_full_pool_says_so(internet: Internet) -> None:
    with Router.create(RouterConfig(pool="10.213.0.0/29", pool_min=0),
                       NetnsUplink(internet.fd, "nbfull0")) as r:
        assert r.pool.capacity == 3
        [r.take() for _ in range(3)]
        with pytest.raises(ResourceExhausted, match="pool 10.213.0.0/29 is full"):
            r.take()


def test_close_removes_every_link_and_namespace(internet: Internet) -> None:
    r = Router.create(RouterConfig(pool_min=3), NetnsUplink(internet.fd, "nbclose0"))
    r.refill()
    r.take()
    assert "nbclose0" in links_in(internet.fd)
    r.close()
    deadline = time.monotonic() + 10
    while "nbclose0" in links_in(internet.fd) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "nbclose0" not in links_in(internet.fd)
    assert r.fd == -1 and r.slots == {}
    # the router netns is gone (its uplink's peer went with it); a slot netns held only
    # by our fd went the same way: dsv/eth0 pairs die with either end's namespace


def test_netlink_works_with_fd_numbers_past_fd_setsize() -> None:
    """A router holds an fd per slot: with ~1,000 slots its netlink sockets get numbers
    past select()'s FD_SETSIZE (1024), which select() refused ("filedescriptor out of
    range in select()", found by the 1,000-sandbox bench). The waits use poll()."""
    import resource

    from dsec.net import rtwire
    from dsec.net.kernel import Netlink

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    held = []
    fd = netns.new_netns()
    try:
        while not held or held[-1] < 1100:
            held.append(os.open("/dev/null", os.O_RDONLY))
        rt = Netlink.route(fd)
        try:
            assert rt.sock.fileno() > 1024
            seq = rt.next_seq()
            rt.request(rtwire.link_up(seq, 1), [seq], "lo up")  # acked: no exception
        finally:
            rt.close()
    finally:
        for h in held:
            os.close(h)
        os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
