"""The node's router netns and its slot pool (shell over addressing/slots/nftrules/nftwire).

One router network namespace per edge holds every filtering rule, the NAT and (later) the
DNS resolver's socket; each sandbox gets a routed /31 veth into it (plan-14 §4.1). All of
the enforcement sits outside anything the sandbox can reach, even a sandbox root holding
``CAP_NET_RAW``.

Slots are held by this process's file descriptors (no bind mounts): an unassigned slot
lives exactly as long as the router object's fd, so a crash frees them by itself. The
router netns itself is bind-mounted on a file under the node's state dir when the edge
opens it with :meth:`Router.open` (``dsec edge --state-dir``): it outlives a crash or a
restart of the edge, and so do the slots of live sandboxes (their netns is held by their
processes, their ``dsvN`` end by the pinned router); the restarted edge re-opens it and
reconciles it against its journal (net/reconcile.py). :meth:`Router.create` (tests,
benches) holds it by an fd only.

Threads: every public method takes one lock; the calls are synchronous and short (a slot
build ~1 ms, a policy batch < 1 ms), so the edge may call them from its loop or from a
worker thread (a background refill). ``setns``/``unshare`` only ever move the calling
thread, and back. The one exception is :meth:`Router.refill`, which builds without the
lock (a create must not wait for a batch of 64 slots): it counts itself in
``_builders``, and :meth:`Router.close` marks the router closing and waits for that count
to reach 0 before it closes any fd. An fd closed under a running builder would be a
hole, not only a crash: its number is reused by the next fd opened - often another
namespace's - and the builder would ``setns`` into that namespace (a sandbox's) and build
there, or libnftables would run on a freed context (heap corruption, ``dsec bench net``).
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import subprocess
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, Self

from dsec.errors import BackendError, Conflict, InvalidArgument, ResourceExhausted
from dsec.net import netns, nftrules, rtwire
from dsec.net.addressing import SANDBOX_IFINDEX, SANDBOX_IFNAME, Pool, SlotAddr
from dsec.net.kernel import Netlink, Nft
from dsec.net.nftwire import NftBatch, Pin4, SlotPolicy, ct_flush_from
from dsec.net.reconcile import (
    AttachUplink,
    BuildBase,
    BuildObjects,
    DeleteLink,
    FlushSlot,
    Listing,
    ReplaceBase,
    StartGenerations,
    parse_listing,
)
from dsec.net.slots import BuildSlots, Drain, Instruction, SlotEvent, SlotTable
from dsec.net.uplink import UPLINK_IFNAME, Uplink

__all__ = ["Router", "RouterConfig", "RouterInstruction", "Slot"]

#: reconcile's instructions the router carries out itself (the rest are per sandbox)
RouterInstruction = (BuildBase | ReplaceBase | AttachUplink | StartGenerations | BuildObjects
                     | DeleteLink | FlushSlot)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    pool: str = "10.213.0.0/16"
    #: slots also get IPv6 (a /127 each from ``pool6``, NAT66 out of the uplink, the
    #: policies' v6 entries enforced); off: every v6 packet of a slot is dropped
    ipv6: bool = False
    pool6: str = "fd00:d5ec::/48"
    pool_min: int = 32
    build_batch: int = 64
    # Added to the never-reachable set (the host's own addresses).
    node_addresses: tuple[str, ...] = ()
    table: str = nftrules.TABLE
    #: concurrent flows of a sandbox whose policy names no max_connections
    max_connections: int = nftrules.DEFAULT_MAX_CONNECTIONS


#: the router netns's conntrack timeouts (seconds) of states ``ct count`` does not count
CONNTRACK_TIMEOUTS: Final = {"tcp_timeout_time_wait": "0", "tcp_timeout_close": "0"}


@dataclass(slots=True)
class Slot:
    """A built slot: its addresses and the fd holding its netns."""

    addr: SlotAddr
    fd: int
    generation: int = 0
    #: its sets are known to hold nothing: set only where that is certain (built
    #: fresh, or drained by a recycle), cleared by a load; the next load then adds
    #: without flushing. Default False: a slot adopted or rebuilt any other way is
    #: flushed first (a stale element left behind would be a hole)
    empty: bool = False
    #: the flow cap its ``sNk`` chain holds now
    conn_cap: int = nftrules.DEFAULT_MAX_CONNECTIONS
    #: the tbf rate its veth ends are shaped to (None: not shaped)
    rate_mbit: int | None = None

    @property
    def index(self) -> int:
        return self.addr.index


@dataclass
class _Counters:
    built: int = 0
    drained: int = 0
    dropped: int = 0
    policy_loads: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class Router:
    """The router netns of one node: base table, uplink, slot pool.

    ``Router.create(config, uplink)`` builds everything fresh; ``close()`` releases every
    fd, which makes the kernel remove the router netns, every slot netns not held by a
    sandbox, and every veth and nft object with them.
    """

    def __init__(self, config: RouterConfig, uplink: Uplink) -> None:
        self.config = config
        self.pool = Pool(config.pool, config.pool6)
        self.uplink = uplink
        if uplink.peer_ip in self.pool.network or uplink.router_ip in self.pool.network:
            raise InvalidArgument(
                f"net pool {self.pool.network} overlaps the uplink link (peer "
                f"{uplink.peer_ip}, router {uplink.router_ip}): slots would sit on the "
                "uplink's addresses; pick a pool and a --net-link apart", field="net_pool")
        self.table = SlotTable(capacity=self.pool.capacity, pool_min=config.pool_min,
                               build_batch=config.build_batch)
        self.slots: dict[int, Slot] = {}
        self.stats = _Counters()
        self._lock = threading.RLock()
        #: refills building outside the lock right now; close() waits for 0 (on _idle)
        self._builders = 0
        self._idle = threading.Condition(self._lock)
        #: close() has begun: no new build starts, a build that ends keeps nothing
        self._closing = False
        self._generation = 0
        self.fd = -1
        #: where the router netns is bind-mounted (None: held by self.fd only)
        self.pin_path: str | None = None
        #: the pinned router was a previous edge's (False: made by this process)
        self.reopened = False
        self._links: list[str] = []
        #: the uplink's host addresses in the never-reachable set (None: not read yet)
        self._guarded: tuple[str, ...] | None = None
        self._rt: Netlink | None = None
        self._nl: Netlink | None = None
        self._nft: Nft | None = None

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, config: RouterConfig, uplink: Uplink) -> Router:
        r = cls(config, uplink)
        try:
            r._start()
        except BaseException:
            r.close()
            raise
        return r

    @classmethod
    def open(cls, config: RouterConfig, uplink: Uplink, pin_path: str) -> Router:
        """The router netns pinned at ``pin_path`` by an earlier edge of this node, or a
        new one pinned there. Its base table, uplink and slots are brought in line by
        reconcile (:meth:`reconcile_view`, :meth:`apply`) before the edge serves; nothing
        is refilled here."""
        r = cls(config, uplink)
        r.pin_path = pin_path
        try:
            fd = netns.open_pinned(pin_path)
            if fd is None:
                r.fd = netns.new_netns()
                netns.pin(r.fd, pin_path)
            else:
                r.fd, r.reopened = fd, True
            r._setup_netns()
        except BaseException:
            r.close(unpin=not r.reopened)
            raise
        return r

    def _start(self) -> None:
        self.fd = netns.new_netns()
        self._setup_netns()
        self.uplink.attach(self.rtnl, ipv6=self.config.ipv6)
        self.nft(self._base_text())

    def _base_text(self, *, replace: bool = False) -> str:
        fn = nftrules.replace_base if replace else nftrules.base_ruleset
        return fn(pool=self.pool, uplink=UPLINK_IFNAME, node_addresses=self._never(),
                  table=self.config.table, ipv6=self.config.ipv6)

    def base_digest(self) -> str:
        return nftrules.base_digest(pool=self.pool, uplink=UPLINK_IFNAME,
                                    node_addresses=self._never(), table=self.config.table,
                                    ipv6=self.config.ipv6)

    def _never(self) -> tuple[str, ...]:
        if self._guarded is None:
            self._guarded = self.uplink.guarded_addresses()
        return (*self.config.node_addresses, *self._guarded,
                f"{self.uplink.router_ip}/32", f"{self.uplink.peer_ip}/32",
                f"{self.uplink.router_ip6}/128", f"{self.uplink.peer_ip6}/128")

    def watch_uplink(self) -> str | None:
        """Re-check what guards the host (called on every denied-counter poll): the
        host's addresses in the never-reachable set (re-read; a change rewrites the base
        objects in one transaction, slots kept) and the uplink's host-side objects
        (:meth:`Uplink.check`). Returns what was wrong and done, or None."""
        with self._lock:
            if self._closing:  # the uplink is detached: checking it would put it back
                raise BackendError("the router is closed: its uplink is not watched")
            now = self.uplink.guarded_addresses()
            said = []
            if now != self._guarded:
                self._guarded = now
                self.nft(self._base_text(replace=True))
                said.append(f"host addresses now never reachable: {', '.join(now)}")
            fixed = self.uplink.check()
            if fixed:
                said.append(fixed)
            return "; ".join(said) or None

    def _setup_netns(self) -> None:
        """Sysctls, sockets and the resolver's address on lo (idempotent: also for a
        reopened router)."""
        netns.write_sysctl(self.fd, "net/ipv4/ip_forward", "1")  # this netns only
        # Strict reverse-path filter: a packet whose source is not routed back through
        # the device it came in on is dropped before any hook. The slots' anti-spoof
        # rules guard the forward path; this also guards what a slot sends to the
        # router itself (DNS to the resolver: with another slot's source, a sandbox
        # holding CAP_NET_RAW would spend that tenant's DNS budget and pins).
        for k in ("all", "default"):
            netns.write_sysctl(self.fd, f"net/ipv4/conf/{k}/rp_filter", "1")
        # Closed flows leave the router's conntrack at once: ``ct count`` (the flow cap)
        # forgets a TCP flow in TIME_WAIT or CLOSE, but conntrack would keep it 120 s /
        # 10 s, so a sandbox looping connect-close held 120 s x its connection rate of
        # the table every tenant of the router shares, uncapped (REDTEAM-14b #8). These
        # timeouts are the router netns's own (per netns); the endpoints' TCP stacks keep
        # their TIME_WAIT semantics. docs/networking.md: the node-wide nf_conntrack_max.
        for key, value in CONNTRACK_TIMEOUTS.items():
            netns.write_sysctl(self.fd, f"net/netfilter/nf_conntrack_{key}", value)
        v6 = self.config.ipv6
        for k in ("all", "default"):
            netns.write_sysctl(self.fd, f"net/ipv6/conf/{k}/disable_ipv6", "0" if v6 else "1")
        if v6:
            # forwarding also makes the router ignore router advertisements
            netns.write_sysctl(self.fd, "net/ipv6/conf/all/forwarding", "1")
        self._rt = Netlink.route(self.fd)
        self._nl = Netlink.netfilter(self.fd)
        self._nft = Nft(self.fd)
        seq = self._rt.next_seq(2)
        try:
            self._rt.request(rtwire.messages(
                rtwire.link_up(seq, 1),
                rtwire.addr_add(seq + 1, 1, self.pool.resolver, 32),
            ), [seq, seq + 1], "router lo")
        except BackendError as exc:
            if exc.detail.get("errno") != errno.EEXIST:  # a reopened router has it
                raise

    def close(self, *, unpin: bool | None = None) -> None:
        """Release every fd (slots held by live sandboxes stay alive in them). A pinned
        router is unpinned (the kernel then removes it with its uplink and every nft
        object) when ``unpin``, or (None) when no sandbox holds a slot: a clean exit
        with live sandboxes keeps it for the next edge, which adopts them."""
        with self._lock:
            self._closing = True
            while self._builders:  # a refill builds without the lock: its fds stay
                self._idle.wait()   # valid (and the nft context alive) until it ends
            if unpin is None:
                unpin = self.table.count("assigned") == 0
            if self.fd >= 0 and (self.pin_path is None or unpin):
                # the router goes away: so do the host uplink's table, veth and sysctls
                # (kept with a pinned router, for the next edge's live sandboxes)
                self.uplink.detach()
            if self.pin_path is not None and unpin:
                try:
                    netns.unpin(self.pin_path)
                except OSError as exc:
                    log.warning("net: unpinning the router at %s failed: %s",
                                self.pin_path, exc)
            for s in self.slots.values():
                _close(s.fd)
            self.slots.clear()
            for x in (self._rt, self._nl):
                if x is not None:
                    x.close()
            if self._nft is not None:
                self._nft.close()
            self._rt = self._nl = None
            self._nft = None
            if self.fd >= 0:
                _close(self.fd)
                self.fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ accessors

    @property
    def nft(self) -> Nft:
        if self._nft is None:
            raise BackendError("the router is closed")
        return self._nft

    @property
    def netlink(self) -> Netlink:
        if self._nl is None:
            raise BackendError("the router is closed")
        return self._nl

    @property
    def rtnl(self) -> Netlink:
        if self._rt is None:
            raise BackendError("the router is closed")
        return self._rt

    # ------------------------------------------------------------------ pool

    def refill(self) -> int:
        """Build slots until the pool holds ``pool_min`` free ones; returns how many.

        Safe on a worker thread while the loop takes, loads and releases slots: the
        router's lock is held only to reserve indices and to record what was built, not
        while building (each kernel socket and the libnftables context have their own
        lock), so a create never waits for a batch of 64 slots."""
        with self._lock:
            if self._closing or self.fd < 0:
                return 0
            todo = self.table.refill()
            if not todo:
                return 0
            self._builders += 1  # close() waits for us before closing any fd
        built = 0
        try:
            for ins in todo:
                assert isinstance(ins, BuildSlots)
                events = self._build(ins)
                with self._lock:
                    if self._closing:  # close() is waiting: what was built is not kept
                        for i in ins.slots:
                            slot = self.slots.pop(i, None)
                            if slot is not None:
                                _close(slot.fd)
                        return built
                    self.table.handle(*events)
                built += sum(1 for e in events if e.kind == "built")
            return built
        finally:
            with self._lock:
                self._builders -= 1
                self._idle.notify_all()

    def needs_refill(self) -> bool:
        with self._lock:
            return (self.table.count("free") + self.table.count("building")
                    < self.table.pool_min)

    def ensure_free(self, n: int) -> int:
        """Build slots (``build_batch`` at a time) until ``n`` are free, or the pool is
        full; returns how many were built. For a known burst of creates."""
        built = 0
        with self._lock:
            while not self._closing and self.table.count("free") < n:
                b = self.table.reserve(min(self.config.build_batch,
                                           n - self.table.count("free")))
                if b is None:
                    break
                events = self._build(b)
                self.table.handle(*events)
                got = sum(1 for e in events if e.kind == "built")
                if not got:
                    break
                built += got
        return built

    def _execute(self, instructions: Iterable[Instruction]) -> int:
        built = 0
        todo = list(instructions)
        while todo:
            ins = todo.pop(0)
            if isinstance(ins, BuildSlots):
                events = self._build(ins)
                built += sum(1 for e in events if e.kind == "built")
            elif isinstance(ins, Drain):
                events = [self._drain(ins.slot)]
            else:
                self._drop(ins.slot)
                events = []
            todo += self.table.handle(*events)
        return built

    def _build(self, ins: BuildSlots) -> list[SlotEvent]:
        if ins.objects:
            try:
                self.nft(nftrules.slot_objects((self.pool.slot(i) for i in ins.objects),
                                               table=self.config.table,
                                               max_connections=self.config.max_connections,
                                               ipv6=self.config.ipv6))
            except BackendError as exc:
                log.warning("net: nft objects of slots %s failed: %s", ins.objects, exc.message)
                return [SlotEvent("build_failed", i) for i in ins.slots]
        events: list[SlotEvent] = []
        for i in ins.slots:
            try:
                self.slots[i] = self._build_one(self.pool.slot(i))
            except OSError as exc:
                log.warning("net: building slot %d failed: %s", i, exc)
                events.append(SlotEvent("build_failed", i))
            except BackendError as exc:
                log.warning("net: building slot %d failed: %s", i, exc.message)
                events.append(SlotEvent("build_failed", i))
            else:
                events.append(SlotEvent("built", i))
                self.stats.built += 1
        # Sets of rebuilt indices may hold a previous tenant's elements: empty them; and
        # their flow cap may be a previous tenant's: back to the node's default.
        batch = NftBatch(self.config.table)
        caps: list[str] = []
        for e in events:
            if e.kind == "built" and e.slot not in ins.objects:
                nftrules.drain_batch(batch, self.pool.slot(e.slot), self.config.ipv6)
                caps.append(nftrules.conn_cap(self.pool.slot(e.slot),
                                              self.config.max_connections,
                                              table=self.config.table))
        self.netlink.commit(batch, "flush rebuilt slots")
        for e in events:  # a previous router's tenant of the index left flows behind
            if e.kind == "built" and e.slot not in ins.objects:
                self._forget_flows(self.pool.slot(e.slot))
        if caps:
            self.nft("".join(caps))
        for e in events:  # fresh objects, or flushed just now
            if e.kind == "built":
                self.slots[e.slot].empty = True
        return events

    def _build_one(self, a: SlotAddr) -> Slot:
        fd = netns.new_netns()
        v6 = self.config.ipv6
        try:
            with netns.entered(fd):
                # IPv6 on: no router advertisements or autoconfiguration (the slot's one
                # address and route are dsec's); off: no IPv6 at all in the slot
                conf = ({"disable_ipv6": "0", "accept_ra": "0", "autoconf": "0"} if v6
                        else {"disable_ipv6": "1"})
                for k in ("all", "default"):
                    for key, value in conf.items():
                        with open(f"/proc/sys/net/ipv6/conf/{k}/{key}", "w") as f:
                            f.write(value)
            n = 4 if v6 else 3
            seq = self.rtnl.next_seq(n)
            self.rtnl.request(rtwire.messages(
                rtwire.veth_pair(seq, name=a.ifname, index=a.router_ifindex,
                                 peer=SANDBOX_IFNAME, peer_index=SANDBOX_IFINDEX,
                                 peer_netns_fd=fd),
                rtwire.addr_add(seq + 1, a.router_ifindex, a.router_ip, 31),
                rtwire.link_up(seq + 2, a.router_ifindex),
                *([rtwire.addr_add(seq + 3, a.router_ifindex, a.router_ip6, 127)] if v6
                  else []),
            ), list(range(seq, seq + n)), f"slot {a.index} router side")
            try:
                rt = Netlink.route(fd)
                try:
                    m = 6 if v6 else 4
                    s = rt.next_seq(m)
                    rt.request(rtwire.messages(
                        rtwire.addr_add(s, SANDBOX_IFINDEX, a.sandbox_ip, 31),
                        rtwire.link_up(s + 1, SANDBOX_IFINDEX),
                        rtwire.link_up(s + 2, 1),
                        rtwire.default_route(s + 3, a.router_ip, SANDBOX_IFINDEX),
                        *([rtwire.addr_add(s + 4, SANDBOX_IFINDEX, a.sandbox_ip6, 127),
                           rtwire.default_route(s + 5, a.router_ip6, SANDBOX_IFINDEX)]
                          if v6 else []),
                    ), list(range(s, s + m)), f"slot {a.index} sandbox side")
                finally:
                    rt.close()
            except BaseException:
                self._del_link(a)
                raise
        except BaseException:
            _close(fd)
            raise
        return Slot(addr=a, fd=fd, conn_cap=self.config.max_connections)

    def _del_link(self, a: SlotAddr) -> None:
        seq = self.rtnl.next_seq()
        try:
            self.rtnl.request(rtwire.link_del(seq, a.router_ifindex), [seq],
                              f"delete {a.ifname}")
        except BackendError as exc:
            if exc.detail.get("errno") != 19:  # ENODEV: already gone with its netns
                raise

    def _forget_flows(self, a: SlotAddr) -> None:
        """Delete every conntrack entry of the slot's addresses (ctnetlink, in the router
        netns): its tenant's flows - open, closing (TIME_WAIT, 120 s) or DNAT'ed DNS -
        never outlive it. The generations already keep such a flow from matching the
        next tenant's ``l`` set (``hwm``); this also frees the table they would hold
        (the flow cap counts only the live slot's entries). A failure is logged, never
        fatal: the generation is the guarantee, this the hygiene."""
        for ip in (a.sandbox_ip, *((a.sandbox_ip6,) if self.config.ipv6 else ())):
            seq = self.netlink.next_seq()
            try:
                self.netlink.request(ct_flush_from(seq, ip), [seq],
                                     f"forget the flows of {ip} (slot {a.index})")
            except BackendError as exc:
                log.warning("net: %s", exc.message)

    def _drain(self, index: int) -> SlotEvent:
        a = self.pool.slot(index)
        try:
            self.netlink.commit(
                nftrules.drain_batch(NftBatch(self.config.table), a, self.config.ipv6),
                f"drain slot {index}")
        except BackendError as exc:
            log.warning("net: draining slot %d failed: %s", index, exc.message)
            return SlotEvent("drain_failed", index)
        self._forget_flows(a)
        self.stats.drained += 1
        slot = self.slots.get(index)
        if slot is not None:
            slot.generation = 0
            slot.empty = True
            if slot.rate_mbit is not None:  # the next tenant starts unshaped
                self._shape(slot, None)
        return SlotEvent("drained", index)

    def _drop(self, index: int) -> None:
        slot = self.slots.pop(index, None)
        a = self.pool.slot(index)
        try:
            self._del_link(a)
            self.netlink.commit(
                nftrules.drain_batch(NftBatch(self.config.table), a, self.config.ipv6),
                f"flush dropped slot {index}")
            self._forget_flows(a)
        finally:
            if slot is not None:
                _close(slot.fd)
            self.stats.dropped += 1

    # ------------------------------------------------------------------ reconcile

    def held(self) -> threading.RLock:
        """The router's lock, for a caller that must keep several calls together (net
        reconcile: the kernel view and the plan's steps, with no build in between)."""
        return self._lock

    def owned_slots(self) -> frozenset[int]:
        """Slots this router object holds or is building (not leftovers of an earlier
        edge process)."""
        with self._lock:
            return frozenset(self.table.state)

    def reconcile_view(self) -> Listing:
        """What the router holds (links, base table digest, slot objects, live
        generations and their policy digests, DNS pins): one link listing and one
        libnftables JSON listing of the table."""
        with self._lock:
            if self._closing:
                raise BackendError("the router is closed: nothing to reconcile")
            with netns.entered(self.fd):
                names = [n for _, n in socket.if_nameindex()]
            try:
                text = self.nft.json(f"list table inet {self.config.table}")
            except BackendError as exc:
                if "No such file or directory" not in exc.message:
                    raise
                text = ""
            self._links = names
            return parse_listing(text, names, self.pool)

    def has_uplink(self) -> bool:
        return UPLINK_IFNAME in self._links

    def adopt_uplink(self) -> None:
        """The uplink veth was kept with this reopened router: its other objects (a host
        uplink's table and sysctls) are checked and put back in place."""
        with self._lock:
            self.uplink.adopt()

    def apply(self, ins: RouterInstruction) -> None:
        """Carry out one router-wide instruction of reconcile's plan."""
        with self._lock:
            if isinstance(ins, BuildBase):
                self.nft(self._base_text())
            elif isinstance(ins, ReplaceBase):
                self.nft(self._base_text(replace=True))
            elif isinstance(ins, AttachUplink):
                self.uplink.attach(self.rtnl, ipv6=self.config.ipv6)
            elif isinstance(ins, StartGenerations):
                self._generation = max(self._generation, ins.after)
            elif isinstance(ins, BuildObjects):
                self.table.has_objects.update(ins.known)
                if ins.build:
                    self.nft(nftrules.slot_objects(
                        (self.pool.slot(i) for i in ins.build), table=self.config.table,
                        max_connections=self.config.max_connections,
                        ipv6=self.config.ipv6))
                    self.table.has_objects.update(ins.build)
            elif isinstance(ins, DeleteLink):
                self._del_link(self.pool.slot(ins.slot))
                self._forget_flows(self.pool.slot(ins.slot))
            elif isinstance(ins, FlushSlot):  # the v6 sets too, on a router with IPv6
                self.netlink.commit(nftrules.drain_batch(NftBatch(self.config.table),
                                                         self.pool.slot(ins.slot),
                                                         self.config.ipv6),
                                    f"flush leftover slot {ins.slot}")
                self._forget_flows(self.pool.slot(ins.slot))
            else:
                raise TypeError(f"not a router-wide instruction: {ins!r}")

    def adopt(self, index: int, fd: int, *, generation: int, conn_cap: int,
              rate_mbit: int | None) -> Slot:
        """Take back slot ``index`` of a live adopted sandbox (``fd``: its netns, now
        owned by the router). ``generation`` 0: unknown (the caller loads a policy);
        ``conn_cap`` -1 / ``rate_mbit`` 0: unknown, rewritten by the next load."""
        with self._lock:
            slot = Slot(addr=self.pool.slot(index), fd=fd, generation=generation,
                        conn_cap=conn_cap, rate_mbit=rate_mbit)
            self.table.handle(SlotEvent("adopted", index))
            self.slots[index] = slot
            return slot

    # ------------------------------------------------------------------ per sandbox

    def take(self) -> Slot:
        """A free slot for a new sandbox; builds one inline when the pool is empty."""
        with self._lock:
            if self._closing:
                raise BackendError("the router is closed: no slot can be taken")
            index = self.table.take()
            if index is None:
                b = self.table.reserve(1)
                if b is None:
                    raise ResourceExhausted(
                        f"network pool {self.pool.network} is full: all "
                        f"{self.pool.capacity} slots are in use; destroy sandboxes or give "
                        "the edge a larger --net-pool",
                        limit=self.pool.capacity,
                    )
                self.table.handle(*self._build(b))
                index = self.table.take()
                if index is None:
                    raise BackendError(f"net: building slot {b.slots[0]} failed (see the log)")
            return self.slots[index]

    def next_generation(self) -> int:
        with self._lock:
            self._generation += 1
            return self._generation

    def load(self, slot: Slot, policy: SlotPolicy, *, flush_pins: bool = False,
             max_connections: int | None = None, rate_mbit: int | None = None,
             digest: str | None = None) -> int:
        """Replace the slot's policy (one atomic batch); returns the new generation.
        Flows the new policy forbids are cut at their next packet. ``max_connections``:
        the slot's flow cap (None: the node's default); rewritten first, in a
        transaction of its own, only when it differs from what the slot holds.
        ``digest``: the loaded plan's fingerprint, kept with the generation in the kernel
        (reconcile compares it with the journal's after a restart)."""
        cap = max_connections or self.config.max_connections
        with self._lock:
            if slot.conn_cap != cap:
                self.nft(nftrules.conn_cap(slot.addr, cap, table=self.config.table))
                slot.conn_cap = cap
            if slot.rate_mbit != rate_mbit:
                self._shape(slot, rate_mbit)
            gen = self.next_generation()
            self.netlink.commit(
                nftrules.load_batch(NftBatch(self.config.table), slot.addr, policy, gen,
                                    flush_pins=flush_pins, digest=digest,
                                    empty=slot.empty, ipv6=self.config.ipv6),
                f"policy of slot {slot.index}",
            )
            slot.empty = False
            slot.generation = gen
            self.table.handle(SlotEvent("policy_loaded", slot.index))
            self.stats.policy_loads += 1
            return gen

    def _shape(self, slot: Slot, rate_mbit: int | None) -> None:
        """Shape both ends of the slot's veth to ``rate_mbit`` (tbf: the router's end
        ``dsvN`` for downloads, the sandbox's ``eth0`` for uploads; the sandbox has no
        CAP_NET_ADMIN over its slot netns, so it cannot remove it), or unshape them.
        Runs ``tc`` (~2-5 ms for both): only for a policy that names a rate, and at the
        recycle of a slot that was shaped, never on the default path."""
        for fd, dev in ((self.fd, slot.addr.ifname), (slot.fd, SANDBOX_IFNAME)):
            if rate_mbit is None:
                cmd = ["tc", "qdisc", "del", "dev", dev, "root"]
            else:
                # burst: 10 ms at the rate, at least 32 KiB (a tbf burst under one
                # timer tick's worth caps the rate below what was asked)
                burst = max(32 * 1024, rate_mbit * 1_000_000 // 8 // 100)
                cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                       f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms"]
            with netns.entered(fd):  # the child is forked from this thread: in the netns
                r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if r.returncode != 0 and rate_mbit is not None:
                raise BackendError(f"shaping slot {slot.index}'s {dev} to {rate_mbit} "
                                   f"Mbit/s failed: {r.stderr.strip()}")
        slot.rate_mbit = rate_mbit

    def pin(self, slot: Slot, pins: Iterable[Pin4], *, generation: int) -> None:
        """Add DNS pins to the slot's pin sets (before the answer is sent), only while the
        slot still holds the policy ``generation`` the answer was decided under: the
        check and the batch are one step under the router's lock, and every policy load
        and recycle moves the generation (under the same lock), so an answer decided
        for a policy an update replaced, or for a tenant that left, never pins.

        Raises Conflict for a stale generation and ResourceExhausted when the slot's
        pin set is full (the kernel's ENFILE: nothing of the batch was added)."""
        items = list(pins)
        with self._lock:
            if slot.generation != generation or self.slots.get(slot.index) is not slot:
                raise Conflict(
                    f"slot {slot.index} moved from policy generation {generation} to "
                    f"{slot.generation} while the answer was resolved: not pinned",
                    generation=slot.generation)
            try:
                self.netlink.commit(
                    nftrules.pins_batch(NftBatch(self.config.table), slot.addr, items,
                                       self.config.ipv6),
                    f"pins of slot {slot.index}",
                )
            except BackendError as exc:
                if exc.detail.get("errno") != errno.ENFILE:
                    raise
                raise ResourceExhausted(
                    f"slot {slot.index}'s DNS pin sets hold at most "
                    f"{nftrules.PIN_SET_SIZE} elements each; {len(items)} more do not fit "
                    "(live pins are never evicted)", limit=nftrules.PIN_SET_SIZE) from exc

    def release(self, slot: Slot, *, reusable: bool = True) -> None:
        """The slot's sandbox is gone. With ``reusable`` (its processes, hence its
        sockets, are known dead) and the netns still as built, drain and recycle it;
        otherwise drop it (a hostile tenant's leftovers never reach the next one)."""
        with self._lock:
            why = "" if reusable else "its sandbox's processes may still be alive"
            if not why:
                why = self.check(slot)
            if why:
                log.warning("net: slot %d is not reused: %s", slot.index, why)
                self._execute(self.table.handle(SlotEvent("lost", slot.index)))
                return
            self._execute(self.table.handle(SlotEvent("released", slot.index)))

    def check(self, slot: Slot) -> str:
        """"" if the slot's netns looks exactly as built (links, address, routes), else
        what differs. ~0.1 ms: ioctls and one /proc read inside the netns."""
        a = slot.addr
        with self._lock:  # slot.fd stays this slot's netns while it is entered
            if self.slots.get(slot.index) is not slot:
                return "the router no longer holds it (dropped, or the router closed)"
            return self._check(slot, a)

    def _check(self, slot: Slot, a: SlotAddr) -> str:
        try:
            with netns.entered(slot.fd):
                links = socket.if_nameindex()
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                      struct.pack("256s", SANDBOX_IFNAME.encode()))
                    raw_mask = fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK,
                                           struct.pack("256s", SANDBOX_IFNAME.encode()))
                with open("/proc/thread-self/net/route") as f:
                    routes = f.read().splitlines()[1:]
        except OSError as exc:
            return f"cannot inspect its netns: {exc}"
        if sorted(links) != [(1, "lo"), (SANDBOX_IFINDEX, SANDBOX_IFNAME)]:
            return f"its links changed: {sorted(links)}"
        addr = socket.inet_ntoa(raw[20:24])
        mask = socket.inet_ntoa(raw_mask[20:24])
        if addr != str(a.sandbox_ip) or mask != "255.255.255.254":
            return f"eth0 has {addr}/{mask}, not {a.sandbox_ip}/31"
        # default via the router's end, and the /31 itself (its network is that end)
        want = {("00000000", _hexle(a.router_ip)), (_hexle(a.router_ip), "00000000")}
        got = {(r.split()[1], r.split()[2]) for r in routes if r.split()}
        if got != want:
            return f"its routes changed: {sorted(got)}"
        return ""

    def lose(self, slot: Slot) -> None:
        """The slot can no longer be trusted or reused: drop it."""
        with self._lock:
            self._execute(self.table.handle(SlotEvent("lost", slot.index)))

    def counters(self) -> dict[int, int]:
        """Denied packets per slot index (one netlink dump)."""
        with self._lock:
            raw = self.netlink.counters(self.config.table)
        out: dict[int, int] = {}
        for name, (packets, _bytes) in raw.items():
            if name.startswith("s") and name.endswith("c") and name[1:-1].isdigit():
                out[int(name[1:-1])] = packets
        return out


_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B


def _hexle(ip: ipaddress.IPv4Address) -> str:
    """An address as /proc/net/route prints it (host-order hex of the network bytes)."""
    return f"{int.from_bytes(ip.packed, 'little'):08X}"


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
