"""The router against the journal at edge start (pure: two views in, instructions out).

The router netns outlives an edge process (bind-mounted under the node's state dir, see
net/router.py), and so do the slots of live sandboxes: their netns is held by the
sandbox's processes, the router end ``dsvN`` of its veth by the router netns, and the
slot's nft objects by the router's table. A restarted edge adopts its sandboxes from the
journal and then runs :func:`plan` over what it found (plan-14 §9.2):

=======================================  ===============================================
found                                    instruction
=======================================  ===============================================
no table ``inet dsec`` in the router     BuildBase (a fresh router: nothing to keep)
base table's digest differs from this    ReplaceBase (one transaction; slot objects and
code's (older dsec, other pool/uplink)   the ``out``/``in`` dispatch entries kept)
no uplink link ``dsu0``                  AttachUplink
the largest ``ct mark`` in any ``sN_l``  StartGenerations (above it and above ``hwm``, the
                                         last generation any load handed out: a
                                         generation is never reused on the router, so
                                         a stale conntrack mark of a dead flow can never
                                         become live again)
slot of an adopted sandbox, kernel's     Keep (generation kept: live flows survive the
policy digest == journal policy's        restart untouched)
slot of an adopted sandbox, otherwise    LoadPolicy (the journal's policy, new
(a crash between the journal put and     generation, pins flushed; idempotent)
the batch of ``network_update``)
slot of an adopted sandbox, no objects   BuildObjects + LoadPolicy
adopted sandbox without a usable slot    Lost (fail closed, said as a notice)
``dsvN`` with no adopted sandbox         DeleteLink + FlushSlot (the census has killed
                                         what held its netns; a hostile leftover never
                                         reaches the next tenant), unless this edge
                                         process holds the slot itself (``own``)
slot objects holding elements, no link   FlushSlot (objects kept for reuse)
=======================================  ===============================================

The kernel's policy digest is the comment of the generation's element in ``sN_l``,
written by the same nf_tables transaction as the elements it describes (all or nothing),
so reading it back needs no parse of interval sets. Unassigned slots never survive an
edge: their netns was held by the dead process's fds (the kernel removed them and their
veths with it).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from dsec.net.addressing import Pool
from dsec.net.nftrules import BASE_MARKER, HWM_SET

__all__ = [
    "Adopted",
    "AttachUplink",
    "BuildBase",
    "BuildObjects",
    "DeleteLink",
    "FlushSlot",
    "Instruction",
    "Keep",
    "KernelView",
    "Listing",
    "LoadPolicy",
    "Lost",
    "PinSeen",
    "ReplaceBase",
    "SlotSeen",
    "StartGenerations",
    "digest_of",
    "parse_listing",
    "plan",
]

#: A slot's nft objects: ``s17o`` (chain), ``s17a4`` (set)... and, on a router with IPv6,
#: the v6 twins ``a6 d6 q6 r6`` (their elements count, their pins are re-read)
_SLOT_OBJECT: Final = re.compile(r"^s(0|[1-9][0-9]*)(o|i|k|a4|d4|e4|f4|q4|r4|a6|d6|q6|r6|l|g|open|x|c)$")


def digest_of(obj: object) -> str:
    """A fingerprint of a compiled policy (frozen dataclasses of tuples, addresses and
    ints: their repr is deterministic). A code change that changes the repr only costs a
    reload at the next restart, never a wrong Keep."""
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:24]


# ---------------------------------------------------------------------------------------
# Views


@dataclass(frozen=True, slots=True)
class SlotSeen:
    """What the router holds for slot ``index``."""

    index: int
    link: bool = False       # dsvN is in the router netns
    objects: bool = False    # its chains and sets exist
    generation: int = 0      # the live mark in sN_l (0: none)
    digest: str | None = None  # the comment of that element
    elements: int = 0        # elements in all its sets (0: nothing to flush)


@dataclass(frozen=True, slots=True)
class PinSeen:
    """A DNS pin found in a slot's ``q4``/``q6`` (one port) or ``r4``/``r6`` (all ports)
    set."""

    slot: int
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    proto: str
    port: int | None
    expires_s: float


@dataclass(frozen=True, slots=True)
class KernelView:
    table: bool                      # table inet dsec exists
    base_digest: str | None          # its digest (None: an older dsec's, or no table)
    uplink: bool                     # dsu0 is in the router netns
    slots: Mapping[int, SlotSeen] = field(default_factory=dict)
    #: the largest mark in any slot's ``l`` set or the router's ``hwm`` (the last
    #: generation any load handed out): the next generation starts above it
    max_mark: int = 0
    #: True: the router netns was found pinned (a previous edge's); False: made now
    reopened: bool = True
    #: slots this edge process built or holds itself (its pool, its own sandboxes'):
    #: never leftovers, whatever the kernel shows for them. A reconcile that ran after the
    #: pool was filled (``dsec edge`` without a state dir refills before the node starts;
    #: ``dsec bench net`` starts a node on a used router) deleted the ``dsvN`` of every
    #: free slot, which left their netns without eth0: ~400 slots "not reused: cannot
    #: inspect its netns: ENODEV", and sandboxes handed such a slot had no network.
    own: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class Adopted:
    """A sandbox the journal holds that the backend adopted alive, with a network."""

    sid: str
    slot: int | None   # from its eth0 address (None: its netns holds no slot's veth end)
    digest: str        # digest_of(its journal policy, compiled)
    why: str = ""      # slot None: what was found instead


# ---------------------------------------------------------------------------------------
# Instructions


@dataclass(frozen=True, slots=True)
class BuildBase:
    pass


@dataclass(frozen=True, slots=True)
class ReplaceBase:
    pass


@dataclass(frozen=True, slots=True)
class AttachUplink:
    pass


@dataclass(frozen=True, slots=True)
class StartGenerations:
    after: int   # the next generation handed out is after + 1


@dataclass(frozen=True, slots=True)
class BuildObjects:
    """Objects exist for ``known`` (the pool reuses them); build them for ``build``."""

    known: tuple[int, ...]
    build: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Keep:
    sid: str
    slot: int
    generation: int


@dataclass(frozen=True, slots=True)
class LoadPolicy:
    sid: str
    slot: int


@dataclass(frozen=True, slots=True)
class Lost:
    sid: str
    why: str


@dataclass(frozen=True, slots=True)
class DeleteLink:
    slot: int


@dataclass(frozen=True, slots=True)
class FlushSlot:
    slot: int


Instruction = (BuildBase | ReplaceBase | AttachUplink | StartGenerations | BuildObjects
               | Keep | LoadPolicy | Lost | DeleteLink | FlushSlot)


def plan(adopted: Sequence[Adopted], kernel: KernelView, base_digest: str) -> list[Instruction]:
    """What brings the router in line with the journal (see the module's table).
    Router-wide instructions come first, then leftovers, then the adopted sandboxes."""
    out: list[Instruction] = []
    slots = dict(kernel.slots) if kernel.table else {
        i: SlotSeen(i, link=s.link) for i, s in kernel.slots.items()}
    if not kernel.table:
        out.append(BuildBase())
    elif kernel.base_digest != base_digest:
        out.append(ReplaceBase())
    if not kernel.uplink:
        out.append(AttachUplink())
    out.append(StartGenerations(max(kernel.max_mark,
                                    max((s.generation for s in slots.values()), default=0))))
    claimed: dict[int, str] = {}
    verdicts: list[Instruction] = []
    build: list[int] = []
    for a in sorted(adopted, key=lambda a: a.sid):
        seen = slots.get(a.slot) if a.slot is not None else None
        if a.slot is None:
            verdicts.append(Lost(a.sid, a.why or "its network namespace holds no slot"))
        elif a.slot in kernel.own:
            verdicts.append(Lost(a.sid, f"slot {a.slot} was built anew by this edge (its "
                                        f"dsv{a.slot} is not the sandbox's veth)"))
        elif a.slot in claimed:
            verdicts.append(Lost(a.sid, f"slot {a.slot} is claimed by sandbox "
                                        f"{claimed[a.slot]} too"))
        elif seen is None or not seen.link:
            why = ("the router was made anew (a host reboot, or its bind mount was removed)"
                   if not kernel.reopened else f"the router has no link dsv{a.slot}")
            verdicts.append(Lost(a.sid, why))
        else:
            claimed[a.slot] = a.sid
            if not seen.objects:
                build.append(a.slot)
                verdicts.append(LoadPolicy(a.sid, a.slot))
            elif seen.generation > 0 and seen.digest == a.digest:
                verdicts.append(Keep(a.sid, a.slot, seen.generation))
            else:
                verdicts.append(LoadPolicy(a.sid, a.slot))
    out.append(BuildObjects(tuple(sorted(i for i, s in slots.items() if s.objects)),
                            tuple(sorted(build))))
    for i in sorted(slots):
        s = slots[i]
        if i in claimed or i in kernel.own:
            continue
        if s.link:
            out.append(DeleteLink(i))
        if s.objects and (s.elements or s.link):
            out.append(FlushSlot(i))
    return out + verdicts


# ---------------------------------------------------------------------------------------
# The kernel's listing, parsed (libnftables JSON of ``list table inet dsec``)


@dataclass(frozen=True, slots=True)
class Listing:
    table: bool
    base_digest: str | None
    slots: dict[int, SlotSeen]
    pins: tuple[PinSeen, ...]
    max_mark: int


def parse_listing(text: str, links: Iterable[str], pool: Pool) -> Listing:
    """The router's table as libnftables prints it in JSON (``text``; "" when the table
    does not exist) and its link names: what :func:`plan` needs, and the DNS pins."""
    link_slots = {i for i in (Pool.slot_of_ifname(n) for n in links)
                  if i is not None and i < pool.capacity}
    items: list[dict[str, Any]] = json.loads(text)["nftables"] if text.strip() else []
    table = any("table" in x for x in items)
    base: str | None = None
    objects: set[int] = set()
    gens: dict[int, tuple[int, str | None]] = {}
    counts: dict[int, int] = {}
    pins: list[PinSeen] = []
    max_mark = 0
    for x in items:
        kind = "set" if "set" in x else "map" if "map" in x else "chain" if "chain" in x \
            else ""
        if not kind:
            continue
        obj = x[kind]
        name = str(obj.get("name", ""))
        elems = obj.get("elem", []) if kind != "chain" else []
        if name == HWM_SET:  # the last generation any load handed out
            for e in elems:
                max_mark = max(max_mark, _mark(e)[0])
            continue
        if name == BASE_MARKER:
            for e in elems:
                if isinstance(e, dict) and "elem" in e:
                    base = e["elem"].get("comment")
            continue
        m = _SLOT_OBJECT.match(name)
        if m is None:
            continue
        index, key = int(m.group(1)), m.group(2)
        if index >= pool.capacity:
            continue
        if key == "o":
            objects.add(index)
        if kind == "chain":
            continue
        if key != "x":  # recently-denied examples time out by themselves
            counts[index] = counts.get(index, 0) + len(elems)
        if key == "l":
            for e in elems:
                mark, comment = _mark(e)
                max_mark = max(max_mark, mark)
                if mark >= gens.get(index, (0, None))[0]:
                    gens[index] = (mark, comment)
        elif key in ("q4", "r4", "q6", "r6"):
            pins += _pins(index, key, elems)
    slots: dict[int, SlotSeen] = {}
    for i in sorted(link_slots | objects):
        gen, digest = gens.get(i, (0, None))
        slots[i] = SlotSeen(i, link=i in link_slots, objects=i in objects, generation=gen,
                            digest=digest, elements=counts.get(i, 0))
    return Listing(table, base, slots, tuple(pins), max_mark)


def _mark(e: Any) -> tuple[int, str | None]:
    if isinstance(e, dict) and "elem" in e:
        v = e["elem"].get("val", 0)
        c = e["elem"].get("comment")
        return _int(v), c if isinstance(c, str) else None
    return _int(e), None


def _int(v: Any) -> int:
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v, 0)
        except ValueError:
            return 0
    return 0


def _pins(index: int, key: str, elems: Sequence[Any]) -> list[PinSeen]:
    out: list[PinSeen] = []
    for e in elems:
        if not isinstance(e, dict) or "elem" not in e:
            continue
        val = e["elem"].get("val", {})
        parts = val.get("concat") if isinstance(val, dict) else None
        if not isinstance(parts, list) or len(parts) < 2:
            continue
        try:
            address = ipaddress.ip_address(parts[0])
        except ValueError:
            continue
        port = _int(parts[2]) if key[0] == "q" and len(parts) > 2 else None
        expires = e["elem"].get("expires", e["elem"].get("timeout", 0))
        out.append(PinSeen(index, address, str(parts[1]), port,
                           float(expires) if isinstance(expires, int | float) else 0.0))
    return out
