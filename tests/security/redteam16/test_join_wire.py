"""Red team 16 (join): what a peer on the network path between a joining edge and the
apiserver learns and can replay. The join URL is plain HTTP in every documented example
(docs/cluster.md) and nothing refuses it; the token pins the CA, which protects the edge,
not the token.

Real processes and sockets: an in-process apiserver runtime, a real ``dsec edge --join``
process, and a recording TCP relay on loopback standing for the network path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import httpx

from tests.cluster.test_join import EdgeProc, apiserver, eventually, free_port, healthy, rest


class Tap:
    """A TCP relay that forwards both ways and keeps what the client sent."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.sent = bytearray()
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self) -> Tap:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(*self.target)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       keep: bool) -> None:
            try:
                while data := await src.read(65536):
                    if keep:
                        self.sent += data
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(r, uw, True), pump(ur, w, False))

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def bodies(self, path: str) -> list[bytes]:
        """The JSON bodies of the requests to ``path`` the client sent."""
        out = []
        for chunk in bytes(self.sent).split(b"POST " + path.encode() + b" ")[1:]:
            body = chunk.split(b"\r\n\r\n", 1)[1]
            out.append(body[:body.index(b"}") + 1] if b'"signature"' not in body
                       else body[:body.rindex(b"}") + 1])
        return out


async def test_the_join_token_never_crosses_the_network_in_the_clear(tmp_path: Path) -> None:
    """Safe: whoever watches the path of a join learns nothing that joins another node
    (the edge proves the token with a MAC over its CSR, or refuses a plain-HTTP join URL
    that is not loopback-only); here the token's secret must not appear on the wire."""
    async with apiserver(tmp_path / "cp") as rt, rest(rt) as http:
        host, port = rt.url.removeprefix("http://").rsplit(":", 1)
        tap = await Tap(host, int(port)).start()
        edge = EdgeProc(tmp_path / "e", f"tcp:127.0.0.1:{free_port()}")
        try:
            r = await http.post("/v1/cluster/tokens", json={"ttl_s": 600, "uses": 2})
            token = r.json()["token"]
            edge.start("--join", f"http://127.0.0.1:{tap.port}", "--node-id", "e1",
                       env={"DSEC_JOIN_TOKEN": token})
            await edge.serving()
            secret = token.split(".")[1]
            assert secret.encode() not in tap.sent, (
                "the join token's secret crossed the network in the clear: anyone on the "
                "path can join a node of their own with it (it had uses left)")
        finally:
            await edge.stop()
            await tap.stop()


async def test_a_captured_rejoin_replayed_from_elsewhere_does_not_move_the_node(
        tmp_path: Path) -> None:
    """The edge advertises ``0.0.0.0:PORT`` (docs: the apiserver records the address the
    join came from). Its signed rejoin (node, "tcp:0.0.0.0:PORT", time) says nothing about
    the address, and it can be replayed for 300 s. Safe: a replayed rejoin is refused
    (a nonce / a time strictly newer than the last accepted, per node) and the recorded
    address stays the one the edge announced from."""
    async with apiserver(tmp_path / "cp") as rt, rest(rt) as http:
        host, port = rt.url.removeprefix("http://").rsplit(":", 1)
        tap = await Tap(host, int(port)).start()
        p = free_port()
        edge = EdgeProc(tmp_path / "e", f"tcp:127.0.0.1:{p}")
        try:
            r = await http.post("/v1/cluster/tokens", json={"ttl_s": 600, "uses": 1})
            token = r.json()["token"]
            url = f"http://127.0.0.1:{tap.port}"
            edge.start("--join", url, "--node-id", "e2", "--advertise", f"0.0.0.0:{p}",
                       env={"DSEC_JOIN_TOKEN": token})
            await edge.serving()
            await eventually(lambda: healthy(rt, "e2"), 30, "e2 healthy")
            await edge.stop()
            edge.start("--join", url, "--advertise", f"0.0.0.0:{p}")   # a restart: rejoin
            await edge.serving()
            await eventually(lambda: tap.bodies("/v1/cluster/rejoin"), 10, "the rejoin")
            (captured,) = tap.bodies("/v1/cluster/rejoin")
            assert json.loads(captured)["node_id"] == "e2"
            before = [n.address for n in rt.join_authority.list_nodes()]
            assert before == [f"tcp:127.0.0.1:{p}"], before
            # the eavesdropper replays it from another address (127.0.0.2 is loopback too)
            transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
            async with httpx.AsyncClient(transport=transport, timeout=10) as evil:
                r = await evil.post(f"{rt.url}/v1/cluster/rejoin", content=captured,
                                    headers={"content-type": "application/json"})
            after = [n.address for n in rt.join_authority.list_nodes()]
            assert after == before, (
                f"a replayed rejoin (HTTP {r.status_code}) moved node e2 to {after}: every "
                "replica now dials the eavesdropper's address, the real edge goes silent "
                "and its sandboxes are written off after the TTL")
        finally:
            await edge.stop()
            await tap.stop()


class Cutter(Tap):
    """A relay that forwards the client's requests but drops the first answer to a
    request for ``path`` (the connection is cut instead): a partition or an apiserver
    kill -9 between the commit and the reply."""

    def __init__(self, target_host: str, target_port: int, path: bytes) -> None:
        super().__init__(target_host, target_port)
        self.path = path
        self.cut = 0

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        first = await r.read(65536)
        if self.path in first and self.cut == 0:
            # forward the whole request, wait for the answer to start, then cut
            ur, uw = await asyncio.open_connection(*self.target)
            uw.write(first)
            await uw.drain()
            with contextlib.suppress(asyncio.TimeoutError):
                while b"}" not in first.split(b"\r\n\r\n", 1)[-1][-4:]:
                    more = await asyncio.wait_for(r.read(65536), 2)
                    if not more:
                        break
                    first += more
                    uw.write(more)
                    await uw.drain()
            await ur.read(1)              # the apiserver has answered (committed)
            self.cut += 1
            uw.close()
            w.transport.abort()
            return
        ur, uw = await asyncio.open_connection(*self.target)
        uw.write(first)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(r, uw), pump(ur, w))


async def test_a_join_whose_answer_is_lost_can_be_retried(tmp_path: Path) -> None:
    """The apiserver commits the join (token use + node row), then the answer is lost
    (cut connection: partition, or the apiserver killed -9 right after the commit). The
    edge retries with the same token, CSR and node id. Safe: the retry is answered with
    the certificate of that CSR (a join is idempotent on (token, node, key)), the edge
    joins and serves; nothing needs an operator's revoke."""
    async with apiserver(tmp_path / "cp") as rt, rest(rt) as http:
        host, port = rt.url.removeprefix("http://").rsplit(":", 1)
        cut = await Cutter(host, int(port), b"/v1/cluster/join").start()
        edge = EdgeProc(tmp_path / "e", f"tcp:127.0.0.1:{free_port()}")
        try:
            r = await http.post("/v1/cluster/tokens", json={"ttl_s": 600, "uses": 1})
            edge.start("--join", f"http://127.0.0.1:{cut.port}", "--node-id", "lost1",
                       env={"DSEC_JOIN_TOKEN": r.json()["token"]})
            await eventually(lambda: "listening on" in edge.output() or edge.exited(), 90,
                             "the edge to serve or give up")
            assert cut.cut == 1
            assert "listening on" in edge.output(), (
                "the join's answer was lost once and the edge could not join again: "
                + edge.output()[-600:])
            await eventually(lambda: healthy(rt, "lost1"), 30, "lost1 healthy")
        finally:
            await edge.stop()
            await cut.stop()
