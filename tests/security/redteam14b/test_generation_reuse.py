"""Generation reuse across an edge restart lets a stale conntrack flow back in (ne,
net/reconcile.py StartGenerations / net/router.py).

The module table of reconcile.py promises "a generation is never reused on a slot: a
stale conntrack mark of a dead flow can never become live again", and nftrules.py relies
on it instead of a conntrack flush ("a previous tenant's conntrack entries can never match
again"). But a restarted edge starts generations after the largest mark found in a *live*
``sN_l`` set: the marks of slots released before the crash (their ``l`` was drained) are
not seen, while their flows stay in the pinned router netns's conntrack table (UDP 120 s,
TCP established 5 days). The next policy load on the rebuilt slot hands out the same mark.

Attack: a sandbox on slot i, allowed D udp, opens a flow (source port P) to D; the
sandbox goes (slot released), the edge restarts (kill -9: the pinned router keeps the
conntrack table); a new sandbox on slot i (same address) whose policy allows NOTHING
sends from port P to D.
Expected safe behaviour: dropped (its policy allows nothing; the old flow's mark is dead).
Observed: the packet reaches D - the stale flow's mark equals the new slot's generation,
so ``ct state established ct mark @sNl accept`` passes it (policy bypass, and the old
flow's replies reach the new tenant).
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from dsec.net import netns
from dsec.net.nftwire import Dest4, SlotPolicy
from dsec.net.reconcile import KernelView, plan
from dsec.net.router import Router, RouterConfig, Slot
from dsec.net.testinternet import ALLOWED, UDP_ECHO_PORT, Internet
from dsec.net.uplink import NetnsUplink

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]

SPORT = 40123


def send_udp(slot: Slot, data: bytes, sport: int) -> None:
    with netns.entered(slot.fd):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with u:
        u.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        u.bind(("0.0.0.0", sport))
        try:
            u.sendto(data, (ALLOWED, UDP_ECHO_PORT))
        except OSError:
            pass


def reconcile(r: Router) -> None:
    view = r.reconcile_view()
    for ins in plan([], KernelView(table=view.table, base_digest=view.base_digest,
                                   uplink=r.has_uplink(), slots=view.slots,
                                   max_mark=view.max_mark, reopened=r.reopened),
                    r.base_digest()):
        r.apply(ins)
    r.refill()


def test_stale_flow_mark_is_never_live_again_after_restart(tmp_path: object,
                                                            internet: Internet) -> None:
    pin = os.path.join(str(tmp_path), "router")
    cfg = RouterConfig(pool_min=2, build_batch=2)
    up = NetnsUplink(internet.fd, "rt14bgen")
    r1 = Router.open(cfg, up, pin)
    r2: Router | None = None
    try:
        reconcile(r1)
        s = r1.take()
        index = s.index
        g1 = r1.load(s, SlotPolicy(allow4=(Dest4.of(f"{ALLOWED}/32", "udp",
                                                    (UDP_ECHO_PORT, UDP_ECHO_PORT)),)))
        send_udp(s, b"tenant-one", SPORT)
        assert internet.wait_for(data=b"tenant-one")  # the flow exists (and was answered)
        r1.release(s, reusable=True)                   # tenant one is gone
        r1.close(unpin=False)                          # kill -9 of the edge: pinned router kept
        r2 = Router.open(cfg, up, pin)
        assert r2.reopened
        reconcile(r2)
        taken = []
        s2 = r2.take()
        while s2.index != index:
            taken.append(s2)
            s2 = r2.take()
        g2 = r2.load(s2, SlotPolicy())                 # tenant two: allowed nothing
        # positive control: a fresh flow of tenant two is refused
        send_udp(s2, b"fresh-port", SPORT + 1)
        time.sleep(0.3)
        assert internet.arrived(data=b"fresh-port") == []
        send_udp(s2, b"stale-flow", SPORT)
        time.sleep(0.5)
        got = internet.arrived(data=b"stale-flow")
        assert got == [], (
            f"tenant two (policy: nothing) reached {ALLOWED}:{UDP_ECHO_PORT} through tenant "
            f"one's conntrack flow: generation {g2} after the restart == the dead flow's "
            f"mark {g1}")
    finally:
        if r2 is not None:
            r2.close(unpin=True)
        r1.close(unpin=True)
