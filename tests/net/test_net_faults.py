"""Faults: kill -9 of a real ``dsec edge`` with live sandboxes on slots (plan-14 §11.5).

The router netns is pinned under the edge's state dir, so it outlives the process, and
so do the slots of live sandboxes: the restarted edge adopts them, reconciles the router
against its journal (net/reconcile.py) and its sandboxes keep their network, their
policy, their open connections and their DNS pins. Killed at every instruction of that
reconcile, or between the journal put and the netlink batch of ``network_update``, the
next start converges; nothing is lost and nothing leaks.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import pytest

from dsec.edge.client import EdgeClient
from dsec.errors import DsecError
from dsec.net.testinternet import ALLOWED, SIBLING, Internet, links_in
from dsec.wire import ops
from dsec.wire.calls import NetworkUpdateOnNode, SandboxRef
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.spec import NetworkView, SandboxSpec

from .test_edge_door import no_uplink_peers, shut, start_edge

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

#: a loop inside the sandbox holding one TCP connection to the echo port open, sending a
#: numbered line every 0.1 s (its replies land in /tmp/echo)
ECHO = (f"(i=0; while true; do i=$((i+1)); echo e$i; sleep 0.1; done | nc {ALLOWED} 7 "
        "> /tmp/echo 2>&1) </dev/null >/dev/null 2>&1 &")


async def netget(c: EdgeClient, sid: str) -> NetworkView:
    view: NetworkView = await c.call(ops.NETWORK_GET, SandboxRef(id=sid))
    return view


def spec(*allow: str) -> SandboxSpec:
    return SandboxSpec(backend="container", memory_bytes=128 << 20,
                       network=NetworkPolicy(mode="policy", allow=allow))


async def probe(c: EdgeClient, sid: str, host: str, port: int = 80) -> bool:
    r = await c.exec(sid, f"echo hi | nc -w 2 {host} {port}; true")
    return r.stdout.decode().startswith(f"ok {host}:{port}")


def kill9(proc: subprocess.Popen[bytes], sock: str) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    if os.path.exists(sock):
        os.unlink(sock)  # the dead edge's socket file (start_edge waits for a new one)


def echo_lines(internet: Internet, src: str = "") -> list[int]:
    """The numbers of the echo lines the internet got (only the ECHO loop sends to
    port 7; every sandbox leaves the node masqueraded to one address), in order."""
    out: list[int] = []
    for h in internet.arrived(dst=ALLOWED, port=7, proto="tcp"):
        out += [int(x[1:]) for x in h.data.decode().split() if x[1:].isdigit()]
    return out


async def wait_more(internet: Internet, src: str, above: int, timeout: float = 10) -> int:
    for _ in range(int(timeout / 0.1)):
        got = echo_lines(internet, src)
        if got and got[-1] > above:
            return got[-1]
        await asyncio.sleep(0.1)
    raise AssertionError(f"no echo line above n{above} from {src}: {echo_lines(internet, src)}")


async def test_kill_9_of_the_edge_keeps_its_sandboxes_networks(
        tmp_path: object, internet: Internet) -> None:
    root = str(tmp_path)
    pin = os.path.join(root, "state", "net", "router")
    proc, sock = await start_edge(root, internet)
    try:
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            a = await c.create(spec(f"{ALLOWED}:80/tcp", f"{ALLOWED}:7/tcp"))
            b = await c.create(spec("allowed.test:80/tcp"))
            # the project ceiling's deny entries are journaled beside the policy
            ceiled = await c.create(spec("203.0.113.0/28:80/tcp"),
                                    ceiling_deny=(f"{SIBLING}/32:80/tcp",))
            assert await probe(c, ceiled.id, ALLOWED) and not await probe(c, ceiled.id, SIBLING)
            assert await probe(c, a.id, ALLOWED) and not await probe(c, a.id, SIBLING)
            r = await c.exec(b.id, "nslookup allowed.test >/dev/null; echo hi | nc -w 2 "
                             f"{ALLOWED} 80")
            assert r.stdout.decode().startswith(f"ok {ALLOWED}:80")
            await c.exec(a.id, ECHO)
            got = await netget(c, a.id)
            src = got.address
            assert src is not None
            await wait_more(internet, src, 3)
        kill9(proc, sock)
        # the router outlived the edge: its uplink, the slots' links, the flow
        assert os.path.ismount(pin)
        assert any(n.startswith("dsu") for n in links_in(internet.fd))
        n = await wait_more(internet, src, echo_lines(internet, src)[-1])  # edge down
    except BaseException:
        await shut(proc, sock)
        raise
    proc, sock = await start_edge(root, internet)
    try:
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            assert sorted(i.id for i in await c.list()) == sorted(
                [a.id, b.id, ceiled.id])  # lost: 0
            # adopted with its ceiling's denies, not just its own policy
            assert await probe(c, ceiled.id, ALLOWED) and not await probe(c, ceiled.id, SIBLING)
            # the same connection still flows (one accept from src on port 7, ever)
            await wait_more(internet, src, n)
            assert len([h for h in internet.arrived(dst=ALLOWED, port=7, proto="tcp")
                        if h.data == b""]) == 1
            # the policy holds: allowed still allowed, denied still denied
            assert await probe(c, a.id, ALLOWED) and not await probe(c, a.id, SIBLING)
            # its DNS pins were re-read from the kernel (no query since the restart)
            assert (await netget(c, b.id)).pins >= 1
            # its DNS: the name still resolves and the pinned address is reachable
            r = await c.exec(b.id, "nslookup allowed.test; echo hi | nc -w 2 "
                             f"{ALLOWED} 80; echo hi | nc -w 2 {SIBLING} 80; true")
            out = r.stdout.decode()
            assert f"ok {ALLOWED}:80" in out and f"ok {SIBLING}" not in out, out
            # network_update works on an adopted sandbox
            view = await c.network_update(NetworkUpdateOnNode(id=a.id, policy=NetworkPolicy(
                mode="policy", allow=(f"{ALLOWED}:80/tcp", f"{SIBLING}:80/tcp"))))
            assert view.address == src
            assert await probe(c, a.id, SIBLING)
            # the echo connection is cut: the new policy no longer names port 7
            await asyncio.sleep(0.5)
            cut = echo_lines(internet, src)[-1]
            await asyncio.sleep(1.0)
            assert echo_lines(internet, src)[-1] <= cut + 1
            # a new sandbox gets a free slot, not one of the adopted ones
            new = await c.create(spec(f"{ALLOWED}:80/tcp"))
            assert await probe(c, new.id, ALLOWED)
            assert (await netget(c, new.id)).address not in (src, None)
    finally:
        await shut(proc, sock)
    # everything destroyed and a clean stop: the router goes with the edge
    assert not os.path.exists(pin)
    assert await no_uplink_peers(internet) == []


async def _statuses(sock: str, ids: list[str]) -> dict[str, tuple[bool, bool]]:
    async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
        assert sorted(i.id for i in await c.list()) == sorted(ids)
        return {sid: (await probe(c, sid, ALLOWED), await probe(c, sid, SIBLING))
                for sid in ids}


async def test_kill_9_at_every_reconcile_step_converges(
        tmp_path: object, internet: Internet) -> None:
    root = str(tmp_path)
    proc, sock = await start_edge(root, internet)
    ids: list[str] = []
    try:
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            for allow in ((f"{ALLOWED}:80/tcp",), (f"{ALLOWED}:80/tcp", "198.51.100.0/24:22/tcp")):
                ids.append((await c.create(spec(*allow))).id)
        kill9(proc, sock)
        crashed = 0
        for step in range(12):
            proc, sock = await start_edge(
                root, internet, env={"DSEC_TEST_CRASH_AT": f"reconcile:{step}"}, wait=False)
            for _ in range(600):
                if proc.poll() is not None or os.path.exists(sock):
                    break
                await asyncio.sleep(0.05)
            if proc.poll() is None:  # the plan has fewer steps: it served
                break
            assert proc.returncode == 137, proc.stderr.read().decode()  # type: ignore[union-attr]
            crashed += 1
            if os.path.exists(sock):
                os.unlink(sock)
        assert crashed >= 3  # StartGenerations, BuildObjects, one per sandbox at least
        assert await _statuses(sock, ids) == {sid: (True, False) for sid in ids}
    finally:
        await shut(proc, sock)
    assert await no_uplink_peers(internet) == []


async def test_kill_9_between_journal_and_batch_of_an_update(
        tmp_path: object, internet: Internet) -> None:
    root = str(tmp_path)
    proc, sock = await start_edge(root, internet,
                                  env={"DSEC_TEST_CRASH_AT": "network_update:batch"})
    new = NetworkPolicy(mode="policy", allow=(f"{ALLOWED}:80/tcp", f"{SIBLING}:80/tcp"))
    try:
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            a = await c.create(spec(f"{ALLOWED}:80/tcp"))
            assert not await probe(c, a.id, SIBLING)
            with pytest.raises(DsecError):  # the edge dies mid-update: no answer
                await c.network_update(NetworkUpdateOnNode(id=a.id, policy=new))
        proc.wait(10)
        assert proc.returncode == 137
        os.unlink(sock)
    except BaseException:
        await shut(proc, sock)
        raise
    proc, sock = await start_edge(root, internet)
    try:
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            # journal said new, kernel said old: reconcile loaded the journal's
            got = await netget(c, a.id)
            assert got.policy == new
            assert await probe(c, a.id, SIBLING) and await probe(c, a.id, ALLOWED)
            # the client's retry is a no-op (same generation)
            again = await c.network_update(NetworkUpdateOnNode(id=a.id, policy=new))
            assert again.generation == got.generation
            assert await probe(c, a.id, SIBLING)
    finally:
        await shut(proc, sock)
    assert await no_uplink_peers(internet) == []
