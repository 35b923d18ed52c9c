"""The SDK against an in-memory transport (``dsec.client.testing.MockTransport``): every
public call becomes one catalogue row with the request object the SDK built, retried
only when the row says repeating it is safe."""

from __future__ import annotations

from typing import Any

import pytest

from dsec.client.core import AsyncClient
from dsec.client.testing import MockTransport
from dsec.errors import ConnectFailed, ConnectionLost, Overloaded, SandboxNotFound
from dsec.wire import ops
from dsec.wire.api import EventList, FileList
from dsec.wire.calls import CreateSandbox, ExecCall, Mkdir, SandboxRef
from dsec.wire.files import WriteStream
from dsec.wire.ops import Op
from dsec.wire.spec import ExecResult, FileInfo, SandboxInfo, SandboxSpec

SID = "sb-0123456789ab-edge-0"


def _info(spec: SandboxSpec) -> SandboxInfo:
    return SandboxInfo(id=SID, node="edge-0", state="running", spec=spec, created_at=1.0,
                       last_active_at=1.0)


async def test_every_call_is_one_row_with_its_request_object() -> None:
    flaky = {"get": 1, "exec": 1}

    def handler(op: Op[Any, Any], body: Any) -> Any:
        if flaky.get(op.name):
            flaky[op.name] -= 1
            raise ConnectionLost("dropped")
        if op is ops.CREATE:
            assert isinstance(body, CreateSandbox) and body.idempotency_key
            return _info(body.spec)
        if op is ops.GET:
            return _info(SandboxSpec())
        if op is ops.EXEC:
            assert isinstance(body, ExecCall) and body.id == SID
            return ExecResult(exit_code=0, stdout=b"hi\n")
        if op is ops.LIST_DIR:
            return FileList(items=[])
        if op is ops.EVENTS:
            return EventList(items=[])
        if op in (ops.MKDIR, ops.DESTROY):
            return None
        if op is ops.FILE_WRITE_STREAM:
            return FileInfo(name="f", path="/f", type="file", size=1)
        raise SandboxNotFound(f"no {op.name}")

    mock = MockTransport(handler)
    async with AsyncClient(transport=mock, session_lease_s=None) as c:
        sb = await c.sandboxes.create(memory="1GiB", labels={"a": "b"}, user_namespace=True)
        assert sb.info.spec.memory_bytes == 1 << 30 and sb.info.spec.user_namespace
        assert (await c.sandboxes.get(SID)).id == SID         # retried once: idempotent
        with pytest.raises(ConnectionLost):
            await sb.exec("echo hi")                           # not retried: may have run
        assert (await sb.exec("echo hi")).stdout == b"hi\n"
        await sb.files.mkdir("/a/b", parents=False)
        await sb.files.write("/f", b"x")
        assert await sb.files.list("/") == [] and await sb.events() == []
        with pytest.raises(SandboxNotFound, match="no pause"):
            await sb.pause()
        await sb.kill()
    names = [name for name, _ in mock.calls]
    assert names == ["create", "get", "get", "exec", "exec", "mkdir", "file_write_stream",
                     "list_dir", "events", "pause", "destroy"]
    bodies = dict(mock.calls)
    assert bodies["mkdir"] == Mkdir(id=SID, path="/a/b", parents=False)
    assert bodies["file_write_stream"] == WriteStream(id=SID, path="/f", size=1)
    assert mock.uploaded == [b"x"]
    assert bodies["destroy"] == SandboxRef(id=SID)
    assert mock.closed


async def test_an_exec_is_repeated_only_when_it_provably_never_reached_the_server() -> None:
    """An exec is not idempotent: it is sent again after a failed connect (nothing was
    sent), a refusal at a listener's limit (nothing was read) or an Aether GOAWAY (the
    peer says it did not process it), never after a connection dropped with the request
    on it (the server may have run it). Found by the rolling-upgrade test: an exec whose
    new connection found the stopping replica gone was raised to the caller."""
    fails: list[Exception] = [ConnectFailed("refused"), Overloaded("full"),
                              ConnectionLost("goaway", retryable=True),
                              ConnectionLost("dropped mid-request")]

    def handler(op: Op[Any, Any], body: Any) -> Any:
        if op is ops.EXEC:
            if fails:
                raise fails.pop(0)
            return ExecResult(exit_code=0, stdout=b"ok\n")
        return _info(SandboxSpec())

    mock = MockTransport(handler)
    async with AsyncClient(transport=mock, session_lease_s=None, retries=3) as c:
        sb = await c.sandboxes.get(SID)
        with pytest.raises(ConnectionLost, match="dropped mid-request"):
            await sb.exec("echo ok")          # 3 unsent attempts repeated, the 4th raised
        assert (await sb.exec("echo ok")).stdout == b"ok\n"
    assert [name for name, _ in mock.calls] == ["get"] + ["exec"] * 5


def test_the_sync_client_takes_the_same_transport() -> None:
    from dsec.client.sync import Client
    mock = MockTransport(lambda op, body: _info(SandboxSpec()) if op is ops.GET else None)
    with Client(transport=mock, session_lease_s=None) as c:
        assert c.sandboxes.get(SID).id == SID
        assert c.call(ops.GET, SandboxRef(id=SID)).id == SID   # the typed escape hatch


def test_protocol_and_transport_are_two_options() -> None:
    """``protocol=`` says how to reach a server, ``transport=`` injects an object; the
    old spelling (a protocol name given as transport=) is refused, saying what to write,
    and a create sent through either carries the spec whole (backend, project and ttl_s
    left to the server as None)."""
    from dsec.client.sync import Client
    from dsec.errors import InvalidArgument
    for client in (AsyncClient, Client):
        with pytest.raises(InvalidArgument, match="protocol='http'"):
            client("http://127.0.0.1:1", "dsk_x", transport="http")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="protocol='gopher'"):
            client("http://127.0.0.1:1", "dsk_x", protocol="gopher")  # type: ignore[arg-type]
    c = AsyncClient("http://127.0.0.1:1", "dsk_x", protocol="http")
    assert c.protocol == "http" and c.transport_name is None
    sent: list[Any] = []

    def handler(op: Any, body: Any) -> Any:
        sent.append(body)
        return _info(body.spec)
    with Client(transport=MockTransport(handler), session_lease_s=None) as sc:
        spec = SandboxSpec(memory_bytes=300 << 20, user_namespace=True, env={"A": "1"})
        sc.sandboxes.create(spec=spec)
    assert sent[0].spec == spec and sent[0].spec.backend is None
