"""Figures of the ``join`` stream of issue 16, for suite ``cluster`` (``bench/cluster.py``
calls :func:`run`): Aether over TCP vs TCP+TLS side by side, the TLS connect, and a join.

- ``aether_rpc_tcp`` / ``aether_rpc_tls`` (calls/s; params ``in_flight`` 1 and 64): one
  connection on loopback, a no-op method, the server in a child process (as an edge is),
  the two transports interleaved trial by trial so both see the same machine weather;
- ``aether_tls_connect_ms``: dial + mutual TLS 1.3 handshake + the first call (p50);
- ``cluster_join_ms``: ``JoinAuthority.join`` (token check, CSR signature check, signing,
  the token use and node row in one SQLite transaction), p50.

Measured on the 2-core dev VM under load (2026-12-02, other engineers' suites running;
medians of 5 interleaved trials, spread min..max): 1 in flight TCP 24.6k calls/s
(9.0k..27.3k) vs TLS 10.0k (8.2k..14.2k); 64 in flight TCP 112k (82k..152k) vs TLS 100k
(96k..119k); a quick run on a quieter moment: 27.8k vs 18.8k (1 in flight), 167k vs
147k (64). So TLS costs ~10-30% of the calls/s at 1 in flight (one record encrypted and
decrypted per frame each way, through the SSL object's extra copy) and ~10% pipelined,
where frames share records. connect + mutual handshake + first call: 3.2-5.1 ms p50; a
join 0.4 ms p50. That is the price a cross-host edge pays for not trusting the network;
same-host edges keep Unix sockets (no TLS).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any

from dsec.bench import Result

__all__ = ["run"]

SUITE = "cluster"


def _serve(ca_dir: str, port_tcp: int, port_tls: int, ready: Any) -> None:
    import uvloop

    from dsec.aether import Router
    from dsec.aether.transport import serve
    from dsec.cluster.ca import NodeCredentials

    async def main() -> None:
        r = Router()
        r.add("noop", lambda body: None)
        creds = NodeCredentials(os.path.join(ca_dir, "edge"))
        tcp = await serve(r, f"tcp:127.0.0.1:{port_tcp}")
        tls = await serve(r, f"tcp:127.0.0.1:{port_tls}", ssl=creds.server_context())
        ready.set()
        try:
            await asyncio.Event().wait()
        finally:
            await tcp.close()
            await tls.close()
    uvloop.run(main())


def _port() -> int:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = int(s.getsockname()[1])
    s.close()
    return p


async def _measure(quick: bool, ca: Any, port_tcp: int, port_tls: int) -> list[Result]:
    from dsec.aether.transport import connect

    out: list[Result] = []
    ctx = ca.client_context()
    tcp = await connect(f"tcp:127.0.0.1:{port_tcp}")
    tls = await connect(f"tcp:127.0.0.1:{port_tls}", ssl=ctx, server_hostname="bench-edge")
    n = 3_000 if quick else 30_000
    trials = 1 if quick else 5
    for conn in (tcp, tls):
        for _ in range(300):
            await conn.call("noop")

    async def seq(conn: Any) -> float:
        t0 = time.perf_counter()
        for _ in range(n // 3):
            await conn.call("noop")
        return (n // 3) / (time.perf_counter() - t0)

    async def piped(conn: Any) -> float:
        async def worker(m: int) -> None:
            for _ in range(m):
                await conn.call("noop")
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(n // 64) for _ in range(64)))
        return (n // 64 * 64) / (time.perf_counter() - t0)

    for in_flight, fn in ((1, seq), (64, piped)):
        rates: dict[str, list[float]] = {"tcp": [], "tls": []}
        for _ in range(trials):
            rates["tcp"].append(await fn(tcp))
            rates["tls"].append(await fn(tls))
        for name, rs in rates.items():
            out.append(Result(SUITE, f"aether_rpc_{name}", statistics.median(rs), "calls/s",
                              {"in_flight": in_flight, "trials": trials,
                               "spread": f"{min(rs):,.0f}..{max(rs):,.0f}",
                               "transport": "tcp loopback" + (" + mutual TLS 1.3"
                                                              if name == "tls" else "")}))
    await tcp.close()
    await tls.close()
    times = []
    for _ in range(10 if quick else 50):
        t0 = time.perf_counter()
        c = await connect(f"tcp:127.0.0.1:{port_tls}", ssl=ctx, server_hostname="bench-edge")
        await c.call("noop")
        times.append((time.perf_counter() - t0) * 1e3)
        await c.close()
    out.append(Result(SUITE, "aether_tls_connect_ms", statistics.median(times), "ms",
                      {"what": "dial + TLS 1.3 mutual handshake + first call", "n": len(times)}))
    return out


def _join_figure(quick: bool, d: str) -> Result:
    from dsec.cluster.ca import init_ca, new_node_key
    from dsec.cluster.join import JoinAuthority, join_request
    from dsec.control.store.sqlite import SqliteStore

    ca, _ = init_ca(os.path.join(d, "join-ca"))
    store = SqliteStore(os.path.join(d, "join.sqlite"))
    auth = JoinAuthority(store, ca)
    n = 20 if quick else 200
    tok, _ = auth.create_token(ttl_s=600, uses=n)
    csrs = [new_node_key(f"j-{i}")[1].decode() for i in range(n)]
    times = []
    for i, csr in enumerate(csrs):
        t0 = time.perf_counter()
        auth.join(join_request(tok, node_id=f"j-{i}", csr=csr,
                               address=f"tcp:127.0.0.1:{1000 + i}",
                               nonce=auth.challenge().nonce))
        times.append((time.perf_counter() - t0) * 1e3)
    store.close()
    return Result(SUITE, "cluster_join_ms", statistics.median(times), "ms",
                  {"n": n, "store": "sqlite", "what": "nonce + token proof check + CSR sign + node row"})


def run(quick: bool) -> list[Result]:
    import uvloop
    from cryptography.hazmat.primitives import serialization

    from dsec.cluster.ca import NodeCredentials, init_ca, issue_node_cert, new_node_key

    with tempfile.TemporaryDirectory(prefix="dsec-bench-join-") as d:
        ca, _ = init_ca(os.path.join(d, "ca"))
        key, csr = new_node_key("bench-edge")
        cert = issue_node_cert(ca, csr, "bench-edge")
        NodeCredentials(os.path.join(ca.dir, "edge")).save(
            key, cert.public_bytes(serialization.Encoding.PEM), ca.pem)
        port_tcp, port_tls = _port(), _port()
        mpctx = mp.get_context("spawn")
        ready = mpctx.Event()
        proc = mpctx.Process(target=_serve, args=(ca.dir, port_tcp, port_tls, ready),
                             daemon=True)
        proc.start()
        try:
            if not ready.wait(60):
                raise RuntimeError("the bench's Aether server did not start within 60 s")
            out = uvloop.run(_measure(quick, ca, port_tcp, port_tls))
        finally:
            proc.terminate()
            proc.join(10)
        out.append(_join_figure(quick, d))
    return out
