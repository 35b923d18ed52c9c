"""net/reconcile.py: the plan a restarted edge runs over its router (pure), the listing
parser, and the pinned router re-opened in the kernel.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.net import netns
from dsec.net.addressing import Pool
from dsec.net.nftwire import Dest4, SlotPolicy
from dsec.net.reconcile import (
    Adopted,
    AttachUplink,
    BuildBase,
    BuildObjects,
    DeleteLink,
    FlushSlot,
    Keep,
    KernelView,
    LoadPolicy,
    Lost,
    ReplaceBase,
    SlotSeen,
    StartGenerations,
    digest_of,
    parse_listing,
    plan,
)
from dsec.net.router import Router, RouterConfig
from dsec.net.testinternet import Internet, links_in
from dsec.net.uplink import NetnsUplink

BASE = "b" * 16


def kv(*slots: SlotSeen, table: bool = True, base: str | None = BASE, uplink: bool = True,
       reopened: bool = True, max_mark: int = 0) -> KernelView:
    return KernelView(table=table, base_digest=base, uplink=uplink,
                      slots={s.index: s for s in slots}, max_mark=max_mark, reopened=reopened)


def live(i: int, gen: int = 5, digest: str | None = "d1", elements: int = 3) -> SlotSeen:
    return SlotSeen(i, link=True, objects=True, generation=gen, digest=digest,
                    elements=elements)


# ---------------------------------------------------------------------------- the table

CASES: list[tuple[str, list[Adopted], KernelView, list[object]]] = [
    ("fresh router, nothing adopted", [], kv(table=False, base=None, uplink=False,
                                             reopened=False),
     [BuildBase(), AttachUplink(), StartGenerations(0), BuildObjects(())]),
    ("router as left, policy unchanged: keep (live flows survive)",
     [Adopted("a", 3, "d1")], kv(live(3, gen=7)),
     [StartGenerations(7), BuildObjects((3,)), Keep("a", 3, 7)]),
    ("journal newer than the kernel (crash between put and batch): load",
     [Adopted("a", 3, "d2")], kv(live(3, gen=7, digest="d1")),
     [StartGenerations(7), BuildObjects((3,)), LoadPolicy("a", 3)]),
    ("a slot with no generation (crash between take and load): load",
     [Adopted("a", 3, "d1")], kv(live(3, gen=0, digest=None, elements=0)),
     [StartGenerations(0), BuildObjects((3,)), LoadPolicy("a", 3)]),
    ("older dsec's base table: replaced, slots kept",
     [Adopted("a", 3, "d1")], kv(live(3, gen=2), base=None),
     [ReplaceBase(), StartGenerations(2), BuildObjects((3,)), Keep("a", 3, 2)]),
    ("uplink gone (its namespace was re-made): attached again",
     [], kv(uplink=False), [AttachUplink(), StartGenerations(0), BuildObjects(())]),
    ("a link whose sandbox the journal does not hold: deleted and flushed",
     [], kv(live(4, gen=9)),
     [StartGenerations(9), BuildObjects((4,)), DeleteLink(4), FlushSlot(4)]),
    ("objects of a dead slot still holding elements: flushed; empty ones left",
     [], kv(SlotSeen(5, objects=True, generation=3, elements=4), SlotSeen(6, objects=True)),
     [StartGenerations(3), BuildObjects((5, 6)), FlushSlot(5)]),
    ("generation restarts above the largest mark anywhere",
     [], kv(SlotSeen(5, objects=True, generation=3, elements=1), max_mark=40),
     [StartGenerations(40), BuildObjects((5,)), FlushSlot(5)]),
    ("a sandbox whose slot link is gone: lost (fail closed)",
     [Adopted("a", 3, "d1")], kv(SlotSeen(3, objects=True, generation=2, elements=2)),
     [StartGenerations(2), BuildObjects((3,)), FlushSlot(3),
      Lost("a", "the router has no link dsv3")]),
    ("a router made anew: every adopted sandbox is lost",
     [Adopted("a", 3, "d1")], kv(table=False, base=None, uplink=False, reopened=False),
     [BuildBase(), AttachUplink(), StartGenerations(0), BuildObjects(()),
      Lost("a", "the router was made anew (a host reboot, or its bind mount was removed)")]),
    ("a netns without a slot's address: lost, with what was found",
     [Adopted("a", None, "d1", "its netns has no eth0 address")], kv(),
     [StartGenerations(0), BuildObjects(()), Lost("a", "its netns has no eth0 address")]),
    ("two sandboxes naming one slot: the second is lost",
     [Adopted("a", 3, "d1"), Adopted("b", 3, "d1")], kv(live(3)),
     [StartGenerations(5), BuildObjects((3,)), Keep("a", 3, 5),
      Lost("b", "slot 3 is claimed by sandbox a too")]),
    ("a link without objects (table re-made): objects built, policy loaded",
     [Adopted("a", 3, "d1")], kv(SlotSeen(3, link=True), table=False, base=None),
     [BuildBase(), StartGenerations(0), BuildObjects((), (3,)), LoadPolicy("a", 3)]),
]


@pytest.mark.parametrize(("adopted", "kernel", "want"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_plan_table(adopted: list[Adopted], kernel: KernelView, want: list[object]) -> None:
    assert plan(adopted, kernel, BASE) == want


# ---------------------------------------------------------------------------- properties

slot_seen = st.builds(
    SlotSeen, index=st.integers(0, 20), link=st.booleans(), objects=st.booleans(),
    generation=st.integers(0, 50), digest=st.sampled_from([None, "d1", "d2"]),
    elements=st.integers(0, 5))
adopted_st = st.builds(Adopted, sid=st.sampled_from("abcdefgh"),
                       slot=st.one_of(st.none(), st.integers(0, 20)),
                       digest=st.sampled_from(["d1", "d2"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(slot_seen, max_size=8), st.lists(adopted_st, max_size=6, unique_by=lambda a: a.sid),
       st.booleans(), st.integers(0, 60))
def test_plan_properties(seen: list[SlotSeen], adopted: list[Adopted], table: bool,
                         max_mark: int) -> None:
    kernel = kv(*seen, table=table, max_mark=max_mark)
    out = plan(adopted, kernel, BASE)
    slots = kernel.slots
    verdicts = {i.sid: i for i in out if isinstance(i, Keep | LoadPolicy | Lost)}
    # every adopted sandbox gets exactly one verdict
    assert sorted(verdicts) == sorted(a.sid for a in adopted)
    assert len([i for i in out if isinstance(i, Keep | LoadPolicy | Lost)]) == len(adopted)
    claimed = [i.slot for i in verdicts.values() if isinstance(i, Keep | LoadPolicy)]
    assert len(claimed) == len(set(claimed))  # no slot serves two sandboxes
    for a in adopted:
        v = verdicts[a.sid]
        if isinstance(v, Keep | LoadPolicy):
            assert a.slot is not None and slots[a.slot].link  # only a live link
        if isinstance(v, Keep):
            s = slots[v.slot]
            assert table and s.objects and s.digest == a.digest and s.generation > 0
            assert v.generation == s.generation
    # no link is left without a sandbox; a claimed slot is never flushed or deleted
    for i, s in slots.items():
        deleted = DeleteLink(i) in out
        assert deleted == (s.link and i not in claimed)
        if i in claimed:
            assert FlushSlot(i) not in out
    # generations move on from the largest mark: never reused
    start = next(i for i in out if isinstance(i, StartGenerations))
    assert start.after >= max([max_mark, *(s.generation for s in slots.values()
                                          if table)], default=0)
    # router-wide first, per-sandbox verdicts last
    kinds = [type(i) for i in out]
    first_verdict = min((k for k, t in enumerate(kinds) if t in (Keep, LoadPolicy, Lost)),
                        default=len(kinds))
    assert all(t in (Keep, LoadPolicy, Lost) for t in kinds[first_verdict:])


def test_digest_tells_policies_apart() -> None:
    a = SlotPolicy(allow4=(Dest4.of("203.0.113.1/32", "tcp", (80, 80)),))
    b = SlotPolicy(allow4=(Dest4.of("203.0.113.1/32", "tcp", (80, 81)),))
    assert digest_of(a) == digest_of(SlotPolicy(allow4=a.allow4))
    assert digest_of(a) != digest_of(b) and len(digest_of(a)) == 24


# ---------------------------------------------------------------------------- the listing

def test_parse_listing() -> None:
    listing = {"nftables": [
        {"metainfo": {}},
        {"table": {"family": "inet", "name": "dsec"}},
        {"set": {"name": "basev", "type": "mark", "elem": [{"elem": {"val": 1,
                                                                      "comment": "abc"}}]}},
        {"chain": {"name": "s3o"}}, {"chain": {"name": "s4o"}}, {"chain": {"name": "forward"}},
        {"set": {"name": "s3l", "elem": [{"elem": {"val": 7, "comment": "d1"}}]}},
        {"set": {"name": "s3a4", "elem": [{"concat": ["1.2.3.4", "tcp", 80]}]}},
        {"set": {"name": "s3x", "elem": [{"elem": {"val": {"concat": ["1.1.1.1", "tcp", 1]}}}]}},
        {"set": {"name": "s4l", "elem": [12]}},
        {"set": {"name": "s3q4", "elem": [{"elem": {"val": {"concat": ["9.9.9.9", "tcp", 443]},
                                                    "timeout": 120, "expires": 90}}]}},
        {"set": {"name": "s3r4", "elem": [{"elem": {"val": {"concat": ["8.8.8.8", "udp"]},
                                                    "expires": 30}}]}},
        {"set": {"name": "s99999o"}},  # outside the pool: ignored
    ]}
    got = parse_listing(json.dumps(listing), ["lo", "dsu0", "dsv3", "dsv7", "dsv07"], Pool())
    assert got.table and got.base_digest == "abc" and got.max_mark == 12
    assert got.slots[3] == SlotSeen(3, link=True, objects=True, generation=7, digest="d1",
                                    elements=4)
    assert got.slots[4] == SlotSeen(4, objects=True, generation=12, elements=1)
    assert got.slots[7] == SlotSeen(7, link=True)
    assert sorted(got.slots) == [3, 4, 7]
    pins = {(p.slot, str(p.address), p.proto, p.port, p.expires_s) for p in got.pins}
    assert pins == {(3, "9.9.9.9", "tcp", 443, 90.0), (3, "8.8.8.8", "udp", None, 30.0)}
    empty = parse_listing("", [], Pool())
    assert not empty.table and empty.slots == {} and empty.base_digest is None
    # the router-wide high-water mark (a released slot's l is drained, its flows' marks
    # live on in conntrack): generations restart above it too (REDTEAM-14b #2)
    listing["nftables"].append({"set": {"name": "hwm", "type": "mark", "elem": [40]}})
    assert parse_listing(json.dumps(listing), ["dsv3"], Pool()).max_mark == 40


# ---------------------------------------------------------------------------- the kernel

@pytest.mark.root
def test_a_pinned_router_is_reopened_as_left(tmp_path: object, internet: Internet) -> None:
    """Router.open pins the netns; a second open (a restarted edge) finds the base table,
    the uplink, a loaded slot's generation and digest, as the first left them."""
    pin = os.path.join(str(tmp_path), "router")
    cfg = RouterConfig(pool_min=2, build_batch=2)
    r1 = Router.open(cfg, NetnsUplink(internet.fd, "nerec0"), pin)
    slot_fd = -1
    try:
        assert not r1.reopened
        view = r1.reconcile_view()
        assert not view.table and view.slots == {}
        for ins in plan([], kv(table=False, base=None, uplink=r1.has_uplink(),
                               reopened=False), r1.base_digest()):
            r1.apply(ins)  # type: ignore[arg-type]
        r1.refill()
        s = r1.take()
        gen = r1.load(s, SlotPolicy(allow4=(Dest4.of("203.0.113.1/32", "tcp", (80, 80)),)),
                      digest="d-one")
        slot_fd = os.dup(s.fd)  # what a sandbox's processes would hold
        r1.close(unpin=False)   # as a crash leaves it (pinned)
        assert os.path.ismount(pin)
        r2 = Router.open(cfg, NetnsUplink(internet.fd, "nerec0"), pin)
        try:
            assert r2.reopened
            view = r2.reconcile_view()
            assert view.table and view.base_digest == r2.base_digest() and r2.has_uplink()
            seen = view.slots[s.index]
            assert (seen.link, seen.objects, seen.generation, seen.digest) == (
                True, True, gen, "d-one")
            # the slots nobody held went with r1's fds (the kernel removes a netns and
            # its veth asynchronously: reconcile deletes such a link itself)
            for _ in range(200):
                linked = [i for i, x in r2.reconcile_view().slots.items() if x.link]
                if linked == [s.index]:
                    break
                time.sleep(0.05)
            assert linked == [s.index]
            assert f"dsv{s.index}" in links_in(r2.fd)
            # no journal sandbox holds it (the census killed its processes): the plan
            # deletes its link and flushes its sets; generations move on past it
            steps = plan([], KernelView(table=True, base_digest=view.base_digest,
                                        uplink=True, slots=view.slots,
                                        max_mark=view.max_mark), r2.base_digest())
            assert DeleteLink(s.index) in steps and FlushSlot(s.index) in steps
            for ins in steps:
                r2.apply(ins)  # type: ignore[arg-type]
            after = r2.reconcile_view()
            assert f"dsv{s.index}" not in links_in(r2.fd)
            assert after.slots[s.index].elements == 0 and after.slots[s.index].objects
            assert r2.next_generation() == gen + 1
        finally:
            r2.close(unpin=True)
    finally:
        r1.close(unpin=True)
        if slot_fd >= 0:
            os.close(slot_fd)
    assert not os.path.exists(pin)
    assert netns.open_pinned(pin) is None
