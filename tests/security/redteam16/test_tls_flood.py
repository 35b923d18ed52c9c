"""Red team 16 (join): an unauthenticated peer that opens TCP connections to a joined
edge's TLS port and never sends a ClientHello.

The listener admits each socket as *pending* (ServerLimits.max_pending 1024, 64 per
address) and only then starts the TLS handshake; while the handshake runs the socket has
no Connection in the listener's pending list, so the "evict the oldest pending one when
full" rule (that lets a real client in during an idle flood on plain TCP) has nothing to
evict. A stranger with 17 addresses (an IPv6 /64 has 2^64) fills the listener for the
10 s handshake deadline, again and again: the apiserver's dial is refused, the edge is
"silent", and after node_ttl_s every sandbox on it is written off.

Real processes and sockets: an in-process apiserver runtime with its CA, a real
``dsec edge --join`` (TLS listener), raw TCP sockets from 127.0.0.2..127.0.0.20, and the
apiserver's real dial (EdgeClient.connect with the cluster CA's client context).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

from dsec.cluster.membership import EdgeTls
from dsec.edge.client import EdgeClient
from tests.cluster.test_join import EdgeProc, apiserver, eventually, free_port, healthy, rest


async def test_a_handshake_flood_from_many_addresses_does_not_lock_the_apiserver_out(
        tmp_path: Path) -> None:
    """Safe: a socket still in its TLS handshake is evictable like any pending one (or
    the handshake has its own smaller budget), so the apiserver's dial gets in."""
    async with apiserver(tmp_path / "cp") as rt, rest(rt) as http:
        port = free_port()
        edge = EdgeProc(tmp_path / "e", f"tcp:127.0.0.1:{port}")
        socks: list[socket.socket] = []
        try:
            r = await http.post("/v1/cluster/tokens", json={"ttl_s": 600, "uses": 1})
            edge.start("--join", rt.url, "--node-id", "f1",
                       env={"DSEC_JOIN_TOKEN": r.json()["token"]})
            await edge.serving()
            await eventually(lambda: healthy(rt, "f1"), 30, "f1 healthy")

            def flood() -> None:
                for i in range(2, 21):               # 19 addresses x 60 sockets
                    for _ in range(60):
                        s = socket.socket()
                        s.bind((f"127.0.0.{i}", 0))
                        s.settimeout(2)
                        try:
                            s.connect(("127.0.0.1", port))
                        except OSError:
                            s.close()
                            continue
                        socks.append(s)              # never sends a byte

            await asyncio.to_thread(flood)
            assert len(socks) > 1024, len(socks)
            await asyncio.sleep(0.5)                 # the edge accepted them
            tls = EdgeTls("f1", rt.membership.context, set())
            try:
                client = await asyncio.wait_for(
                    EdgeClient.connect(f"tcp:127.0.0.1:{port}", tls=tls, timeout=5.0), 8.0)
            except Exception as exc:
                raise AssertionError(
                    f"the apiserver could not dial its edge during a no-ClientHello flood "
                    f"of {len(socks)} sockets: {type(exc).__name__}: {exc}") from exc
            await client.close()
        finally:
            for s in socks:
                with contextlib.suppress(OSError):
                    s.close()
            await edge.stop()
