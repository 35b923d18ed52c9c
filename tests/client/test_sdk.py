"""The SDK (sync and async, REST and Aether gateway) against a real LocalCluster."""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator

import httpx
import pytest

from dsec import (
    AsyncClient,
    Client,
    ConnectFailed,
    ConnectionLost,
    ExecResult,
    InvalidArgument,
    LocalCluster,
    RequestTimeout,
    SandboxNotFound,
    TransportError,
)
from dsec.client.core import parse_memory


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=2) as cl:
        yield cl


@pytest.fixture(params=["http", "aether"])
def client(request: pytest.FixtureRequest, cluster: LocalCluster) -> Iterator[Client]:
    with cluster.client(protocol=request.param) as c:
        c.info()
        # the transport asked for, not a silent fallback to the other one
        assert c.transport_name == request.param
        yield c


def test_sandbox_roundtrip(client: Client) -> None:
    with client.sandboxes.create(image="base", cpu=0.5, memory="256MiB", ttl=600,
                                 labels={"sdk": "yes"}) as sb:
        assert sb.info.spec.cpu_milli == 500 and sb.info.spec.memory_bytes == 256 << 20
        assert sb.info.spec.ttl_s == 600
        r = sb.exec("echo hello")
        assert isinstance(r, ExecResult) and r.stdout == b"hello\n" and r.exit_code == 0
        assert sb.exec(["echo", "a  b"]).stdout == b"a  b\n"
        assert sb.exec("cat", stdin="in").stdout == b"in"
        assert sb.exec("exit 7").exit_code == 7
        sb.files.write("/tmp/x.txt", "text")
        sb.files.write("/tmp/x.bin", b"\x00\xff")
        assert sb.files.read("/tmp/x.txt") == b"text"
        assert sb.files.read("/tmp/x.bin") == b"\x00\xff"
        assert {f.name for f in sb.files.list("/tmp")} >= {"x.txt", "x.bin"}
        assert sb.files.stat("/tmp/x.txt").size == 4
        sb.files.remove("/tmp/x.txt")
        assert not sb.files.exists("/tmp/x.txt")
        chunks = list(sb.exec_stream("echo streamed"))
        assert isinstance(chunks[-1], ExecResult) and chunks[-1].exit_code == 0
        assert b"".join(c.data for c in chunks[:-1]) == b"streamed\n"
        sb.pause()
        assert client.sandboxes.get(sb.id).state == "paused"
        sb.resume()
        assert sb.state == "running"
        assert [e.to_state for e in sb.events()][:2] == ["creating", "running"]
        sid = sb.id
    assert client.sandboxes.get(sid).state == "destroyed"  # the with block killed it
    client.sandboxes.get(sid).kill()  # killing twice is fine


def test_command_timeout_is_a_result_not_an_error(client: Client) -> None:
    with client.sandboxes.create() as sb:
        r = sb.exec("sleep 5", timeout=0.2)
        assert r.timed_out and r.exit_code != 0


def test_batch_create_and_exec(client: Client) -> None:
    tag = uuid.uuid4().hex
    sbs = client.sandboxes.create_many(12, labels={"batch": tag})
    assert len({s.id for s in sbs}) == 12
    assert {s.info.node for s in sbs} <= {"edge-0", "edge-1"}
    res = client.sandboxes.exec_many([(s, f"echo {i}") for i, s in enumerate(sbs)])
    assert [r.stdout for r in res] == [f"{i}\n".encode() for i in range(12)]  # type: ignore[union-attr]
    bad = client.sandboxes.exec_many([(sbs[0], "true"), ("sb-000000000000-edge-0", "true")],
                                     return_exceptions=True)
    assert isinstance(bad[0], ExecResult) and isinstance(bad[1], SandboxNotFound)
    listed = client.sandboxes.list(labels={"batch": tag})
    assert sorted(s.id for s in listed) == sorted(s.id for s in sbs)
    for s in sbs:
        s.kill()


def test_errors_are_the_dsec_tree(client: Client) -> None:
    with pytest.raises(SandboxNotFound):
        client.sandboxes.get("sb-000000000000-edge-1")
    with pytest.raises(InvalidArgument):
        client.sandboxes.create(memory="lots")
    with pytest.raises(InvalidArgument, match="memory_bytes"):
        client.sandboxes.create(memory=1)
    assert [n.id for n in client.nodes()] == ["edge-0", "edge-1"]


def test_parse_memory() -> None:
    assert parse_memory("1GiB") == 1 << 30
    assert parse_memory("512MiB") == 512 << 20
    assert parse_memory("2G") == 2 * 10**9
    assert parse_memory(4096) == 4096
    with pytest.raises(InvalidArgument):
        parse_memory("12 parsecs")


async def test_async_client_mirrors_sync(cluster: LocalCluster) -> None:
    async with cluster.async_client(protocol="aether") as c:
        async with await c.sandboxes.create(labels={"a": "1"}) as sb:
            assert (await sb.exec(["echo", "async"])).stdout == b"async\n"
            await sb.files.write("/tmp/a", b"1")
            assert await sb.files.read("/tmp/a") == b"1"
            items = [x async for x in sb.exec_stream("echo s")]
            assert isinstance(items[-1], ExecResult)
        sync_names = {n for n in dir(Client) if not n.startswith("_")}
        async_names = {n for n in dir(AsyncClient) if not n.startswith("_")}
        assert sync_names == async_names


def test_session_bound_sandboxes_die_with_their_client(cluster: LocalCluster) -> None:
    """Opt-in (issue 19): Client(session=True), or session=True on one create."""
    import asyncio
    with cluster.client(session=True, session_lease_s=30) as c:
        bound = c.sandboxes.create()
        detached = c.sandboxes.create(detached=True)
        with pytest.raises(InvalidArgument, match="contradict"):
            c.sandboxes.create(detached=True, session=True)
    with cluster.client() as c:
        asked = c.sandboxes.create(session=True)
        lives = c.sandboxes.create()
    assert bound.info.spec.labels["dsec.io/session"].startswith("ses-")
    assert asked.info.spec.labels["dsec.io/session"].startswith("ses-")
    assert "dsec.io/session" not in detached.info.spec.labels
    assert "dsec.io/session" not in lives.info.spec.labels
    assert cluster._loop is not None
    asyncio.run_coroutine_threadsafe(cluster.runtime.plane.sweep(), cluster._loop).result(10)
    with cluster.client(session_lease_s=None) as c:
        assert c.sandboxes.get(bound.id).state == "destroyed"
        assert c.sandboxes.get(asked.id).state == "destroyed"
        assert c.sandboxes.get(detached.id).state == "running"
        assert c.sandboxes.get(lives.id).state == "running"
        c.sandboxes.get(detached.id).kill()
        c.sandboxes.get(lives.id).kill()


def test_sandboxes_outlive_the_client_process_by_default(cluster: LocalCluster) -> None:
    """E2B/Modal semantics (issue 19): a sandbox made by a client process that exited
    lives on until its timeout; before, it was swept seconds after the client exited.
    The client here is a real process that creates, prints the id and exits."""
    import subprocess
    import sys
    code = ("from dsec import Client\n"
            f"c = Client({cluster.url!r}, {cluster.api_key!r}, gateway={cluster.gateway!r})\n"
            "sb = c.sandboxes.create(ttl=600)\nprint(sb.id)\nc.close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    sid = out[-1]
    import asyncio
    assert cluster._loop is not None
    swept = asyncio.run_coroutine_threadsafe(cluster.runtime.plane.sweep(),
                                             cluster._loop).result(10)
    assert all(s != sid for s, _ in swept)
    with cluster.client() as c:
        sb = c.sandboxes.get(sid)
        assert sb.state == "running" and sb.info.expires_at is not None
        assert sb.exec("echo alive").stdout == b"alive\n"
        sb.kill()


def test_create_retries_reuse_one_idempotency_key(cluster: LocalCluster) -> None:
    keys: list[str] = []
    real = httpx.AsyncHTTPTransport()

    class Flaky(httpx.AsyncBaseTransport):
        """Deliver the first create, then fail its reply as a dropped connection."""

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            resp = await real.handle_async_request(request)
            if request.method == "POST" and request.url.path == "/v1/sandboxes":
                keys.append(request.headers["idempotency-key"])
                if len(keys) == 1:
                    await resp.aread()
                    raise httpx.ReadError("connection reset", request=request)
            return resp

    with cluster.client(protocol="http", session_lease_s=None,
                        _http_transport=Flaky()) as c:
        before = len(c.sandboxes.list(labels={"flaky": "1"}))
        sb = c.sandboxes.create(labels={"flaky": "1"})
        assert len(keys) == 2 and keys[0] == keys[1]
        assert len(c.sandboxes.list(labels={"flaky": "1"})) == before + 1
        sb.kill()


def test_request_timeout_and_connection_errors_are_named() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        port = silent.getsockname()[1]
        with (Client(f"http://127.0.0.1:{port}", "dsk_x", protocol="http", timeout=0.3,
                     retries=0, session_lease_s=None) as c,
              pytest.raises(RequestTimeout, match="request timeout of 0.3s")):
            c.sandboxes.get("sb-000000000000-edge-0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    with Client(f"http://127.0.0.1:{dead}", "dsk_x", protocol="http", retries=1,
                session_lease_s=None) as c:
        with pytest.raises(TransportError) as ei:
            c.sandboxes.get("sb-000000000000-edge-0")
        # nothing listens: the request never left, and the error says so
        assert isinstance(ei.value, ConnectFailed) and not isinstance(ei.value, ConnectionLost)
        assert "apiserver running" in str(ei.value) and "nothing was sent" in str(ei.value)


def test_client_finds_dsec_up_through_local_json(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("DSEC_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("DSEC_URL", raising=False)
    monkeypatch.delenv("DSEC_API_KEY", raising=False)
    with pytest.raises(TransportError, match="dsec up"):
        Client()
    with LocalCluster(subprocess=True, state_dir=str(tmp_path / "up")) as cl:
        monkeypatch.setenv("DSEC_STATE_DIR", str(tmp_path / "up"))
        with Client(session_lease_s=None) as c:
            assert c.url == cl.url
            with c.sandboxes.create() as sb:
                assert sb.exec("echo via-up").stdout == b"via-up\n"
        assert threading.active_count() >= 1
    assert not (tmp_path / "up" / "local.json").exists()


async def test_a_forgotten_session_is_replaced_not_reused(cluster: LocalCluster) -> None:
    """If the server forgets the client's session (closed elsewhere, or lapsed for long),
    the SDK stops renewing it and the next create opens a new one."""
    import asyncio

    import httpx

    async with AsyncClient(cluster.url, cluster.api_key, gateway=cluster.gateway,
                           session_lease_s=5, session=True) as c:
        first = await c.sandboxes.create()
        old = first.info.spec.labels["dsec.io/session"]
        async with httpx.AsyncClient() as http:
            r = await http.delete(f"{cluster.url}/v1/sessions/{old}",
                                  headers={"authorization": f"Bearer {cluster.api_key}"})
        assert r.status_code == 204
        for _ in range(60):  # the renewer runs every lease/3 (1.7 s)
            if c._session is None:
                break
            await asyncio.sleep(0.1)
        assert c._session is None
        second = await c.sandboxes.create()
        new = second.info.spec.labels["dsec.io/session"]
        assert new != old
        await second.kill()
