"""The edge's DNS resolver for sandboxes on router slots (shell over net/dnspolicy.py).

It listens on the pool's resolver address (UDP and TCP port 53) *inside the router
netns*; every DNS packet a sandbox sends anywhere is DNAT'ed there (nftrules' ``pre``
chain), and the anti-spoof rule of each slot makes the source address name the asking
sandbox. Upstream queries leave from another netns (the edge's own in production, so a
host resolver on 127.0.0.53 works; the test internet's in tests), and carry only names a
policy allows: a name no policy lists is refused here and never reaches any upstream.

Runs on the edge's event loop (uvloop): parse + decide + pack is ~45-60 us with dnslib
(plan-14 E9); a pin is one nf_tables batch of a few elements (~0.04-0.12 ms, E2c) sent
*before* the answer, so the sandbox's first ``connect()`` finds its address pinned.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from dnslib import AAAA as AAAARecord
from dnslib import QTYPE, RCODE, RR, DNSRecord
from dnslib import A as ARecord

from dsec.errors import BackendError, Conflict, ResourceExhausted
from dsec.net import netns
from dsec.net.attach import NetPlan, SandboxNetwork
from dsec.net.dnspolicy import (
    A,
    Forward,
    Refuse,
    TokenBucket,
    decide,
    filter_answer,
    pins_for,
)
from dsec.net.nftrules import NEVER4, NEVER6, PRIVATE4, PRIVATE6
from dsec.net.nftwire import Addr
from dsec.net.router import Slot

__all__ = ["Resolver", "ResolverStats"]

log = logging.getLogger(__name__)

_RCODES = {"REFUSED": RCODE.REFUSED, "SERVFAIL": RCODE.SERVFAIL, "NOERROR": RCODE.NOERROR}
MAX_TCP_QUERY = 65535
#: Pins one answer may add (addresses x rule ports): a fraction of a slot's 4,096-element
#: pin set, so one name an agent answers for with hundreds of A records cannot fill it,
#: and the batch stays small on the loop (~0.1 ms for 256 elements).
MAX_PINS_PER_ANSWER = 256
#: A-record addresses kept of one upstream answer.
MAX_ANSWER_ADDRESSES = 64
#: How long a name whose pins the kernel refused is answered SERVFAIL from memory.
PIN_REFUSED_S = 30.0
PIN_WARN_S = 60.0


@dataclass
class ResolverStats:
    queries: int = 0
    answered: int = 0
    refused: int = 0
    servfail: int = 0
    forwarded: int = 0
    cache_hits: int = 0
    pins: int = 0
    rate_limited: int = 0
    #: answers whose slot changed policy or tenant while the upstream answered
    stale: int = 0
    #: answers not pinned (pin set full, or over the per-answer cap) and refused
    pin_refused: int = 0
    refused_by_slot: dict[int, int] = field(default_factory=dict)


@dataclass
class _Cached:
    addresses: tuple[Addr, ...]
    rcode: int
    expires: float
    ttl: int


class Resolver:
    """One per router. ``upstreams``: (address, port) of the servers asked, from the netns
    ``upstream_netns_fd`` (None: the calling process's)."""

    def __init__(
        self, net: SandboxNetwork, *, upstreams: Sequence[tuple[str, int]],
        upstream_netns_fd: int | None = None, clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 2.0, query_rate: float = 500.0, query_burst: float = 1000.0,
        forward_rate: float = 20.0, forward_burst: float = 100.0,
        tcp_per_sandbox: int = 8, tcp_total: int = 1024,
        upstream_per_sandbox: int = 16, upstream_total: int = 512,
    ) -> None:
        if not upstreams:
            raise BackendError("the resolver needs at least one upstream DNS server")
        self.net = net
        self.router = net.router
        self.upstreams = list(upstreams)
        self.upstream_netns_fd = upstream_netns_fd
        self.clock = clock
        self.timeout_s = timeout_s
        self.stats = ResolverStats()
        self._cache: dict[tuple[str, int], _Cached] = {}
        self._qb: dict[int, TokenBucket] = {}
        self._fb: dict[int, TokenBucket] = {}
        self._rates = (query_rate, query_burst, forward_rate, forward_burst)
        pool = self.router.pool
        up = self.router.uplink
        self._never = tuple(ipaddress.ip_network(n) for n in (
            *NEVER4, str(pool.network), f"{up.router_ip}/32", f"{up.peer_ip}/32",
            *NEVER6, str(pool.network6), f"{up.router_ip6}/128", f"{up.peer_ip6}/128",
            *(a if "/" in a else f"{a}/{128 if ':' in a else 32}"
              for a in self.router.config.node_addresses)))
        self._private = tuple(ipaddress.ip_network(n) for n in (*PRIVATE4, *PRIVATE6))
        #: AAAA answered (and v6 addresses pinned) only where slots have IPv6
        self.ipv6 = self.router.config.ipv6
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.tcp_per_sandbox = tcp_per_sandbox
        self.tcp_total = tcp_total
        self._tcp_held: dict[str, int] = {}
        # upstream queries in flight (each an fd and a task), per slot and in all
        self.upstream_per_sandbox = upstream_per_sandbox
        self.upstream_total = upstream_total
        self._inflight: dict[int, int] = {}
        self._inflight_total = 0
        self._pending: dict[tuple[str, int], asyncio.Future[_Cached]] = {}
        self._pin_refused: dict[tuple[int, int, str], float] = {}
        self._pin_warned: dict[int, float] = {}

    # ------------------------------------------------------------------ sockets

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        addr = (str(self.router.pool.resolver), 53)
        with netns.entered(self.router.fd):
            us = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            ts = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            for s in (us, ts):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.setblocking(False)
                s.bind(addr)
            ts.listen(256)
        except BaseException:
            us.close()
            ts.close()
            raise
        transport, _ = await loop.create_datagram_endpoint(lambda: _Udp(self), sock=us)
        self._udp = transport
        self._tcp = await asyncio.start_server(self._tcp_client, sock=ts)

    async def close(self) -> None:
        """Stop answering, and return only once no query of this resolver runs: its
        owner closes ``upstream_netns_fd`` next, and a query still running would
        ``setns`` into that number once another namespace (a sandbox's) took it and ask
        upstream from there. TCP connections are tasks here too (Python 3.11's
        ``Server.wait_closed`` does not wait for them)."""
        self._closed = True
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            await self._tcp.wait_closed()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._udp = None
        self._tcp = None

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tcp_client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        if self._closed or me is None:
            w.close()
            return
        self._tasks.add(me)  # close() cancels and awaits it
        me.add_done_callback(self._tasks.discard)
        peer = w.get_extra_info("peername")
        src = peer[0] if peer else ""
        # Every TCP connection is an fd of the edge: a sandbox holding thousands open
        # would starve the node. A few per sandbox and a node-wide cap; beyond, closed.
        held = self._tcp_held.get(src, 0)
        if held >= self.tcp_per_sandbox or sum(self._tcp_held.values()) >= self.tcp_total:
            self.stats.rate_limited += 1
            w.close()
            return
        self._tcp_held[src] = held + 1
        try:
            while True:
                async with asyncio.timeout(10):
                    head = await r.readexactly(2)
                (n,) = struct.unpack("!H", head)
                async with asyncio.timeout(10):
                    data = await r.readexactly(n)
                reply = await self.answer(peer[0], data)
                if reply is None:
                    return
                w.write(struct.pack("!H", len(reply)) + reply)
                await w.drain()
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            return
        except Exception:  # a bug must cost one connection, never the resolver
            log.exception("dns: answering a TCP query from %s failed", src)
        finally:
            w.close()
            left = self._tcp_held.get(src, 1) - 1
            if left:
                self._tcp_held[src] = left
            else:
                self._tcp_held.pop(src, None)

    # ------------------------------------------------------------------ the decision

    def _bucket(self, table: dict[int, TokenBucket], slot: int, rate: float,
                burst: float) -> TokenBucket:
        b = table.get(slot)
        if b is None:
            b = table[slot] = TokenBucket(rate, burst)
        return b

    def _reply(self, q: DNSRecord, rcode: int, slot: int | None = None) -> bytes:
        rep = q.reply()
        rep.header.rcode = rcode
        if rcode == RCODE.REFUSED:
            self.stats.refused += 1
            if slot is not None:
                self.stats.refused_by_slot[slot] = self.stats.refused_by_slot.get(slot, 0) + 1
        elif rcode == RCODE.SERVFAIL:
            self.stats.servfail += 1
        try:
            return bytes(rep.pack())
        except Exception:  # noqa: BLE001 - dnslib will not re-pack a name over 253 bytes
            return _bare(q.header.id, rcode, q.header.rd)

    async def answer(self, src: str, data: bytes) -> bytes | None:
        """The reply to one query from ``src`` (None: not a DNS query; dropped).

        Every await here (the upstream) can outlive the policy the query was decided
        under: a ``network_update`` may replace it, or the sandbox may be destroyed and
        its slot handed to another tenant. So the decision is taken again *after* the
        await, from the slot's state then, and the pin carries the generation it was
        decided under (``Router.pin`` refuses a stale one): an answer for a name the
        current policy does not allow, or for a tenant that left, pins nothing."""
        self.stats.queries += 1
        index = self.router.pool.slot_of(src)
        now = self.clock()
        qr, qb, fr, fb = self._rates
        # the bucket before the parse: a flood costs a dict lookup per packet, no answer
        if index is not None and not self._bucket(self._qb, index, qr, qb).take(now):
            self.stats.rate_limited += 1
            return None
        try:
            q = DNSRecord.parse(data)
        except Exception:  # noqa: BLE001 - dnslib raises several kinds on garbage
            return None
        if q.header.qr or not q.questions:
            return None
        found = self.net.plan_of_slot(index) if index is not None else None
        if index is None or found is None:
            return self._reply(q, RCODE.REFUSED)
        sid, slot, plan = found
        asked_gen = slot.generation
        qname = str(q.q.qname)
        qtype = int(q.q.qtype)
        d = decide(plan.dns, qname, qtype, ipv6=self.ipv6)
        if isinstance(d, Refuse):
            return self._reply(q, _RCODES[d.rcode], index)
        raw: bytes | None = None
        cached = self._cache.get((d.name, qtype))
        if plan.dns.open and qtype != A:
            cached = None  # forwarded raw, never cached: every one is an upstream query
        if cached is None or cached.expires <= now:
            # every upstream query, of any type, spends the forward bucket and a place
            # in the in-flight caps (each is an fd and a task of the edge)
            if not self._bucket(self._fb, index, fr, fb).take(now):
                self.stats.rate_limited += 1
                return self._reply(q, RCODE.REFUSED, index)
            held = self._inflight.get(index, 0)
            if held >= self.upstream_per_sandbox or self._inflight_total >= self.upstream_total:
                self.stats.rate_limited += 1
                return self._reply(q, RCODE.REFUSED, index)
            self._inflight[index] = held + 1
            self._inflight_total += 1
            try:
                if plan.dns.open and qtype != A:
                    raw = await self._forward_raw(q, index)
                else:
                    cached = await self._resolve_shared(d)
            except (OSError, TimeoutError, BackendError) as exc:
                log.info("dns: upstream failed for %s: %s", d.name, exc)
                return self._reply(q, RCODE.SERVFAIL, index)
            finally:
                left = self._inflight.get(index, 1) - 1
                if left > 0:
                    self._inflight[index] = left
                else:
                    self._inflight.pop(index, None)
                self._inflight_total -= 1
            now = self.clock()
            # The state may have moved during the await: decide again from what is live.
            again = self.net.plan_of_slot(index)
            if again is None or again[0] != sid:
                self.stats.stale += 1
                return self._reply(q, RCODE.REFUSED)  # the asker is gone
            _sid, slot, plan = again
            if slot.generation != asked_gen:
                self.stats.stale += 1
                d2 = decide(plan.dns, qname, qtype, ipv6=self.ipv6)
                if isinstance(d2, Refuse):
                    return self._reply(q, _RCODES[d2.rcode], index)
                if (plan.dns.open and qtype != A) != (cached is None):
                    return self._reply(q, RCODE.SERVFAIL, index)  # the kind changed: ask again
                d = d2
            if cached is None:
                return raw
        else:
            self.stats.cache_hits += 1
        return self._pin_and_answer(q, index, slot, plan, d, cached, now)

    def _pin_and_answer(self, q: DNSRecord, index: int, slot: Slot, plan: NetPlan,
                        d: Forward, cached: _Cached, now: float) -> bytes:
        """Synchronous from here to the reply: nothing can change the slot in between."""
        if cached.rcode != RCODE.NOERROR:
            return self._reply(q, cached.rcode, index)
        keep = filter_answer(cached.addresses, never=self._never, private=self._private,
                             private_ok=plan.dns.private_ok)
        if not keep:
            return self._reply(q, RCODE.REFUSED, index)
        ttl = max(1, int(cached.expires - now))
        if not plan.dns.open:
            refused_key = (index, slot.generation, d.name)
            if self._pin_refused.get(refused_key, 0.0) > now:
                self.stats.pin_refused += 1
                return self._reply(q, RCODE.SERVFAIL, index)
            per = len(pins_for(keep[:1], d.rules, ttl))
            if per > MAX_PINS_PER_ANSWER:
                return self._pin_failed(q, index, refused_key, now, (
                    f"{d.name} needs {per} pins per address (its rules' ports), over "
                    f"{MAX_PINS_PER_ANSWER} per answer"))
            # An answer pins at most MAX_PINS_PER_ANSWER elements: the addresses beyond
            # are left out of the answer too (a sandbox is never told an address it
            # cannot reach); an agent-run server answering 300 A records gets 16.
            keep = keep[:max(1, MAX_PINS_PER_ANSWER // max(1, per))]
            want = pins_for(keep, d.rules, ttl)
            need = self.net.pins.needed(index, want, now, ttl)
            if need:
                try:
                    self.router.pin(slot, need, generation=slot.generation)
                except Conflict:  # cannot happen on the loop; a thread could
                    self.stats.stale += 1
                    return self._reply(q, RCODE.SERVFAIL, index)
                except ResourceExhausted as exc:  # a full pin set: never evict live pins
                    return self._pin_failed(q, index, refused_key, now, exc.message)
                except BackendError as exc:
                    return self._pin_failed(q, index, refused_key, now, exc.message)
                self.net.pins.pinned(index, need, now)
                self.stats.pins += len(need)
        rep = q.reply()
        for a in keep:
            if a.version == 6:
                rep.add_answer(RR(q.q.qname, QTYPE.AAAA, rdata=AAAARecord(str(a)), ttl=ttl))
            else:
                rep.add_answer(RR(q.q.qname, QTYPE.A, rdata=ARecord(str(a)), ttl=ttl))
        self.stats.answered += 1
        return bytes(rep.pack())

    def _pin_failed(self, q: DNSRecord, index: int, key: tuple[int, int, str],
                    now: float, why: str) -> bytes:
        """SERVFAIL, remembered for PIN_REFUSED_S (cache hits do not send the refused
        batch again), and one warning per slot per PIN_WARN_S."""
        self.stats.pin_refused += 1
        self._pin_refused[key] = now + PIN_REFUSED_S
        if len(self._pin_refused) > 4096:
            self._pin_refused = {k: t for k, t in self._pin_refused.items() if t > now}
        if self._pin_warned.get(index, -PIN_WARN_S) + PIN_WARN_S <= now:
            self._pin_warned[index] = now
            log.warning("dns: slot %d: %s is answered SERVFAIL for %.0f s: %s",
                        index, key[2], PIN_REFUSED_S, why)
        return self._reply(q, RCODE.SERVFAIL, index)

    async def _resolve_shared(self, d: Forward) -> _Cached:
        """One upstream query per (name, type) at a time: concurrent askers share it."""
        key = (d.name, d.qtype)
        fut = self._pending.get(key)
        if fut is not None:
            return await asyncio.shield(fut)
        fut = asyncio.get_running_loop().create_future()
        self._pending[key] = fut
        try:
            got = await self._resolve(d)
        except BaseException as exc:
            if not fut.done():
                fut.set_exception(exc if isinstance(exc, Exception) else OSError("cancelled"))
                fut.exception()  # retrieved: no "never retrieved" warning without sharers
            raise
        else:
            fut.set_result(got)
            self._cache[key] = got
            return got
        finally:
            self._pending.pop(key, None)

    # ------------------------------------------------------------------ upstream

    async def _ask(self, pkt: bytes, qid: int, *, tcp: bool = False) -> DNSRecord:
        loop = asyncio.get_running_loop()
        last: Exception = TimeoutError("no upstream answered")
        for host, port in self.upstreams:
            if self._closed:  # its upstream netns fd may be closed (and reused) now
                raise OSError("the resolver is closed")
            kind = socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM
            if self.upstream_netns_fd is None:
                s = socket.socket(socket.AF_INET, kind)
            else:
                with netns.entered(self.upstream_netns_fd):
                    s = socket.socket(socket.AF_INET, kind)
            s.setblocking(False)
            try:
                async with asyncio.timeout(self.timeout_s):
                    await loop.sock_connect(s, (host, port))
                if tcp:
                    await loop.sock_sendall(s, struct.pack("!H", len(pkt)) + pkt)
                    buf = b""
                    while len(buf) < 2 or len(buf) < 2 + struct.unpack("!H", buf[:2])[0]:
                        async with asyncio.timeout(self.timeout_s):
                            chunk = await loop.sock_recv(s, 65537)
                        if not chunk:
                            raise OSError("upstream closed the TCP connection")
                        buf += chunk
                    data = buf[2:]
                else:
                    await loop.sock_sendall(s, pkt)
                    async with asyncio.timeout(self.timeout_s):
                        data = await loop.sock_recv(s, 65535)
                r = DNSRecord.parse(data)
                if r.header.id != qid:
                    raise OSError("upstream answered another query id")
                return r
            except (OSError, TimeoutError) as exc:
                last = exc
            except Exception as exc:  # noqa: BLE001 - unparsable upstream answer
                last = OSError(f"bad upstream answer: {exc}")
            finally:
                s.close()
        raise last

    async def _resolve(self, d: Forward) -> _Cached:
        self.stats.forwarded += 1
        q = DNSRecord.question(d.name, QTYPE[d.qtype])
        r = await self._ask(q.pack(), q.header.id)
        if r.header.tc:
            r = await self._ask(q.pack(), q.header.id, tcp=True)
        # At most MAX_ANSWER_ADDRESSES kept (a real answer holds a handful; an agent's
        # own server may send hundreds, and each is filtered on every cached query)
        want = QTYPE.AAAA if d.qtype == QTYPE.AAAA else QTYPE.A
        addrs = tuple(ipaddress.ip_address(str(rr.rdata)) for rr in r.rr
                      if rr.rtype == want)[:MAX_ANSWER_ADDRESSES]
        ttl = min((rr.ttl for rr in r.rr if rr.rtype == want), default=30)
        ttl = max(1, min(ttl, 3600))
        rcode = int(r.header.rcode)
        if rcode == RCODE.NOERROR and not addrs:
            rcode = RCODE.NXDOMAIN if not r.rr else RCODE.NOERROR
        return _Cached(addrs, rcode, self.clock() + ttl, ttl)

    async def _forward_raw(self, q: DNSRecord, index: int) -> bytes:
        """Mode open, a type other than A: the upstream's answer, A and AAAA records
        filtered (an AAAA pointing at ::1 or the pool is rebinding as much as an A)."""
        self.stats.forwarded += 1
        try:
            r = await self._ask(q.pack(), q.header.id)
        except (OSError, TimeoutError) as exc:
            log.info("dns: upstream failed: %s", exc)
            return self._reply(q, RCODE.SERVFAIL, index)
        r.rr = [rr for rr in r.rr if rr.rtype not in (QTYPE.A, QTYPE.AAAA) or filter_answer(
            [ipaddress.ip_address(str(rr.rdata))], never=self._never, private=self._private,
            private_ok=())]
        return bytes(r.pack())


def _bare(qid: int, rcode: int, rd: int) -> bytes:
    """A reply header with no question echoed (for queries dnslib cannot re-encode)."""
    flags = 0x8000 | 0x0080 | (0x0100 if rd else 0) | (rcode & 0xF)  # QR, RA, RD, rcode
    return struct.pack("!HHHHHH", qid, flags, 0, 0, 0, 0)


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, resolver: Resolver) -> None:
        self.r = resolver
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.r._spawn(self._one(data, addr))

    async def _one(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            reply = await self.r.answer(addr[0], data)
        except Exception:  # a bug must cost one answer, never the resolver
            log.exception("dns: answering a query from %s failed", addr[0])
            reply = _bare(struct.unpack("!H", data[:2])[0], RCODE.SERVFAIL, 1) \
                if len(data) >= 2 else None
        if reply is not None and self.transport is not None:
            with contextlib.suppress(OSError):
                self.transport.sendto(reply, addr)
