"""Edges join a cluster over TCP+TLS with a token (issue 16 "Hosts"), for real: an
apiserver runtime in this process, `dsec edge --join` processes on loopback (and in a
network namespace test host), creates and execs through the REST door, a wrong-CA edge,
a revoked edge, a restarted edge that rejoins without its token."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec.cluster.runtime import ClusterConfig, ClusterRuntime
from dsec.control.api.plane import PlaneConfig
from tests.conftest import requires_root

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


def free_port(host: str = "127.0.0.1") -> int:
    s = socket.socket()
    s.bind((host, 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


async def eventually(check: Callable[[], Any], timeout: float = 30.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.1)


class EdgeProc:
    """One `dsec edge --join` process (optionally inside a network namespace)."""

    def __init__(self, state_dir: Path, listen: str, *, netns: str | None = None) -> None:
        self.state_dir, self.listen, self.netns = state_dir, listen, netns
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = state_dir.parent / f"{state_dir.name}.log"

    def start(self, *args: str, env: dict[str, str] | None = None) -> EdgeProc:
        # nsenter, not `ip netns exec`: that makes a mount namespace too, a copy of
        # every host mount (on a host whose / is private), which pinned other tests'
        # disk pools and loop devices for as long as this edge ran
        pre = ["nsenter", f"--net=/run/netns/{self.netns}", "--"] if self.netns else []
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*pre, *DSEC, "edge", "--listen", self.listen, "--state-dir",
                 str(self.state_dir), "--backend", "simulated", "--log-level", "info",
                 *args], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                env={**os.environ, **(env or {})})
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    async def serving(self) -> None:
        await eventually(lambda: "listening on" in self.output() or self.exited(), 60,
                         "the edge to serve")
        assert "listening on" in self.output(), self.output()

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    async def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop it without blocking the loop the apiserver under test runs on."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                await eventually(self.exited, 30, "the edge to stop")
            except AssertionError:
                self.proc.kill()
                self.proc.wait(10)


@contextlib.asynccontextmanager
async def apiserver(state: Path, listen: str = "127.0.0.1:0",
                    **kw: Any) -> AsyncIterator[ClusterRuntime]:
    cfg = ClusterConfig(state_dir=str(state), listen=listen, gateway=None, edges=0,
                        write_local=False, **kw,
                        plane=PlaneConfig(heartbeat_interval_s=0.3, node_ttl_s=30.0,
                                          poll_timeout_s=2.0, reconnect_interval_s=0.3))
    rt = await ClusterRuntime(cfg).start()
    try:
        yield rt
    finally:
        await rt.stop(keep=True)


def rest(rt: ClusterRuntime) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=rt.url, timeout=30.0,
                             headers={"authorization": f"Bearer {rt.admin_key}"})


def healthy(rt: ClusterRuntime, node: str) -> bool:
    e = rt.plane.edges.get(node) if rt.plane else None
    return e is not None and e.heartbeat is not None and not e.failure


async def create_and_exec(http: httpx.AsyncClient) -> str:
    r = await http.post("/v1/sandboxes", json={"image": "base"})
    assert r.status_code == 201, r.text
    sid = str(r.json()["id"])
    r = await http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["echo", "hi"]})
    assert r.status_code == 200, r.text
    assert r.json()["exit_code"] == 0, r.text
    return sid


async def test_join_create_exec_restart_rejoin_revoke(tmp_path: Path) -> None:
    async with apiserver(tmp_path / "cp") as rt, rest(rt) as http:
        # a token through the superuser REST route; an edge's certificate is no API key
        r = await http.post("/v1/cluster/tokens", json={"ttl_s": 600, "uses": 1})
        assert r.status_code == 201, r.text
        token = r.json()["token"]
        port = free_port()
        edge = EdgeProc(tmp_path / "far", f"tcp:127.0.0.1:{port}")
        other = EdgeProc(tmp_path / "far2", f"tcp:127.0.0.1:{free_port()}")
        try:
            edge.start("--join", rt.url, "--node-id", "far-1", env={"DSEC_JOIN_TOKEN": token})
            await edge.serving()
            await eventually(lambda: healthy(rt, "far-1"), 30, "far-1 healthy")
            e = rt.plane.edges["far-1"]
            assert e.tls is not None     # dialled over mutual TLS
            sid = await create_and_exec(http)
            assert sid.endswith("-far-1")
            # key files never world-readable
            for name in ("node.key", "node.crt", "ca.crt", "join.json"):
                p = tmp_path / "far" / "cluster" / name
                assert (p.stat().st_mode & 0o077) == 0, name
            # single use: a second edge with the same token is refused and creates nothing
            other.start("--join", rt.url, "--node-id", "far-2",
                        env={"DSEC_JOIN_TOKEN": token})
            await eventually(other.exited, 60, "the second edge to give up")
            assert "join token refused" in other.output(), other.output()
            assert not (tmp_path / "far2" / "cluster" / "node.crt").exists()
            assert [n.node_id for n in rt.join_authority.list_nodes()] == ["far-1"]

            # restart without the token, on another port: it rejoins from its persisted
            # certificate, the replicas dial its new address, its sandbox is still there
            await edge.stop()
            edge.listen = f"tcp:127.0.0.1:{free_port()}"
            edge.start()
            await edge.serving()
            await eventually(lambda: rt.plane.edges["far-1"].address == edge.listen, 30,
                             "the new address")
            await eventually(lambda: healthy(rt, "far-1") and not
                             rt.plane.edges["far-1"].link.conn.closed, 30, "far-1 back")
            r = await http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]})
            assert r.status_code == 200, r.text
            assert "rejoined the cluster" in edge.output()

            # revoke: every replica drops it, its sandboxes are reported lost
            r = await http.post("/v1/cluster/nodes/far-1/revoke")
            assert r.status_code == 204, r.text
            await eventually(lambda: rt.plane.edges["far-1"].revoked, 10, "far-1 revoked")
            r = await http.get(f"/v1/sandboxes/{sid}")
            assert r.status_code == 200 and r.json()["state"] == "destroyed", r.text
            assert r.json()["reason"] == "node_revoked"
            r = await http.get(f"/v1/sandboxes/{sid}/events")
            assert "node_revoked" in r.text
            # the edge was asked to destroy them before its link was cut (it answered):
            # asked directly (as the apiserver, without the denylist), it holds none
            from dsec.cluster.membership import EdgeTls
            from dsec.edge.client import EdgeClient
            direct = await EdgeClient.connect(edge.listen, tls=EdgeTls(
                "far-1", rt.join_authority.ca.client_context()))
            try:
                live = [i for i in await direct.list() if i.state != "destroyed"]
                assert live == [], live
                assert (await direct.get(sid)).reason == "node_revoked"
            finally:
                await direct.close()
            # the edge, still serving, is never dialled again: the row is revoked and its
            # certificate is on the denylist
            assert rt.membership.denied
            # and it cannot come back with its old certificate
            await edge.stop()
            edge.start()
            await eventually(edge.exited, 60, "the revoked edge to give up")
            assert "revoked" in edge.output()
            await asyncio.sleep(1.5)          # a membership re-read or two
            assert rt.plane.edges["far-1"].revoked and not healthy(rt, "far-1")
            r = await http.get("/v1/nodes")
            (view,) = [n for n in r.json()["items"] if n["id"] == "far-1"]
            assert view["status"] == "revoked", view
            r = await http.post("/v1/sandboxes", json={"image": "base"})
            assert r.status_code >= 400, r.text     # nothing placed on a revoked node
            # the machine comes back only with a new token: then it joins afresh
            tok2, _ = rt.join_authority.create_token(ttl_s=600, uses=1)
            edge.start("--join", rt.url, env={"DSEC_JOIN_TOKEN": str(tok2)})
            await edge.serving()
            await eventually(lambda: healthy(rt, "far-1"), 30, "far-1 joined again")
            assert not rt.plane.edges["far-1"].revoked
            sid2 = await create_and_exec(http)
            assert sid2.endswith("-far-1")
            r = await http.get(f"/v1/sandboxes/{sid}")      # the old one stays lost
            assert r.json()["reason"] == "node_revoked", r.text
        finally:
            await edge.stop()
            await other.stop()


async def test_wrong_ca_edge_is_refused(tmp_path: Path) -> None:
    """An edge whose certificate comes from another cluster's CA, at an address the
    cluster has recorded for a node: the handshake fails, nothing is placed on it."""
    async with apiserver(tmp_path / "a") as rt_a, apiserver(tmp_path / "b") as rt_b, \
            rest(rt_a) as http_a:
        tok_b, _ = rt_b.join_authority.create_token(ttl_s=600, uses=1)
        port = free_port()
        edge = EdgeProc(tmp_path / "impostor", f"tcp:127.0.0.1:{port}")
        try:
            edge.start("--join", rt_b.url, "--node-id", "imp-1",
                       env={"DSEC_JOIN_TOKEN": str(tok_b)})
            await edge.serving()
            # cluster A is told (by a row, as if joined) that imp-1 lives there
            from dsec.control.store.membership import JoinTokenRow, NodeRow
            store = rt_a.join_authority.store
            store.put_join_token(JoinTokenRow(id="feedfeedfeed", secret_hash=b"x", uses=1,
                                              expires_at=time.time() + 60))
            assert store.join_node("feedfeedfeed", b"x", time.time(), NodeRow(
                node_id="imp-1", address=f"tcp:127.0.0.1:{port}", cert_fingerprint="0",
                token_id="feedfeedfeed", joined_at=time.time())) == ""
            await eventually(lambda: "imp-1" in rt_a.plane.edges, 10, "imp-1 dialled")
            await asyncio.sleep(1.0)
            e = rt_a.plane.edges["imp-1"]
            assert e.heartbeat is None and not healthy(rt_a, "imp-1")
            r = await http_a.get("/v1/nodes")
            (view,) = [n for n in r.json()["items"] if n["id"] == "imp-1"]
            assert "TLS handshake" in view["problem"] or "unreachable" in view["problem"], view
            r = await http_a.post("/v1/sandboxes", json={"image": "base"})
            assert r.status_code >= 400, r.text     # nowhere to place it
        finally:
            await edge.stop()


@pytest.mark.serial  # its flood must outrun a wall-time token bucket (beside 6 workers: only 401s)
async def test_join_routes_refuse_non_superusers_and_garbage(tmp_path: Path) -> None:
    async with apiserver(tmp_path / "cp") as rt, rest(rt) as http:
        anon = httpx.AsyncClient(base_url=rt.url, timeout=10)
        async with anon:
            assert (await anon.get("/v1/cluster/tokens")).status_code == 401
            assert (await anon.post("/v1/cluster/tokens", json={})).status_code == 401
            # a project admin (not a superuser) may not mint join tokens
            r = await http.post("/v1/keys", json={"name": "alice", "project": "default",
                                                   "role": "admin"})
            assert r.status_code in (200, 201), r.text
            alice = r.json()["api_key"]
            r = await anon.post("/v1/cluster/tokens", json={},
                                headers={"authorization": f"Bearer {alice}"})
            assert r.status_code == 403, r.text
            # garbage joins: clear errors, nothing created
            for body in ({"token": "nope", "node_id": "x", "csr": "x",
                          "address": "tcp:127.0.0.1:1"}, {"what": 1},
                         {"token_id": "nope", "ca_sha256": "c", "node_id": "x", "csr": "x",
                          "address": "tcp:127.0.0.1:1", "nonce": "n", "proof": "p"}):
                r = await anon.post("/v1/cluster/join", json=body)
                assert r.status_code in (400, 401), r.text
                assert r.json()["message"]
            r = await anon.post("/v1/cluster/join", content=b"x" * (64 << 10))
            assert r.status_code == 413, r.text
            assert rt.join_authority.list_nodes() == []
            # a guesser is cut off by the unauthenticated-request budget (429)
            # (sent 300 at once: the budget refills at 20/s while they are answered)
            nonce = (await anon.post("/v1/cluster/challenge")).json()["nonce"]
            guess = {"token_id": "a" * 12, "ca_sha256": rt.join_authority.ca.fingerprint,
                     "node_id": "x", "csr": "x", "address": "tcp:127.0.0.1:1",
                     "nonce": nonce, "proof": "b" * 64}
            answers = await asyncio.gather(*(anon.post("/v1/cluster/join", json=guess)
                                             for _ in range(300)))
            codes = {r.status_code for r in answers}
            assert 429 in codes and 401 in codes, codes
            assert rt.join_authority.list_nodes() == []


# ---------------------------------------------------------------------- a test host
def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def netns_host() -> Any:
    """A test host: network namespace ``dsec-t-<r>-h`` with 10.251.N.2/24 on a veth into
    a bridge inside namespace ``dsec-t-<r>-b``; this (root) namespace reaches the bridge
    by a veth of its own with 10.251.N.1/24. All of it is removed on exit."""
    import ipaddress
    import secrets

    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True,
                          check=True).stdout
    for _ in range(50):
        n = 128 + secrets.randbelow(126)
        if f" 10.251.{n}." not in used:
            break
    r = secrets.token_hex(3)
    host, bridge, up = f"dsec-t-{r}-h", f"dsec-t-{r}-b", f"dsj{r}"
    made: list[str] = []
    try:
        for ns in (bridge, host):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        # the host's link
        _ip("-n", bridge, "link", "add", "name", "vh", "type", "veth", "peer", "name",
            "eth0", "netns", host)
        _ip("-n", bridge, "link", "set", "vh", "master", "br0", "up")
        _ip("-n", host, "addr", "add", f"10.251.{n}.2/24", "dev", "eth0")
        _ip("-n", host, "link", "set", "eth0", "up")
        _ip("-n", host, "link", "set", "lo", "up")
        # this namespace's link to the bridge
        made.append(up)
        _ip("link", "add", "name", up, "type", "veth", "peer", "name", "vu", "netns", bridge)
        _ip("-n", bridge, "link", "set", "vu", "master", "br0", "up")
        _ip("addr", "add", f"10.251.{n}.1/24", "dev", up)
        _ip("link", "set", up, "up")
        yield host, str(ipaddress.ip_address(f"10.251.{n}.1")), f"10.251.{n}.2"
    finally:
        if up in made:
            subprocess.run(["ip", "link", "del", up], check=False, capture_output=True,
                           timeout=30)
        for ns in reversed([m for m in made if m.startswith("dsec-t-")]):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True,
                           timeout=30)


@pytest.mark.root
@requires_root
async def test_an_edge_on_a_netns_test_host_joins_and_serves(tmp_path: Path) -> None:
    with netns_host() as (ns, here, there):
        async with apiserver(tmp_path / "cp", listen=f"{here}:0") as rt, rest(rt) as http:
            from dsec.cluster.join import edge_join_args
            port = 7443
            # listening on 0.0.0.0: the apiserver records the address the join came from
            # (the test host's), and dials it over TLS
            argv, env = edge_join_args(rt.join_authority, rt.url, node_id="remote-1",
                                       listen=f"tcp:0.0.0.0:{port}")
            edge = EdgeProc(tmp_path / "remote", f"tcp:0.0.0.0:{port}", netns=ns)
            try:
                edge.start(*argv, env=env)
                await edge.serving()
                await eventually(lambda: healthy(rt, "remote-1"), 30, "remote-1 healthy")
                (row,) = rt.join_authority.list_nodes()
                assert row.address == f"tcp:{there}:{port}"
                sid = await create_and_exec(http)
                assert sid.endswith("-remote-1")
            finally:
                await edge.stop()


async def test_slow_join_requests_are_cut_by_the_http_limits(tmp_path: Path) -> None:
    """Slowloris on the join endpoint: headers that never end, a body that never comes."""
    from dsec.control.api.http_limits import HttpLimits
    limits = HttpLimits(header_timeout_s=0.5, body_idle_timeout_s=0.5)
    async with apiserver(tmp_path / "cp", http_limits=limits) as rt:
        host, port = rt.url.removeprefix("http://").rsplit(":", 1)
        for first in (b"POST /v1/cluster/join HTTP/1.1\r\nHost: x\r\n",
                      (b"POST /v1/cluster/join HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       b"application/json\r\nContent-Length: 1000\r\n\r\n{")):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(first)
            await writer.drain()
            t0 = time.monotonic()
            got = await asyncio.wait_for(reader.read(), 15)   # until the server closes
            assert time.monotonic() - t0 < 10
            assert got == b"" or got.startswith(b"HTTP/1.1 4"), got[:200]
            writer.close()
        assert rt.join_authority.list_nodes() == []


async def test_an_edge_killed_before_the_answer_joins_again_with_the_same_token(
        tmp_path: Path) -> None:
    """The edge kept its key, sent the join, and died before it stored the answer (the
    apiserver recorded the node): started again with the same single-use token, it is
    answered again instead of refused, and serves."""
    from dsec.cluster.ca import NodeCredentials, new_node_key
    from dsec.cluster.join import join_request
    async with apiserver(tmp_path / "cp") as rt, rest(rt) as http:
        tok, _ = rt.join_authority.create_token(ttl_s=600, uses=1)
        port = free_port()
        creds = NodeCredentials(str(tmp_path / "far" / "cluster"))
        key, csr = new_node_key("far-1")
        creds.save_key(key)                            # what the edge does first
        rt.join_authority.join(join_request(             # the join it sent; answer lost
            tok, node_id="far-1", csr=csr.decode(), address=f"tcp:127.0.0.1:{port}",
            nonce=rt.join_authority.challenge().nonce))
        assert rt.join_authority.store.get_join_token(tok.id).used == 1
        edge = EdgeProc(tmp_path / "far", f"tcp:127.0.0.1:{port}")
        try:
            edge.start("--join", rt.url, "--node-id", "far-1",
                       env={"DSEC_JOIN_TOKEN": str(tok)})
            await edge.serving()
            await eventually(lambda: healthy(rt, "far-1"), 30, "far-1 healthy")
            await create_and_exec(http)
            assert rt.join_authority.store.get_join_token(tok.id).used == 1
        finally:
            await edge.stop()
