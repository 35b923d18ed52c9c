"""Sandboxes on router slots: what a backend calls at create, update and destroy (shell).

A backend holds one :class:`SandboxNetwork` (or none: every sandbox then gets today's
private loopback-only netns). At create it asks :meth:`attach`: the spec's policy is
compiled to set elements (``compile``, injected: the policy language is the wire's,
this layer only sees addresses and ports), a free slot is taken and loaded in one batch,
and the slot's netns fd goes to the zygote, whose child joins it instead of making one.
A spec that compiles to None (mode ``none``) gets no slot: no veth, no cost.
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from dsec.errors import Conflict, DsecError, InvalidArgument
from dsec.net import netns
from dsec.net.compile import Compiled, DomainRule, Elem
from dsec.net.compile import compile as compile_policy
from dsec.net.denied import Denial, DenyReporter
from dsec.net.dnspolicy import DnsPolicy, NameRule, PinBook
from dsec.net.nftrules import PRIVATE4, PRIVATE6
from dsec.net.nftwire import Dest, SlotPolicy, TooManyElements, disjoint
from dsec.net.reconcile import (
    Adopted,
    Instruction,
    Keep,
    KernelView,
    LoadPolicy,
    Lost,
    digest_of,
    plan,
)
from dsec.net.router import Router, Slot
from dsec.wire.netpolicy import NetworkPolicy, Proto
from dsec.wire.spec import SandboxSpec

__all__ = ["NetPlan", "PolicyCompiler", "SandboxNetwork", "compile_spec", "crash_point",
           "plan_of"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NetPlan:
    """A sandbox's compiled policy: the slot's set elements and the resolver's rules."""

    slot: SlotPolicy
    dns: DnsPolicy = field(default_factory=DnsPolicy)
    #: the slot's flow cap (None: the node's default, RouterConfig.max_connections)
    max_connections: int | None = None
    #: both directions shaped to this (None: not shaped)
    rate_mbit: int | None = None


#: (spec, the project ceilings' deny entries) -> its plan, or None for "no network
#: beyond loopback". Raises InvalidArgument for a policy this node cannot enforce.
PolicyCompiler = Callable[[SandboxSpec, tuple[str, ...]], NetPlan | None]

#: The most elements one slot set may get after overlaps are split (disjoint()): a
#: pipapo set's commit grows with its size (E12: 1.2 ms at 256 entries).
MAX_SLOT_ELEMENTS = 4096
#: Compiled plans kept by SandboxNetwork.prepare (most sandboxes of a run share a few).
_COMPILED_KEPT = 256
_MISSING: object = object()


def _dests(elems: Iterable[Elem], name: str) -> tuple[Dest, ...]:
    out = [Dest(e.net.network_address, e.net.broadcast_address, e.proto, *e.ports)
           for e in elems]
    try:
        # bounded: a policy that will be refused costs the split up to the limit only
        return disjoint(out, limit=MAX_SLOT_ELEMENTS)
    except TooManyElements as exc:
        raise InvalidArgument(
            f"network.{name} becomes more than {MAX_SLOT_ELEMENTS} kernel set elements "
            f"once its overlapping entries are split (counting stopped at {exc.count}), "
            f"over this node's limit of {MAX_SLOT_ELEMENTS}; merge overlapping CIDR/port "
            "entries", field=f"network.{name}", limit=MAX_SLOT_ELEMENTS) from None


def plan_of(compiled: Compiled) -> NetPlan | None:
    """The kernel's and the resolver's share of a compiled policy (None: mode none).
    IPv6 elements are part of the plan on every node; the router loads them only where
    it has IPv6 (elsewhere its slots have no v6 sets and drop every v6 packet, and
    ``network_get`` says ``ipv6: false``)."""
    if compiled.mode == "none":
        return None
    slot = SlotPolicy(
        allow4=_dests(compiled.sets.get("a4", ()), "allow"),
        deny4=_dests(compiled.sets.get("d4", ()), "deny"),
        east4=_dests(compiled.sets.get("e4", ()), "allow"),
        from4=tuple(sorted(compiled.inbound)), open=compiled.open,
        allow6=_dests(compiled.sets.get("a6", ()), "allow"),
        deny6=_dests(compiled.sets.get("d6", ()), "deny"))
    private = [ipaddress.ip_network(p) for p in (*PRIVATE4, *PRIVATE6)]
    private_ok = tuple(e.net for n in ("a4", "a6") for e in compiled.sets.get(n, ())
                       if any(e.net.version == p.version and e.net.overlaps(p)
                              for p in private))

    def rule(d: DomainRule) -> NameRule:
        return NameRule(d.name, d.wildcard, tuple(d.protos), d.ports)

    dns = DnsPolicy(allow=tuple(rule(d) for d in compiled.domains),
                    deny=tuple(rule(d) for d in compiled.deny_domains),
                    open=compiled.open, private_ok=private_ok)
    return NetPlan(slot, dns, compiled.max_connections, compiled.rate_mbit)


def compile_spec(spec: SandboxSpec, ceiling_deny: tuple[str, ...] = ()) -> NetPlan | None:
    """The default compiler: the wire's policy through net/compile.py."""
    policy = spec.net
    if policy.net_mode == "none":
        return None
    return plan_of(compile_policy(policy, ceiling_deny=ceiling_deny))


@dataclass
class SandboxNetwork:
    router: Router
    compile: PolicyCompiler = compile_spec
    by_sandbox: dict[str, Slot] = field(default_factory=dict)
    by_slot: dict[int, str] = field(default_factory=dict)
    policies: dict[str, NetPlan] = field(default_factory=dict)
    pins: PinBook = field(default_factory=PinBook)
    denied: DenyReporter = field(default_factory=DenyReporter)
    _baseline: dict[int, int] = field(default_factory=dict)
    #: sandboxes adopted after an edge restart whose slot did not survive (fail closed)
    lost: set[str] = field(default_factory=set)
    #: sandboxes adopted at edge start, waiting for :meth:`reconcile`: (netns fd, spec,
    #: ceiling denies, what reconcile's plan is told)
    _adopting: dict[str, tuple[int, SandboxSpec, tuple[str, ...], Adopted]] = field(
        default_factory=dict)
    _refilling: bool = False
    #: the background refill in flight (None: none yet); :meth:`close` awaits it
    _refill_future: asyncio.Future[None] | None = None
    #: set while no background refill runs (a close on another loop waits on it)
    _refill_idle: threading.Event = field(default_factory=threading.Event)
    _closed: bool = False
    #: compiled plans (or the refusal) by (policy, ceiling denies): ``prepare`` fills it
    #: on a worker thread, so attach/update on the loop only look it up
    _compiled: dict[tuple[NetworkPolicy, tuple[str, ...]], NetPlan | InvalidArgument | None] \
        = field(default_factory=dict)
    _compiled_lock: threading.Lock = field(default_factory=threading.Lock)
    _resolv_conf: bytes | None = None

    def prepared(self, spec: SandboxSpec, ceiling_deny: tuple[str, ...] = ()) -> bool:
        """Whether ``prepare`` has the plan already (then it costs a dict lookup)."""
        with self._compiled_lock:
            return (spec.net, ceiling_deny) in self._compiled

    async def prepare_off_loop(self, spec: SandboxSpec,
                               ceiling_deny: tuple[str, ...] = ()) -> None:
        """``prepare`` on a worker thread unless its plan is cached (a big policy's split
        costs milliseconds; a cached one is a lookup, not worth a thread hop)."""
        if self.prepared(spec, ceiling_deny):
            self.prepare(spec, ceiling_deny)  # re-raises a cached refusal
        else:
            await asyncio.to_thread(self.prepare, spec, ceiling_deny)

    def prepare(self, spec: SandboxSpec, ceiling_deny: tuple[str, ...] = ()) -> NetPlan | None:
        """The spec's compiled plan (None: mode none), or InvalidArgument for a policy
        this node refuses. Pure CPU (a few ms for a big policy, bounded by
        MAX_SLOT_ELEMENTS): a backend calls it on a worker thread before anything is
        journaled or built, and attach/update then find it here. The plan depends on
        the policy and the ceiling denies only (``spec.net``), the cache key."""
        key = (spec.net, ceiling_deny)
        with self._compiled_lock:
            got = self._compiled.get(key, _MISSING)
        if got is _MISSING:
            try:
                got = self.compile(spec, ceiling_deny)
            except InvalidArgument as exc:
                got = exc
            with self._compiled_lock:
                if len(self._compiled) >= _COMPILED_KEPT:
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[key] = got
        if isinstance(got, InvalidArgument):
            raise InvalidArgument(got.message, **got.detail)
        assert got is None or isinstance(got, NetPlan)
        return got

    def resolv_conf(self) -> bytes:
        """/etc/resolv.conf of a sandbox on a slot: the router's resolver (every DNS
        packet is redirected there anyway; this only spares clients a timeout)."""
        if self._resolv_conf is None:
            self._resolv_conf = (f"nameserver {self.router.pool.resolver}\n"
                                 "options timeout:2 attempts:2\n").encode()
        return self._resolv_conf

    def attach(self, sid: str, spec: SandboxSpec,
               ceiling_deny: tuple[str, ...] = ()) -> Slot | None:
        """Compile, take a slot, load it; None when the spec needs no slot.

        On the create path, synchronous on the edge's loop: 17-20% of the loop's time in
        a burst of creates at concurrency 16 (pyinstrument, 150 creates, loaded 2-core
        VM), nearly all of it the one nf_tables commit (p50 0.31 ms on a fresh slot: no
        flushes; the plan and its encoded elements are cached per policy). Creates/s is
        bound by the whole create's CPU (~4.5-5.5 ms: edge, zygote, the sandbox's own
        setup), not by this; see docs/networking.md "What bounds creates/s"."""
        if sid in self.by_sandbox:
            raise Conflict(f"sandbox {sid} already holds network slot "
                           f"{self.by_sandbox[sid].index}", sandbox_id=sid)
        plan = self.prepare(spec, ceiling_deny)
        if plan is None:
            return None
        slot = self.router.take()
        try:
            self.router.load(slot, plan.slot, flush_pins=True,
                             max_connections=plan.max_connections, rate_mbit=plan.rate_mbit,
                             digest=digest_of(plan))
        except BaseException:
            self.router.release(slot)  # nothing ran in it: safe to reuse
            raise
        self.pins.forget(slot.index)
        self._refill_soon()
        self.by_sandbox[sid] = slot
        self.by_slot[slot.index] = sid
        self.policies[sid] = plan
        # the slot's drop counter as the previous tenant left it: this one's baseline
        self.denied.assign(slot.index, sid, self._baseline.pop(slot.index, 0))
        return slot

    def poll_denied(self) -> list[Denial]:
        """Packets each sandbox had dropped since the last poll (one counter dump). Also
        the uplink's watch (:meth:`Router.watch_uplink`: the host's addresses and the
        host-side guard another program may have flushed), on the same beat."""
        try:
            fixed = self.router.watch_uplink()
        except (DsecError, OSError) as exc:
            log.error("checking the host uplink's guard failed: %s", exc)
        else:
            if fixed:
                log.warning("network: %s", fixed)
        if not self.denied.owners:
            return []
        return self.denied.feed(self.router.counters())

    def recent_denied(self, sid: str) -> list[str]:
        """Destinations the sandbox was recently refused (at most 16, the last 60 s):
        "203.0.113.2:443/tcp". A libnftables listing: called only for a notice."""
        slot = self.by_sandbox.get(sid)
        if slot is None:
            return []
        text = self.router.nft(f"list set inet {self.router.config.table} s{slot.index}x")
        if "elements = {" not in text:
            return []
        body = text.split("elements = {", 1)[1].split("}", 1)[0]
        out = []
        for item in body.split(","):
            # nft prints "203.0.113.2 . tcp . 443 expires 58s"
            fields = [f.strip() for f in item.split(" expires")[0].split(" . ")]
            if len(fields) == 3:
                out.append(f"{fields[0]}:{fields[2]}/{fields[1]}")
        return out

    def _refill_soon(self) -> None:
        """Top the pool up on a worker thread (slot builds cost ~1-5 ms each: never on
        the create path unless the pool ran dry)."""
        if self._closed or self._refilling or not self.router.needs_refill():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._refilling = True
        self._refill_idle.clear()

        def run() -> None:
            try:
                self.router.refill()
            except (DsecError, OSError) as exc:
                log.warning("net: refilling the slot pool failed: %s", exc)
            finally:
                self._refilling = False
                self._refill_idle.set()
        self._refill_future = loop.run_in_executor(None, run)

    async def close(self) -> None:
        """Start no more background refills and wait for the one in flight, so the
        router can be closed next without a builder still using its fds (the router's
        own close waits for it too, blocking its caller; this waits without blocking the
        loop). The router is not closed here: its owner closes it."""
        self._closed = True
        fut = self._refill_future
        if fut is not None and not fut.done() and fut.get_loop() is asyncio.get_running_loop():
            await asyncio.gather(fut, return_exceptions=True)
        elif self._refilling:  # started on another loop (an edge's earlier one)
            await asyncio.to_thread(self._refill_idle.wait)

    def plan_of_slot(self, index: int) -> tuple[str, Slot, NetPlan] | None:
        """The sandbox on slot ``index`` (the resolver names askers this way)."""
        sid = self.by_slot.get(index)
        if sid is None:
            return None
        return sid, self.by_sandbox[sid], self.policies[sid]

    def slot(self, sid: str) -> Slot | None:
        return self.by_sandbox.get(sid)

    def status(self, sid: str, now: float) -> tuple[str | None, int, int]:
        """(its address, packets denied since it got the slot as of the last counter
        poll, live DNS pins) of a sandbox; cheap (no kernel call): ``network_get``."""
        slot = self.by_sandbox.get(sid)
        if slot is None or sid in self.lost:
            return None, 0, 0
        owner = self.denied.owners.get(slot.index)
        denied = max(0, owner[2] - owner[1]) if owner is not None and owner[0] == sid else 0
        return str(slot.addr.sandbox_ip), denied, self.pins.count(slot.index, now)

    def update(self, sid: str, spec: SandboxSpec,
               ceiling_deny: tuple[str, ...] = ()) -> int | None:
        """Load the spec's policy on the sandbox's slot (one atomic batch; flows the new
        policy forbids are cut). Returns the new generation, the current one when the
        compiled policy did not change (an idempotent retry cuts nothing), or None for
        a sandbox without a slot. A change between "no slot" and "a slot" needs a new
        sandbox: the netns of a running sandbox cannot be swapped."""
        slot = self.by_sandbox.get(sid)
        plan = self.prepare(spec, ceiling_deny)
        if sid in self.lost:
            raise Conflict(
                f"sandbox {sid} lost its network when the edge restarted (its router slot "
                "went with the previous edge process); re-create it to get a network "
                "policy", sandbox_id=sid)
        if slot is None:
            if plan is None:
                return None
            raise Conflict(
                f"sandbox {sid} was created without a network slot (policy 'none'); a "
                "running sandbox cannot gain one - create a new sandbox with the policy",
                sandbox_id=sid)
        if plan is None:
            plan = NetPlan(SlotPolicy())  # everything closed, the slot kept
        old = self.policies.get(sid)
        if old == plan:
            return slot.generation
        # Names changed: their pins go too (re-resolving pins again what is still allowed)
        names_changed = old is None or old.dns != plan.dns
        crash_point("network_update:batch")  # the node journaled it; the kernel not yet
        gen = self.router.load(slot, plan.slot, flush_pins=names_changed,
                               max_connections=plan.max_connections, rate_mbit=plan.rate_mbit,
                               digest=digest_of(plan))
        if names_changed:
            self.pins.forget(slot.index)
        self.policies[sid] = plan
        return gen

    def detach(self, sid: str, *, reusable: bool) -> None:
        """The sandbox is gone: recycle its slot (``reusable``: every process of it is
        known dead) or drop it. Never raises: a failure only costs the slot."""
        slot = self.by_sandbox.pop(sid, None)
        self.policies.pop(sid, None)
        self.lost.discard(sid)
        pending = self._adopting.pop(sid, None)  # destroyed before reconcile ran
        if pending is not None:
            _close(pending[0])
        if slot is None:
            return
        self.by_slot.pop(slot.index, None)
        self.pins.forget(slot.index)
        self.denied.retire(slot.index)
        try:  # what the counter says now is the next tenant's starting point
            self._baseline[slot.index] = self.router.counters().get(slot.index, 0)
        except DsecError as exc:
            log.warning("net: reading slot %d's counter failed: %s", slot.index, exc.message)
        try:
            self.router.release(slot, reusable=reusable)
        except DsecError as exc:
            log.warning("net: releasing slot %d of %s failed: %s", slot.index, sid, exc.message)
        except OSError as exc:
            log.warning("net: releasing slot %d of %s failed: %s", slot.index, sid, exc)

    # ------------------------------------------------------------------ edge start

    def adopt(self, sid: str, spec: SandboxSpec, netns_fd: int,
              ceiling_deny: tuple[str, ...] = ()) -> None:
        """A sandbox of the journal found alive at edge start, in the netns held by
        ``netns_fd`` (owned from now on): its slot is found from its ``eth0`` address
        and checked against the router by :meth:`reconcile`, which runs once every
        sandbox is adopted and before the edge serves."""
        plan_ = self.prepare(spec, ceiling_deny)
        index: int | None = None
        why = ""
        try:
            with netns.entered(netns_fd):
                addr = _eth0_address()
        except OSError as exc:
            addr, why = None, f"its netns cannot be read: {exc}"
        if addr is not None:
            index = self.router.pool.slot_of(addr)
            if index is None:
                why = f"its eth0 address {addr} is no slot of pool {self.router.pool.network}"
        elif not why:
            why = "its netns has no eth0 address"
        old = self._adopting.pop(sid, None)
        if old is not None:
            _close(old[0])
        self._adopting[sid] = (netns_fd, spec, ceiling_deny, Adopted(
            sid, index, digest_of(plan_ or NetPlan(SlotPolicy())), why))

    def reconcile(self) -> dict[str, str]:
        """Bring the router in line with the adopted sandboxes (net/reconcile.py's plan;
        plan-14 §9.2), then refill the pool. Returns the sandboxes that could not keep
        their network, with why (they stay cut off: fail closed)."""
        t0 = time.monotonic()
        # The router is held from the view to the plan's last step: no builder reserves
        # an index between the listing and a DeleteLink/FlushSlot of it; slots the
        # router holds itself (its pool, built before the node started) are not leftovers.
        with self.router.held():
            lost, steps, t_view = self._reconcile_held()
        t_plan = time.monotonic()
        built = self.router.refill()
        log.info("net: reconcile: kernel view %.1f ms, %d instruction(s) %.1f ms, pool refill "
                 "(%d slots) %.1f ms", (t_view - t0) * 1000, len(steps),
                 (t_plan - t_view) * 1000, built, (time.monotonic() - t_plan) * 1000)
        return lost

    def _reconcile_held(self) -> tuple[dict[str, str], list[Instruction], float]:
        """The body of :meth:`reconcile`, run with the router held: (lost, the plan,
        when the view was read)."""
        view = self.router.reconcile_view()
        t_view = time.monotonic()
        kernel = KernelView(table=view.table, base_digest=view.base_digest,
                            uplink=self.router.has_uplink(), slots=view.slots,
                            max_mark=view.max_mark, reopened=self.router.reopened,
                            own=self.router.owned_slots())
        adopting, self._adopting = self._adopting, {}
        steps = plan([a for _, _, _, a in adopting.values()], kernel,
                     self.router.base_digest())
        lost: dict[str, str] = {}
        now = time.monotonic()
        try:
            counters = self.router.counters()
        except DsecError:
            counters = {}
        for step, ins in enumerate(steps):
            crash_point(f"reconcile:{step}")
            if isinstance(ins, Keep | LoadPolicy):
                fd, spec, deny, _ = adopting.pop(ins.sid)
                p = self.prepare(spec, deny) or NetPlan(SlotPolicy())
                if isinstance(ins, Keep):  # the kernel holds exactly p (its digest)
                    slot = self.router.adopt(
                        ins.slot, fd, generation=ins.generation, rate_mbit=p.rate_mbit,
                        conn_cap=p.max_connections or self.router.config.max_connections)
                else:  # cap and shaping unknown: the load below rewrites both
                    slot = self.router.adopt(ins.slot, fd, generation=0, conn_cap=-1,
                                             rate_mbit=0)
                    try:
                        self.router.load(slot, p.slot, flush_pins=True,
                                         max_connections=p.max_connections,
                                         rate_mbit=p.rate_mbit, digest=digest_of(p))
                    except DsecError as exc:
                        lost[ins.sid] = f"loading its policy failed: {exc.message}"
                        self.router.lose(slot)
                        continue
                self.by_sandbox[ins.sid] = slot
                self.by_slot[slot.index] = ins.sid
                self.policies[ins.sid] = p
                self.denied.assign(slot.index, ins.sid, counters.get(slot.index, 0))
            elif isinstance(ins, Lost):
                fd, _, _, _ = adopting.pop(ins.sid)
                _close(fd)
                lost[ins.sid] = ins.why
            else:
                self.router.apply(ins)
        if kernel.uplink:  # kept with the router: a host uplink's table and sysctls too
            self.router.adopt_uplink()
        for fd, _, _, _ in adopting.values():  # not in the plan: cannot happen
            _close(fd)
        for pin in view.pins:  # DNS pins live on in the kernel: the book re-reads them
            if pin.slot in self.by_slot and pin.proto in ("tcp", "udp"):
                proto: Proto = "tcp" if pin.proto == "tcp" else "udp"
                self.pins.expiry[(pin.slot, pin.address, proto, pin.port)] = \
                    now + pin.expires_s
        self.lost.update(lost)
        return lost, steps, t_view


def crash_point(name: str) -> None:
    """Fault tests (tests/net/test_net_faults.py) kill the edge here: with
    ``DSEC_TEST_CRASH_AT=name`` in its environment the process dies as by kill -9."""
    if os.environ.get("DSEC_TEST_CRASH_AT") == name:
        log.warning("DSEC_TEST_CRASH_AT=%s: dying here", name)
        os._exit(137)


def _eth0_address() -> str | None:
    """The IPv4 address of the calling thread's netns's ``eth0`` (None: it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", b"eth0"))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
