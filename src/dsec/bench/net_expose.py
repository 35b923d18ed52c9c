"""Bench figures of exposed ports (issue 14): ``net_expose_rps`` and the latency the
proxy path adds over a direct connection.

The path: client -> apiserver (HTTP parse, token check) -> Aether duplex stream over the
edge link -> the edge's socket inside the sandbox's netns -> busybox httpd in a container
sandbox. The direct baseline is the same busybox httpd binary on the host's loopback,
so the difference is the proxy path. ``dsec up`` runs as its own process (its CPU is not
the load generator's). busybox httpd closes each connection after one answer, so the
direct client reconnects per request while the proxy's client keeps its connection to
the apiserver (the proxy opens one tunnel per request either way).

Suite ``net`` belongs to bench/net.py (N-B); until that module exists this one
registers ``net`` with only these figures, and bench/net.py calls :func:`expose`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

from dsec.bench import _SUITES, BenchContext, suite

__all__ = ["expose"]

BODY = b"x" * 64


async def _worker(host: str, port: int, path: bytes, deadline: float, lat: list[float],
                  keep_alive: bool) -> int:
    req = b"GET " + path + b" HTTP/1.1\r\nHost: bench\r\n\r\n"
    n = 0
    reader = writer = None
    try:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            assert reader is not None
            writer.write(req)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"bench request failed: {head[:200]!r}")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            if not keep_alive:
                writer.close()
                writer = reader = None
            lat.append(time.perf_counter() - t0)
            n += 1
    finally:
        if writer is not None:
            writer.close()
    return n


async def _load(host: str, port: int, path: bytes, conns: int, seconds: float,
                keep_alive: bool) -> tuple[float, list[float]]:
    lat: list[float] = []
    t0 = time.perf_counter()
    deadline = t0 + seconds
    counts = await asyncio.gather(*(_worker(host, port, path, deadline, lat, keep_alive)
                                    for _ in range(conns)))
    return sum(counts) / (time.perf_counter() - t0), lat


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def expose(ctx: BenchContext) -> None:
    """``net_expose_rps`` (conns 16), ``net_expose_added_ms_p50`` and the direct figures."""
    if os.geteuid() != 0 or shutil.which("busybox") is None:
        ctx.note("net_expose_*: skipped (needs root for container sandboxes, and busybox)")
        return
    import uvloop

    from dsec.cluster.local import LocalCluster

    conns = 16
    seconds = 2.0 if ctx.quick else 8.0
    with tempfile.TemporaryDirectory(prefix="dsec-bench-expose-") as tmp, \
            LocalCluster(edges=1, backend="container", subprocess=True) as cl, \
            cl.client(protocol="http", session_lease_s=None) as c:
        sb = c.sandboxes.create()
        try:
            www = "/tmp/www"
            r = sb.exec(f"mkdir -p {www} && printf '{BODY.decode()}' > {www}/index.html && "
                        f"httpd -p 127.0.0.1:8000 -h {www}", timeout=10)
            if r.exit_code:
                raise RuntimeError(f"httpd did not start in the sandbox: {r}")
            url = sb.ports.expose(8000)
            host, _, rest = url.removeprefix("http://").partition("/")
            h, _, p = host.partition(":")
            path = b"/" + rest.encode()
            # direct: the same httpd on the host's loopback
            os.makedirs(os.path.join(tmp, "www"))
            with open(os.path.join(tmp, "www", "index.html"), "wb") as f:
                f.write(BODY)
            dport = _free_port()
            httpd = subprocess.Popen(["busybox", "httpd", "-f", "-p", f"127.0.0.1:{dport}",
                                      "-h", os.path.join(tmp, "www")])
            try:
                time.sleep(0.2)
                rps, lat = uvloop.run(_load(h, int(p), path, conns, seconds, True))
                d_rps, d_lat = uvloop.run(_load("127.0.0.1", dport, b"/", conns, seconds,
                                                False))
                one, _ = uvloop.run(_load(h, int(p), path, 1, seconds / 2, True))
                seq_proxy = uvloop.run(_load(h, int(p), path, 1, seconds / 2, True))[1]
                seq_direct = uvloop.run(_load("127.0.0.1", dport, b"/", 1, seconds / 2,
                                              False))[1]
            finally:
                httpd.kill()
                httpd.wait()
        finally:
            sb.kill()
    ctx.record("net_expose_rps", rps, "req/s", conns=conns, path="apiserver proxy")
    ctx.record("net_expose_p50_ms", statistics.median(lat) * 1e3, "ms", conns=conns)
    ctx.record("net_expose_direct_rps", d_rps, "req/s", conns=conns,
               path="same httpd on the host loopback, a connection per request")
    ctx.record("net_expose_direct_p50_ms", statistics.median(d_lat) * 1e3, "ms", conns=conns)
    ctx.record("net_expose_rps", one, "req/s", conns=1, path="apiserver proxy")
    added = statistics.median(seq_proxy) - statistics.median(seq_direct)
    ctx.record("net_expose_added_ms_p50", added * 1e3, "ms", conns=1,
               proxy_p50_ms=round(statistics.median(seq_proxy) * 1e3, 3),
               direct_p50_ms=round(statistics.median(seq_direct) * 1e3, 3))
    ctx.note("net_expose_*: GET of a 64-byte page from busybox httpd in a container sandbox "
             "through /v1/proxy (a tunnel per request: setns socket at the edge, an Aether "
             "duplex stream, h11 at the apiserver), vs the same httpd on the host loopback; "
             "dsec up in its own process, the load generator in the bench process (uvloop).")


if "net" not in _SUITES:
    suite("net", "Networking: exposed ports through the apiserver (more figures: bench/net.py)")(
        expose)
