"""Fuzzing the listener's accept path and limits with real sockets (bounded run).

Each example is one peer's life: a mix of garbage, valid frames (authentication,
calls, pings), oversize and half-sent frames, then a hang-up (FIN or RST) at a random
point. Whatever it sends, once it has gone the listener must hold nothing for it (no
connection, pending slot, buffered byte or holder entry) and still serve a client.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsec.aether import Router, connect, serve
from dsec.aether.connection import AUTH_METHOD
from dsec.aether.frame import FrameType, encode_parts
from dsec.aether.limits import ProcessBudget, ServerLimits
from dsec.aether.messages import encode_request

TOKEN = b"fuzz-token-0123456789abcdef"
LIMITS = ServerLimits(max_connections=64, max_connections_per_peer=64, max_pending=8,
                      max_pending_per_peer=8, auth_timeout_s=0.5, frame_timeout_s=0.5,
                      idle_timeout_s=5.0, pending_max_frame=256, max_frame=1 << 20,
                      max_calls_in_flight=2)


def _frame(ftype: int, sid: int, payload: bytes, flags: int = 0) -> bytes:
    return encode_parts(ftype, sid, payload, flags) + payload


def _call(sid: int, method: str, body: object) -> bytes:
    return _frame(FrameType.REQUEST, sid, encode_request(method, msgspec.msgpack.encode(body)))


pieces = st.one_of(
    st.binary(max_size=300),                                             # garbage
    st.just(_call(1, AUTH_METHOD, TOKEN)),                               # right key
    st.just(_call(1, AUTH_METHOD, b"wrong")),                            # wrong key
    st.builds(lambda n: _call(3 + 2 * n, "nap", 0.05), st.integers(0, 50)),
    st.builds(lambda n: _call(3 + 2 * n, "echo", "x" * 200), st.integers(0, 50)),
    st.builds(lambda n: _frame(FrameType.PING, 3 + 2 * n, b"p"), st.integers(0, 50)),
    st.builds(lambda size, part: struct.pack(">4sHQBIH", b"AETH", 1, 5, 1, size, 0)
              + b"\0\0\0\0" + b"\0" * part,                              # half a frame
              st.integers(0, 2 << 20), st.integers(0, 4096)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(peers=st.lists(st.tuples(st.lists(pieces, max_size=6), st.booleans(),
                                st.integers(1, 4)), min_size=1, max_size=4))
def test_whatever_peers_send_the_listener_holds_nothing_once_they_left(
        peers: list[tuple[list[bytes], bool, int]]) -> None:
    asyncio.run(_one_round(peers))


async def _one_round(peers: list[tuple[list[bytes], bool, int]]) -> None:
    async def nap(s: float) -> str:
        await asyncio.sleep(s)
        return "ok"

    r = Router(token=TOKEN)
    r.add("echo", lambda b: b)
    r.add("nap", nap)
    budget = ProcessBudget(nofile=lambda: 100_000, max_buffered_bytes=2 << 20)
    server = await serve(r, "tcp:127.0.0.1:0", limits=LIMITS, budget=budget)
    loop = asyncio.get_running_loop()
    try:
        socks = []
        for chunks, reset, src in peers:
            s = socket.socket()
            s.bind((f"127.0.5.{src}", 0))
            s.setblocking(False)
            await loop.sock_connect(s, (server.address.host, server.address.port))
            for c in chunks:
                try:
                    await asyncio.wait_for(loop.sock_sendall(s, c), 1.0)
                except (OSError, TimeoutError):
                    break
            socks.append((s, reset))
        await asyncio.sleep(0.05)
        for s, reset in socks:
            if reset:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        for _ in range(400):
            if not server.connections and not budget.lingering:
                break
            await asyncio.sleep(0.01)
        assert not server.connections
        adm = server.admission
        assert (adm.open, adm.pending, adm.by_peer, adm.pending_by_peer) == (0, 0, {}, {})
        assert (budget.connections, budget.buffered, dict(budget.holders)) == (0, 0, {})
        conn = await connect(str(server.address), token=TOKEN)
        try:
            assert await conn.call("echo", "still here", timeout=5) == "still here"
        finally:
            await conn.close()
    finally:
        await server.close()
