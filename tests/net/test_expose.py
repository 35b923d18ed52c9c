"""Exposed ports, end to end: a real container sandbox runs a server (busybox httpd, or nc
to capture what arrives), reached through the apiserver's proxy URL; nothing listens on
the node for it. Auth (URL token, API keys of each role, another tenant), the sandbox
never seeing a caller's credentials, closing, destroying, limits, and a slow reader or
many connections on one sandbox not starving another's traffic. Every door: REST (raw
httpx), the Aether gateway (raw ``api.port_*``), the SDK (sync, async, both transports)
and the CLI; the edge door's tunnel limits are in test_tunnel_limits.py."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from dsec.aether import connect
from dsec.client import AsyncClient
from dsec.client.sync import Sandbox
from dsec.cluster.local import LocalCluster
from dsec.errors import InvalidArgument
from dsec.wire.ports import MAX_EXPOSED_PORTS, ExposedPort, ExposedPortList
from dsec.wire.spec import NetworkPolicy

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

T = 20.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1, backend="container") as cl:
        yield cl


def httpd(sb: Sandbox, port: int, body: str, *, bind: str = "127.0.0.1") -> None:
    """busybox httpd serving ``body`` as / on ``bind:port`` inside ``sb``."""
    d = f"/tmp/www{port}"
    r = sb.exec(f"mkdir -p {d} && echo {body} > {d}/index.html && "
                f"dd if=/dev/zero of={d}/big bs=1M count=8 2>/dev/null && "
                f"httpd -p {bind}:{port} -h {d}", timeout=10)
    assert r.exit_code == 0, r


def _tamper(token: str) -> str:
    head, mac = token.rsplit(".", 1)
    return f"{head}.{('A' if mac[0] != 'A' else 'B')}{mac[1:]}"


def test_a_server_inside_is_reached_through_its_url_and_only_with_a_token(
        cluster: LocalCluster) -> None:
    with cluster.client(protocol="http") as c:
        sb = c.sandboxes.create()
        other = c.sandboxes.create()
        try:
            httpd(sb, 8000, "hello-from-sandbox")       # bound to the sandbox's loopback
            httpd(other, 8000, "other-sandbox")
            p = sb.ports.expose_info(8000)
            assert p.url.startswith(f"{cluster.url}/v1/proxy/{sb.id}/8000/?dsec_token=")
            base = p.url.split("?")[0]
            assert p.token is not None and p.expires_at is not None
            r = httpx.get(p.url, timeout=T)
            assert (r.status_code, r.text) == (200, "hello-from-sandbox\n")
            # the token as a header, and the cookie the first answer set
            r = httpx.get(base, headers={"x-dsec-token": p.token}, timeout=T)
            assert r.text == "hello-from-sandbox\n"
            cookie = r.headers.get("set-cookie")
            assert cookie is None    # set only when the token came in the query
            with httpx.Client(timeout=T) as h:
                assert h.get(p.url).status_code == 200
                assert h.get(base + "index.html").text == "hello-from-sandbox\n"
            # no token, a forged one, one of another port or sandbox: refused
            r = httpx.get(base, timeout=T)
            assert (r.status_code, r.json()["code"]) == (401, "unauthenticated")
            for bad, where in ((_tamper(p.token), base),
                               (p.token, base.replace("/8000/", "/8001/")),
                               (p.token, base.replace(sb.id, other.id)),
                               ("v1.1.9999999999." + "A" * 43, base), ("garbage", base)):
                r = httpx.get(where, params={"dsec_token": bad}, timeout=T)
                assert (r.status_code, r.json()["code"]) == (401, "unauthenticated"), (bad, r)
                assert "other-sandbox" not in r.text
            # an expired token
            short = sb.ports.expose_info(8000, token_ttl_s=1.0)
            assert short.token != p.token
            time.sleep(1.2)
            r = httpx.get(short.url, timeout=T)
            assert (r.status_code, r.json()["code"]) == (403, "permission_denied")
            assert "expired" in r.json()["message"]
            # a port nothing listens on
            q = sb.ports.expose_info(8999)
            r = httpx.get(q.url, timeout=T)
            assert r.status_code == 503 and "nothing listens on port 8999" in r.json()["message"]
        finally:
            sb.kill()
            other.kill()


# A WebSocket server in busybox sh (no python in the base image): the RFC 6455 handshake
# (sha1sum + base64 of the key), then it keeps the client's first frame and answers one.
WS_SERVER = r'''#!/bin/sh
key=""
while IFS= read -r line; do
  line=$(printf '%s' "$line" | tr -d '\r')
  [ -z "$line" ] && break
  case "$line" in
    [Ss]ec-[Ww]eb[Ss]ocket-[Kk]ey:*) key=$(echo "${line#*:}" | tr -d ' ');;
  esac
done
hex=$(printf '%s' "${key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11" | sha1sum | cut -d' ' -f1)
acc=$(printf "$(echo $hex | sed 's/../\\x&/g')" | base64)
printf 'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n' "$acc"
head -c 11 > /tmp/got
printf '\201\005ws-ok'
sleep 1
'''


def test_a_websocket_session_through_the_url(cluster: LocalCluster) -> None:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect as ws_connect

    with cluster.client(protocol="http") as c:
        sb = c.sandboxes.create()
        try:
            sb.files.write("/tmp/ws.sh", WS_SERVER, mode=0o755)
            assert sb.exec("(nc -l -p 8200 -e /tmp/ws.sh) >/dev/null 2>&1 &",
                           timeout=10).exit_code == 0
            url = sb.ports.expose(8200).replace("http://", "ws://")
            for _ in range(50):
                try:
                    ws = ws_connect(url, open_timeout=T)
                    break
                except (InvalidStatus, OSError, TimeoutError):
                    time.sleep(0.1)      # nc not listening yet
            else:
                raise AssertionError("no WebSocket session")
            with ws:
                ws.send("hello")
                assert ws.recv(timeout=T) == "ws-ok"
            got = sb.files.read("/tmp/got")
            assert got[0] == 0x81 and got[1] == 0x85            # FIN text, masked, 5 bytes
            mask = got[2:6]
            assert bytes(b ^ mask[i % 4] for i, b in enumerate(got[6:11])) == b"hello"
            # no token, no session: the same 401 and JSON error as over HTTP
            with pytest.raises(InvalidStatus) as info:
                ws_connect(url.split("?")[0], open_timeout=T).close()
            resp = info.value.response
            assert resp.status_code == 401 and b'"code":"unauthenticated"' in resp.body
        finally:
            sb.kill()


def test_keys_of_each_role_and_another_tenant(cluster: LocalCluster) -> None:
    reader = cluster.create_key(f"exp-reader-{os.getpid()}", "default", "reader")
    member = cluster.create_key(f"exp-member-{os.getpid()}", "default", "member")
    stranger = cluster.create_key(f"exp-stranger-{os.getpid()}", "exp-other", "admin")
    with cluster.client(protocol="http") as c:
        sb = c.sandboxes.create()
        try:
            httpd(sb, 8000, "keyed")
            sb.ports.expose(8000)
            base = f"{cluster.url}/v1/proxy/{sb.id}/8000/"

            def get(key: str) -> httpx.Response:
                return httpx.get(base, headers={"authorization": f"Bearer {key}"}, timeout=T)

            assert get(member).text == "keyed\n"
            assert get(cluster.api_key).text == "keyed\n"
            r = get(reader)
            assert (r.status_code, r.json()["code"]) == (403, "permission_denied")
            r = get(stranger)
            assert (r.status_code, r.json()["code"]) == (404, "sandbox_not_found")
            # port_expose / port_list hand out tokens: members only, at every door
            for key, want in ((reader, 403), (stranger, 404)):
                r = httpx.post(f"{cluster.url}/v1/sandboxes/{sb.id}/ports", json={"port": 1},
                               headers={"authorization": f"Bearer {key}"}, timeout=T)
                assert r.status_code == want, r.text
                r = httpx.get(f"{cluster.url}/v1/sandboxes/{sb.id}/ports",
                              headers={"authorization": f"Bearer {key}"}, timeout=T)
                assert r.status_code == want, r.text
        finally:
            sb.kill()


def test_the_sandbox_never_sees_the_callers_credentials(cluster: LocalCluster) -> None:
    with cluster.client(protocol="http") as c:
        sb = c.sandboxes.create()
        try:
            # nc answers a fixed response and keeps what arrived
            r = sb.exec("(printf 'HTTP/1.0 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok' | "
                        "nc -l -p 8100 > /tmp/req.txt) >/dev/null 2>&1 &", timeout=10)
            assert r.exit_code == 0, r
            p = sb.ports.expose_info(8100)
            assert p.token is not None
            for _ in range(50):
                resp = httpx.get(p.url, headers={
                    "authorization": f"Bearer {cluster.api_key}", "x-dsec-token": p.token,
                    "cookie": f"dsec_token={p.token}; theme=dark", "x-app": "kept",
                    "referer": f"{p.url}&page=2"},
                    timeout=T)
                if resp.status_code == 200:
                    break
                time.sleep(0.1)   # nc not listening yet
            assert resp.text == "ok"
            got = b""
            for _ in range(50):
                got = sb.files.read("/tmp/req.txt")
                if b"\r\n\r\n" in got:
                    break
                time.sleep(0.1)
            text = got.decode()
            assert text.startswith("GET / HTTP/1.1\r\n"), text
            assert cluster.api_key not in text and p.token not in text
            assert "dsec_token" not in text and "authorization" not in text.lower()
            # every cookie of the apiserver's origin is dsec's (a sandbox cannot set
            # any through the proxy): none is forwarded
            assert "x-app: kept" in text and "cookie" not in text.lower()
            assert f"referer: {p.url.split('?')[0]}?page=2" in text
            assert "x-forwarded-for: 127.0.0.1" in text
            assert f"x-forwarded-prefix: /v1/proxy/{sb.id}/8100" in text
        finally:
            sb.kill()


def test_closing_the_port_or_the_sandbox_ends_every_url(cluster: LocalCluster) -> None:
    with cluster.client(protocol="aether") as c:
        sb = c.sandboxes.create()
        try:
            httpd(sb, 8000, "v1")
            first = sb.ports.expose_info(8000)
            assert sb.ports.expose_info(8000).url.split("?")[0] == first.url.split("?")[0]
            assert [p.port for p in sb.ports.list()] == [8000]
            assert httpx.get(first.url, timeout=T).text == "v1\n"
            sb.ports.close(8000)
            sb.ports.close(8000)                       # idempotent
            assert sb.ports.list() == []
            r = httpx.get(first.url, timeout=T)
            assert (r.status_code, r.json()["code"]) == (404, "not_found")
            again = sb.ports.expose_info(8000)
            assert again.token != first.token
            assert httpx.get(first.url, timeout=T).status_code == 404  # a new generation
            assert httpx.get(again.url, timeout=T).text == "v1\n"
        finally:
            sb.kill()
        r = httpx.get(again.url, timeout=T)      # what every call on it says
        assert (r.status_code, r.json()["code"]) == (409, "invalid_transition"), r.text
        assert "is destroyed" in r.json()["message"]


def test_a_sandbox_without_network_still_serves_its_ports(cluster: LocalCluster) -> None:
    with cluster.client(protocol="http") as c:
        sb = c.sandboxes.create(network=NetworkPolicy(mode="none"))
        try:
            # loopback is down in mode none: exposing brings it up (the sandbox reaches
            # itself, nothing else); the server binds before that
            httpd(sb, 8000, "offline", bind="0.0.0.0")
            url = sb.ports.expose(8000)
            r = httpx.get(url, timeout=T)
            assert r.text == "offline\n", r.text
        finally:
            sb.kill()


def test_at_most_max_exposed_ports_per_sandbox(cluster: LocalCluster) -> None:
    with cluster.client(protocol="http") as c:
        sb = c.sandboxes.create()
        try:
            for port in range(9000, 9000 + MAX_EXPOSED_PORTS):
                sb.ports.expose(port)
            r = httpx.post(f"{cluster.url}/v1/sandboxes/{sb.id}/ports", json={"port": 1},
                           headers={"authorization": f"Bearer {cluster.api_key}"}, timeout=T)
            assert (r.status_code, r.json()["code"]) == (400, "invalid_argument"), r.text
            assert f"the limit is {MAX_EXPOSED_PORTS}" in r.json()["message"]

            async def gateway() -> None:     # the same words at the gateway
                assert cluster.gateway is not None
                conn = await connect(cluster.gateway, token=cluster.api_key)
                try:
                    with pytest.raises(InvalidArgument) as info:
                        await conn.call("api.port_expose", {"id": sb.id, "port": 1})
                    assert info.value.message == r.json()["message"]
                finally:
                    await conn.close()

            asyncio.run(gateway())
            sb.ports.close(9000)
            sb.ports.expose(1)
        finally:
            sb.kill()


def test_every_api_door_and_the_cli(cluster: LocalCluster) -> None:
    with cluster.client(protocol="http") as c:
        sb = c.sandboxes.create()
        try:
            httpd(sb, 8000, "doors")
            h = {"authorization": f"Bearer {cluster.api_key}"}
            # REST
            r = httpx.post(f"{cluster.url}/v1/sandboxes/{sb.id}/ports", json={"port": 8000},
                           headers=h, timeout=T)
            assert r.status_code == 201
            rest = msgspec.json.decode(r.content, type=ExposedPort)
            assert rest.url.startswith(f"/v1/proxy/{sb.id}/8000/")      # relative at the door
            assert httpx.get(cluster.url + rest.url, timeout=T).text == "doors\n"

            # the gateway (raw Aether)
            async def gateway() -> ExposedPortList:
                assert cluster.gateway is not None
                conn = await connect(cluster.gateway, token=cluster.api_key)
                try:
                    await conn.call("api.port_expose", {"id": sb.id, "port": 8000},
                                    response_type=ExposedPort)
                    got: ExposedPortList = await conn.call("api.port_list", {"id": sb.id},
                                                           response_type=ExposedPortList)
                    return got
                finally:
                    await conn.close()

            gw = asyncio.run(gateway())
            assert [p.port for p in gw.items] == [8000]
            assert httpx.get(cluster.url + gw.items[0].url, timeout=T).text == "doors\n"

            # the async SDK over both transports
            async def sdk(transport: str) -> str:
                async with AsyncClient(cluster.url, cluster.api_key, protocol=transport,
                                       session_lease_s=None) as ac:
                    asb = await ac.sandboxes.get(sb.id)
                    url = await asb.ports.expose(8000)
                    assert [p.port for p in await asb.ports.list()] == [8000]
                    return url

            for transport in ("http", "aether"):
                assert httpx.get(asyncio.run(sdk(transport)), timeout=T).text == "doors\n"

            # the CLI
            env = {**os.environ, "DSEC_URL": cluster.url, "DSEC_API_KEY": cluster.api_key}
            cli = [sys.executable, "-c", "from dsec.cli.main import main; main()", "sandbox"]
            out = subprocess.run([*cli, "expose", sb.id, "8000"], env=env, capture_output=True,
                                 text=True, timeout=60, check=True).stdout.strip()
            assert httpx.get(out, timeout=T).text == "doors\n"
            subprocess.run([*cli, "unexpose", sb.id, "8000"], env=env, capture_output=True,
                           timeout=60, check=True)
            assert httpx.get(out, timeout=T).status_code == 404
        finally:
            sb.kill()


def test_a_slow_reader_and_many_connections_do_not_starve_another_sandbox(
        cluster: LocalCluster) -> None:
    with cluster.client(protocol="http") as c:
        hog = c.sandboxes.create()
        calm = c.sandboxes.create()
        try:
            httpd(hog, 8000, "hog")
            httpd(calm, 8000, "calm")
            hog_url, calm_url = hog.ports.expose(8000), calm.ports.expose(8000)
            host, port = cluster.url.removeprefix("http://").split(":")
            path = hog_url.removeprefix(cluster.url).replace("/?", "/big?")
            # 20 clients ask the hog for 8 MiB each and never read the answer
            stalled = []
            for _ in range(20):
                s = socket.create_connection((host, int(port)))
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                stalled.append(s)
            try:
                time.sleep(0.5)
                t0 = time.monotonic()
                with httpx.Client(timeout=T) as h:
                    for _ in range(30):
                        assert h.get(calm_url).text == "calm\n"
                took = time.monotonic() - t0
                assert took < T, took
            finally:
                for s in stalled:
                    s.close()
            # and the hog itself still answers once its readers are gone
            assert httpx.get(hog_url, timeout=T).text == "hog\n"
        finally:
            hog.kill()
            calm.kill()


def test_tunnels_through_one_apiserver_are_capped(cluster: LocalCluster) -> None:
    """RestConfig.max_proxy_tunnels: with one tunnel held open (nc accepts and never
    answers), the next request through a proxy capped at 1 is refused 503 unavailable,
    and served again once the first ends. (The proxy driven as the ASGI app it is, on
    the cluster's loop, with the cluster's own ApiService.)"""
    from dsec.control.proxy import PortProxy

    with cluster.client(protocol="http") as c:
        sb = c.sandboxes.create()
        try:
            httpd(sb, 8000, "capped")
            assert sb.exec("(sleep 1000 | nc -l -p 8300 >/dev/null) >/dev/null 2>&1 &",
                           timeout=10).exit_code == 0
            held_url = sb.ports.expose_info(8300)
            ok_url = sb.ports.expose_info(8000)
            svc = cluster.runtime.service

            def scope(url: str) -> dict[str, object]:
                path, _, query = url.removeprefix(cluster.url).partition("?")
                return {"type": "http", "method": "GET", "path": path,
                        "raw_path": path.encode(), "query_string": query.encode(),
                        "headers": [(b"host", b"x")], "client": ("127.0.0.1", 1),
                        "scheme": "http"}

            async def run() -> list[tuple[int, bytes]]:
                proxy = PortProxy(svc, max_tunnels=1)
                stop = asyncio.Event()
                out: list[tuple[int, bytes]] = []

                async def receive_held() -> dict[str, object]:
                    if not stop.is_set() and not getattr(receive_held, "sent", False):
                        receive_held.sent = True  # type: ignore[attr-defined]
                        return {"type": "http.request", "body": b"", "more_body": False}
                    await stop.wait()
                    return {"type": "http.disconnect"}

                async def receive() -> dict[str, object]:
                    return {"type": "http.request", "body": b"", "more_body": False}

                def sender(into: list[tuple[int, bytes]]):  # type: ignore[no-untyped-def]
                    async def send(msg: dict[str, object]) -> None:
                        if msg["type"] == "http.response.start":
                            into.append((int(msg["status"]), b""))  # type: ignore[call-overload]
                        elif into:
                            into[-1] = (into[-1][0], into[-1][1] + msg.get("body", b""))  # type: ignore[operator]
                    return send

                held: list[tuple[int, bytes]] = []
                for _ in range(50):           # until nc listens (then it holds the tunnel)
                    held.clear()
                    first = asyncio.create_task(proxy(scope(held_url.url), receive_held,
                                                      sender(held)))
                    for _ in range(100):
                        if proxy.open == 1 or first.done():
                            break
                        await asyncio.sleep(0.01)
                    if proxy.open == 1:
                        await asyncio.sleep(0.2)
                        if proxy.open == 1 and not held:
                            break
                    await asyncio.gather(first, return_exceptions=True)
                    receive_held.sent = False  # type: ignore[attr-defined]
                    await asyncio.sleep(0.1)
                assert proxy.open == 1 and not held, held
                await proxy(scope(ok_url.url), receive, sender(out))
                stop.set()
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
                await proxy(scope(ok_url.url), receive, sender(out))
                return out

            out = cluster._on_loop(run(), timeout=60)
            assert out[0][0] == 503 and b'"code":"unavailable"' in out[0][1], out
            assert b"1 proxy tunnels open (the limit is 1, RestConfig.max_proxy_tunnels)" in out[0][1]
            assert out[1] == (200, b"capped\n"), out
        finally:
            sb.kill()
