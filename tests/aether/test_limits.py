"""Listener limits (issue 12): idle floods are refused with a reason, deadlines cut what
stalls, partial frames are bounded and freed, and running out of file descriptors
neither spins nor stops the listener.

Real sockets on loopback (several 127.0.0.x source addresses stand for several peers);
caps are set low so a few dozen connections prove each point."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import subprocess
import sys
import textwrap
import time
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from dsec.aether import Router, Server, connect, serve
from dsec.aether.connection import AUTH_METHOD
from dsec.aether.frame import FrameType, encode_parts
from dsec.aether.limits import Admission, ProcessBudget, ServerLimits
from dsec.aether.messages import Goaway, encode_request
from dsec.errors import ConnectionLost, InvalidArgument, Overloaded
from tests.aether.conftest import RawPeer

TOKEN = b"limits-test-token-0123456789"

LOW = ServerLimits(max_connections=40, max_connections_per_peer=30, max_pending=20,
                   max_pending_per_peer=8, auth_timeout_s=0.6, idle_timeout_s=30.0,
                   frame_timeout_s=0.6, pending_max_frame=1024)


def _router(token: bytes | None = TOKEN) -> Router:
    r = Router(token=token)
    r.add("echo", lambda b: b)

    async def nap(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "rested"

    r.add("nap", nap)
    return r


@pytest.fixture
def budget() -> ProcessBudget:
    """A budget of its own, so tests do not share the process's connection counts."""
    return ProcessBudget(nofile=lambda: 100_000)


@pytest.fixture
async def low(budget: ProcessBudget) -> AsyncIterator[Server]:
    server = await serve(_router(), "tcp:127.0.0.1:0", limits=LOW, budget=budget)
    try:
        yield server
    finally:
        await server.close()


async def _raw(server: Server, src: str = "127.0.0.1") -> RawPeer:
    r, w = await asyncio.open_connection(server.address.host, server.address.port,
                                         local_addr=(src, 0))
    return RawPeer(r, w)


async def _goaway_then_eof(peer: RawPeer, timeout: float = 5.0) -> Goaway:
    """The GOAWAY the server sent before closing, once it has closed."""
    f = await peer.frame_of(FrameType.GOAWAY, timeout)
    assert await peer.closed_by_peer(timeout)
    return msgspec.msgpack.decode(f[2], type=Goaway)


async def _until(cond: Any, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


def _auth_frame(sid: int = 1, token: bytes = TOKEN) -> bytes:
    payload = encode_request(AUTH_METHOD, msgspec.msgpack.encode(token))
    return encode_parts(FrameType.REQUEST, sid, payload) + payload


# ------------------------------------------------------------------ pure bookkeeping
def test_admission_counts_listener_peer_pending_and_the_process_fd_share() -> None:
    fds = [100]
    budget = ProcessBudget(connection_share=0.5, nofile=lambda: fds[0])
    adm = Admission(ServerLimits(max_connections=6, max_connections_per_peer=4,
                                 max_pending=5, max_pending_per_peer=3), budget, name="L")
    assert [adm.admit("a") for _ in range(3)] == [None] * 3
    kind, why = adm.admit("a") or ("", "")
    assert kind == "peer_pending_full" and "3 unauthenticated connections from a" in why
    adm.establish("a")                       # one of a's authenticates
    assert adm.admit("a") is None            # a: 4 open, 3 pending
    assert (adm.admit("a") or ("",))[0] == "peer_full"
    assert [adm.admit("b") for _ in range(2)] == [None] * 2   # 6 open, 5 pending
    assert (adm.admit("c") or ("",))[0] == "listener_full"
    adm.release("b", established=False)
    adm.release("a", established=True)
    assert (adm.open, adm.pending, budget.connections) == (4, 4, 4)
    fds[0] = 8                                # the process's share: 4 connections
    kind, why = adm.admit("c") or ("", "")
    assert kind == "fds" and "(4)" in why
    for p in ("a", "a", "a", "b"):
        adm.release(p, established=False)
    assert (adm.open, adm.pending, budget.connections, adm.by_peer) == (0, 0, 0, {})
    assert adm.stats.accepted == 6


def test_limits_refuse_nonsense() -> None:
    with pytest.raises(InvalidArgument, match="max_pending_per_peer=0"):
        ServerLimits(max_pending_per_peer=0)
    with pytest.raises(InvalidArgument, match="idle_timeout_s"):
        ServerLimits(idle_timeout_s=0)
    with pytest.raises(InvalidArgument, match="pending_max_frame"):
        ServerLimits(pending_max_frame=1 << 20, max_frame=1 << 10)
    with pytest.raises(InvalidArgument, match="connection_share"):
        ProcessBudget(connection_share=1.0)


# ------------------------------------------------------------------ idle floods
async def test_an_idle_flood_is_refused_with_a_reason_and_clients_still_get_in(
        low: Server, budget: ProcessBudget) -> None:
    peers = [await _raw(low, "127.0.0.2") for _ in range(12)]
    # one address: 8 may wait to authenticate, the other 4 are told why not
    await _until(lambda: low.stats.accepted + low.stats.refused_total >= 12)
    assert low.admission.pending_by_peer == {"127.0.0.2": 8}
    assert low.stats.refused == {"peer_pending_full": 4}
    # more addresses: the listener holds 20 waiting; newcomers push out the oldest
    peers += [await _raw(low, f"127.0.0.{3 + i % 3}") for i in range(36)]
    try:
        await _until(lambda: low.stats.accepted + low.stats.refused_total >= 48)
        assert low.admission.pending == 20
        assert max(low.admission.pending_by_peer.values()) <= 8
        assert budget.connections == low.admission.open == 20
        assert low.stats.closed["evicted"] > 0

        # a client that authenticates at once gets in, and works while the flood waits
        good = await connect(low.address, token=TOKEN)
        assert await good.call("echo", "through") == "through"

        # every stranger hears why it was dropped: refused or evicted now (overloaded),
        # or cut at its authentication deadline; none is left hanging
        reasons = await asyncio.gather(*(_goaway_then_eof(p) for p in peers))
        over = [g for g in reasons if g.code == Overloaded.code]
        late = [g for g in reasons if "did not authenticate within 0.6s" in g.reason]
        assert len(over) + len(late) == 48
        assert len(late) <= 20 and len(over) >= 28
        assert any("unauthenticated connections from 127.0.0.2" in g.reason for g in over)
        assert any("dropped to make room" in g.reason for g in over)
        assert low.stats.closed["auth_timeout"] == len(late)
        await _until(lambda: low.admission.pending == 0)
        assert low.admission.open == 1 and budget.connections == 1
        assert await good.call("echo", "still") == "still"
        await good.close()
        await _until(lambda: budget.connections == 0)
    finally:
        for p in peers:
            await p.close()


async def test_a_refused_dialer_raises_overloaded(budget: ProcessBudget) -> None:
    one = ServerLimits(max_connections=1, max_pending_per_peer=1, auth_timeout_s=5.0)
    server = await serve(_router(), "tcp:127.0.0.1:0", limits=one, budget=budget)
    try:
        first = await connect(server.address, token=TOKEN)
        with pytest.raises(Overloaded, match="at its limit of 1 connections") as e:
            await connect(server.address, token=TOKEN)
        assert e.value.detail["retryable"] is True
        assert await first.call("echo", 1) == 1
        await first.close()
    finally:
        await server.close()


async def test_a_no_token_endpoint_wants_a_first_frame_in_time(budget: ProcessBudget,
                                                                tmp_path: Any) -> None:
    server = await serve(_router(token=None), f"unix:{tmp_path}/e.sock", limits=LOW,
                         budget=budget)
    try:
        r, w = await asyncio.open_unix_connection(f"{tmp_path}/e.sock")
        silent = RawPeer(r, w)
        g = await _goaway_then_eof(silent)
        assert "did not send its first frame within 0.6s" in g.reason
        assert server.stats.closed["auth_timeout"] == 1
        # Unix peers are counted by uid
        assert server.admission.by_peer == {}
        conn = await connect(server.address)
        assert await conn.call("echo", "x") == "x"
        assert server.admission.by_peer == {f"uid:{os.getuid()}": 1}
        await silent.close()
        await conn.close()
    finally:
        await server.close()


async def test_idle_connections_are_closed_but_busy_ones_are_not(budget: ProcessBudget
                                                                  ) -> None:
    lim = dataclasses.replace(LOW, idle_timeout_s=0.6)
    server = await serve(_router(), "tcp:127.0.0.1:0", limits=lim, budget=budget)
    try:
        idle = await connect(server.address, token=TOKEN)
        busy = await connect(server.address, token=TOKEN)
        nap = asyncio.ensure_future(busy.call("nap", 1.5))  # longer than the idle timeout
        await _until(lambda: idle.closed, timeout=5)
        assert await nap == "rested"       # a call in flight kept its connection
        assert not busy.closed
        assert server.stats.closed["idle"] == 1
        with pytest.raises(ConnectionLost, match="idle for 0.6s"):
            await idle.call("echo", 1)
        await busy.close()
        await idle.close()
    finally:
        await server.close()


# ------------------------------------------------------------------ big, slow frames
async def test_an_unauthenticated_peer_cannot_announce_a_big_frame(low: Server,
                                                                    budget: ProcessBudget
                                                                    ) -> None:
    peer = await _raw(low)
    try:
        payload_len = 16 << 20
        peer.send_raw(encode_parts(FrameType.REQUEST, 1, b"")[:15]
                      + payload_len.to_bytes(4, "big") + b"\0" * 6 + b"x" * 1000)
        g = await _goaway_then_eof(peer)
        assert "exceeds the limit of 1024 bytes" in g.reason
        assert "until the connection authenticates" in g.reason
        await _until(lambda: budget.connections == 0)
        assert budget.buffered == 0
    finally:
        await peer.close()


async def test_a_slow_frame_is_cut_and_its_bytes_released(low: Server,
                                                          budget: ProcessBudget) -> None:
    peer = await _raw(low)
    try:
        peer.send_raw(_auth_frame())
        assert (await peer.frame())[0] == FrameType.RESPONSE
        head = encode_parts(FrameType.REQUEST, 3, b"\0" * (4 << 20))  # announces 4 MiB
        peer.send_raw(head + b"\0" * (256 << 10))                    # sends 256 KiB
        await _until(lambda: budget.buffered >= 256 << 10)
        g = await _goaway_then_eof(peer)
        assert "still incomplete" in g.reason and "0.6s per frame" in g.reason
        assert low.stats.closed["frame_timeout"] == 1
        assert budget.buffered == 0
    finally:
        await peer.close()


async def test_the_process_buffer_budget_closes_the_largest_holder() -> None:
    budget = ProcessBudget(nofile=lambda: 100_000, max_buffered_bytes=7 << 19)  # 3.5 MiB
    lim = ServerLimits(frame_timeout_s=30.0)
    server = await serve(_router(), "tcp:127.0.0.1:0", limits=lim, budget=budget)
    peers: list[RawPeer] = []
    try:
        for i in range(4):   # each announces 4 MiB and sends 1 MiB: the 4th overflows
            p = await _raw(server)
            peers.append(p)
            p.send_raw(_auth_frame())
            assert (await p.frame())[0] == FrameType.RESPONSE
            p.send_raw(encode_parts(FrameType.REQUEST, 3, b"\0" * (4 << 20)) + b"\0" * (1 << 20))
            if i < 3:
                await _until(lambda n=i: budget.buffered >= (n + 1) << 20)
        # the 4th overflows it; whoever holds the most then is closed (all hold ~1 MiB)
        await _until(lambda: server.stats.closed.get("buffer_budget", 0) == 1)
        told = []
        for p in peers:
            with contextlib.suppress(TimeoutError, EOFError):
                told.append(await _goaway_then_eof(p, timeout=0.5))
        assert len(told) == 1, told
        g = told[0]
        assert g.code == Overloaded.code and "over its budget of 3670016" in g.reason
        assert server.stats.closed["buffer_budget"] == 1
        assert budget.buffered <= 7 << 19
        for p in peers:
            await p.close()
        await _until(lambda: budget.buffered == 0)
    finally:
        for p in peers:
            await p.close()
        await server.close()


async def test_partial_frames_are_freed_when_their_peers_leave() -> None:
    """64 peers each announce 16 MiB and send 1 MiB, then hang up: what the server held
    for them is freed at once, not when the cyclic garbage collector gets round to it
    (a Connection and its protocol refer to each other)."""
    budget = ProcessBudget(nofile=lambda: 100_000, max_buffered_bytes=None)
    server = await serve(_router(), "tcp:127.0.0.1:0",
                         limits=ServerLimits(frame_timeout_s=60.0), budget=budget)
    peers: list[RawPeer] = []
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        chunk = b"\0" * (1 << 20)
        for _ in range(64):
            p = await _raw(server)
            peers.append(p)
            p.send_raw(_auth_frame())
            p.send_raw(encode_parts(FrameType.REQUEST, 3, b"\0" * (16 << 20)) + chunk)
        await _until(lambda: budget.buffered >= 64 << 20, timeout=20)
        held = tracemalloc.get_traced_memory()[0] - base
        assert held >= 64 << 20
        for p in peers:
            await p.close()
        await _until(lambda: not server.connections, timeout=10)
        await asyncio.sleep(0.05)
        after = tracemalloc.get_traced_memory()[0] - base
        assert budget.buffered == 0
        assert after < 8 << 20, f"{after} bytes still held after the peers left"
    finally:
        tracemalloc.stop()
        gc.enable()
        for p in peers:
            await p.close()
        await server.close()


# ------------------------------------------------------------------ out of fds
_CHILD = textwrap.dedent("""
    import asyncio, os, resource, sys
    import uvloop
    from dsec.aether import Router, serve
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    from dsec.aether.limits import ProcessBudget

    async def main():
        r = Router(token=%(token)r)
        r.add("echo", lambda b: b)
        # not the budget's fd share under test here: the fd table itself runs out
        server = await serve(r, "tcp:127.0.0.1:0",
                             budget=ProcessBudget(nofile=lambda: 1 << 20))
        hog = []
        try:
            while True:
                hog.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        print(server.address.port, flush=True)
        while not os.path.exists(sys.argv[1]):   # stat(2) needs no fd
            await asyncio.sleep(0.05)
        for fd in hog:
            os.close(fd)
        await asyncio.sleep(60)

    uvloop.run(main())
""")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_out_of_fds_refuses_with_a_reason_without_spinning(tmp_path: Any) -> None:
    flag = tmp_path / "free"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD % {"token": TOKEN.decode()}, str(flag)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())

        async def probe() -> list[Goaway]:
            out = []
            for _ in range(5):
                r, w = await asyncio.open_connection("127.0.0.1", port)
                out.append(await _goaway_then_eof(RawPeer(r, w)))
                w.close()
            return out

        refusals = asyncio.run(probe())
        assert all(g.code == Overloaded.code and "out of file descriptors" in g.reason
                   for g in refusals), refusals
        cpu0, t0 = _cpu_seconds(child.pid), time.monotonic()
        time.sleep(2.0)                 # with the fd table still full
        spent = _cpu_seconds(child.pid) - cpu0
        assert spent < 0.5 * (time.monotonic() - t0), f"spinning: {spent:.2f}s CPU in 2s"
        flag.write_text("go")

        async def works() -> Any:
            deadline = time.monotonic() + 10
            while True:
                try:
                    c = await connect(f"tcp:127.0.0.1:{port}", token=TOKEN)
                    break
                except Overloaded:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
            v = await c.call("echo", "back")
            await c.close()
            return v

        assert asyncio.run(works()) == "back"
        assert child.poll() is None, "the listener's process died"
    finally:
        child.kill()
        child.wait()


async def test_an_established_shared_link_is_not_cut_as_the_largest_holder() -> None:
    """The apiserver's link to an edge (``shared_link``) carries every tenant; it used to
    be eligible as "the largest holder" of the process's buffer budget - mid-way
    through one tenant's 16 MiB write_file frame while strangers held partial frames on
    another listener of the process - and cutting it failed every tenant on the node.
    Once established it is not counted; the strangers are cut instead."""
    budget = ProcessBudget(nofile=lambda: 100_000, max_buffered_bytes=7 << 19)  # 3.5 MiB
    edge = await serve(_router(), "tcp:127.0.0.1:0", budget=budget,
                       limits=ServerLimits(frame_timeout_s=30.0, shared_link=True))
    other = await serve(_router(), "tcp:127.0.0.1:0", budget=budget,
                        limits=ServerLimits(frame_timeout_s=30.0))
    peers: list[RawPeer] = []
    try:
        link = await _raw(edge)
        peers.append(link)
        link.send_raw(_auth_frame())
        assert (await link.frame())[0] == FrameType.RESPONSE
        # the link is mid-way through a big frame: 3 MiB of 4 MiB in
        link.send_raw(encode_parts(FrameType.REQUEST, 3, b"\0" * (4 << 20)) + b"\0" * (3 << 20))
        await asyncio.sleep(0.2)
        assert budget.buffered == 0        # not counted
        for _ in range(4):                 # strangers: 1 MiB partial frames each
            p = await _raw(other)
            peers.append(p)
            p.send_raw(_auth_frame())
            assert (await p.frame())[0] == FrameType.RESPONSE
            p.send_raw(encode_parts(FrameType.REQUEST, 3, b"\0" * (4 << 20)) + b"\0" * (1 << 20))
        await _until(lambda: other.stats.closed.get("buffer_budget", 0) >= 1)
        assert edge.stats.closed.get("buffer_budget") is None
        assert len(edge.connections) == 1
    finally:
        for p in peers:
            await p.close()
        await edge.close()
        await other.close()
