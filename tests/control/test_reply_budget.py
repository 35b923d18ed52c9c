"""A tenant's budget of large unary replies at the apiserver (dsec.control.replybudget).

A client that asks for a big reply (an exec's output) and does not read it keeps the
reply in the apiserver. The budget counts it against the sandbox's tenant until it has
been written out, whichever door it went through (REST, the Aether gateway): the
tenant's next big call waits, then is refused (429); another tenant is not affected;
once the client reads, the bytes are given back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest

from dsec.aether.frame import FrameType, encode_parts
from dsec.aether.messages import method_prefix
from dsec.client.sync import Client
from dsec.cluster.local import LocalCluster
from dsec.control.replybudget import (
    ReplyBudget,
    ReplyGate,
    consumed,
    hold_replies,
    keep_or_release,
    releasing_send,
)
from dsec.errors import InvalidArgument, RateLimited

MiB = 1 << 20
OUT = 12 * MiB          # each held reply: more than the kernel's socket buffers absorb
LIMIT = OUT + 32 * 1024  # an exec reserves its worst case (2 x 12 MiB: more than the
#                          budget, so it goes only while its tenant holds nothing), then
#                          holds 12 MiB unread: the next one of that tenant waits


# ------------------------------------------------------------------ the pure budget
def test_budget_counts_per_tenant_and_lets_one_oversized_call_through_alone() -> None:
    b = ReplyBudget(100)
    assert b.fits("a", 100)
    b.take("a", 60)
    assert not b.fits("a", 41) and b.fits("a", 40) and b.fits("b", 100)
    b.give("a", 60)
    assert b.held("a") == 0 and b.fits("a", 10_000)   # nothing held: it goes alone
    assert b.tenants() == {}
    with pytest.raises(InvalidArgument, match="positive number of bytes"):
        ReplyBudget(0)


async def test_gate_waits_for_a_release_then_refuses_after_wait_s() -> None:
    gate = ReplyGate(100, wait_s=0.2)
    first = await gate.acquire("a", 80)
    waiter = asyncio.create_task(gate.acquire("a", 50))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    first.resize(40)                      # the real reply was smaller: room now
    async with asyncio.timeout(1.0):
        second = await waiter
    assert gate.budget.held("a") == 90
    with pytest.raises(RateLimited, match="tenant 'a' holds 90 bytes") as ei:
        await gate.acquire("a", 20)
    assert ei.value.detail["limit"] == 100 and gate.refused == 1
    first.release()
    first.release()                       # once only
    second.release()
    assert gate.budget.held("a") == 0
    other = await gate.acquire("b", 100)  # tenants do not share
    other.release()


async def test_waiters_go_in_order_and_a_cancelled_one_leaves_the_queue() -> None:
    gate = ReplyGate(100, wait_s=5.0)
    held = await gate.acquire("a", 100)
    order: list[str] = []

    async def want(name: str, n: int) -> None:
        lease = await gate.acquire("a", n)
        order.append(name)
        lease.release()
    big = asyncio.create_task(want("big", 90))
    await asyncio.sleep(0)
    gone = asyncio.create_task(want("gone", 10))
    await asyncio.sleep(0)
    small = asyncio.create_task(want("small", 10))    # fits after big: does not pass it
    await asyncio.sleep(0.01)
    gone.cancel()
    held.release()
    async with asyncio.timeout(2):
        await asyncio.gather(big, small)
    assert gone.cancelled() and order == ["big", "small"]
    assert gate.budget.held("a") == 0 and not gate._queues


async def test_a_call_that_holds_the_rest_of_its_tenants_bytes_goes_on() -> None:
    """A read to the end takes room piece by piece (``own``: what it holds already): with
    nothing else held its next piece goes, even past the budget; with another call's
    bytes held it waits like any other."""
    gate = ReplyGate(100, wait_s=0.1)
    first = await gate.acquire("a", 80)
    second = await gate.acquire("a", 80, own=80)     # the read's second piece
    assert gate.budget.held("a") == 160
    first.release()
    other = await gate.acquire("a", 10)              # another call of the tenant
    with pytest.raises(RateLimited):
        await gate.acquire("a", 80, own=80)          # 90 held, 80 of them its own
    for lease in (second, other):
        lease.release()
    assert gate.budget.held("a") == 0


async def test_a_lease_outside_a_door_is_given_back_at_once_inside_one_kept() -> None:
    gate = ReplyGate(10, wait_s=0)
    keep_or_release(await gate.acquire("a", 5))
    assert gate.budget.held("a") == 0
    with hold_replies() as leases:
        keep_or_release(await gate.acquire("a", 5))
    assert gate.budget.held("a") == 5 and len(leases) == 1
    leases[0].release()
    with pytest.raises(ValueError), hold_replies():   # an error in the door releases
        keep_or_release(await gate.acquire("a", 5))
        raise ValueError("door failed")
    assert gate.budget.held("a") == 0


async def test_releasing_send_charges_the_body_and_releases_once_the_next_message_went(
        ) -> None:
    """The ASGI doors (REST, E2B, the dashboard): a body larger than its leases is
    charged its size (red team 21, B7: JSON writes a control byte as 6), spread over the
    leases; the body's leases are released only once a later message has been sent
    (uvicorn drains before a message, never after the last); a stream gives back what
    it holds one piece behind; calls in ``consumed()`` are released as they return."""
    gate = ReplyGate(None)
    held_at: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        held_at.append(gate.budget.held("a") + gate.budget.held("b"))
    with hold_replies() as leases:
        keep_or_release(await gate.acquire("a", 100))
        keep_or_release(await gate.acquire("b", 300))
        with consumed():
            keep_or_release(await gate.acquire("a", 50))   # a check's: not kept
    assert len(leases) == 2 and gate.budget.held("a") == 100
    out = releasing_send(send, leases)
    await out({"type": "http.response.start", "status": 200, "headers": []})
    await out({"type": "http.response.body", "body": b"x" * 1000})
    # the body as a non-final message, then an empty final one: both went with the
    # leases held, grown to the body's size; then they were given back
    assert held_at == [400, 1000, 1000] and gate.budget.total() == 0
    assert [lease.bytes for lease in leases] == [250, 750]

    held_at.clear()
    with hold_replies() as leases:
        keep_or_release(await gate.acquire("a", 10))
    out = releasing_send(send, leases)
    await out({"type": "http.response.body", "body": b"1", "more_body": True})
    assert gate.budget.held("a") == 10          # the first piece may still be buffered
    await out({"type": "http.response.body", "body": b"2", "more_body": True})
    assert gate.budget.held("a") == 0           # sent after it: the first one drained
    await out({"type": "http.response.body", "body": b""})


# ------------------------------------------------------------------ through the doors
@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1) as cl:
        rt = cl.runtime
        svc = rt.service
        svc.config = dataclasses.replace(svc.config, reply_output_bytes=OUT)
        svc.replies = ReplyGate(LIMIT, wait_s=0.3,
                                on_refused=svc.metrics.reply_budget_refused.inc)
        for node in rt.nodes:       # let an edge return 12 MiB of output in one reply
            node.config = dataclasses.replace(node.config, max_reply_output_bytes=OUT)
        yield cl


@pytest.fixture(scope="module")
def boxes(cluster: LocalCluster) -> dict[str, str]:
    """A sandbox of tenant `default` holding a 4 MiB file, and one of tenant `acme`."""
    out = {}
    with httpx.Client(base_url=cluster.url, timeout=30,
                      headers={"authorization": f"Bearer {cluster.api_key}"}) as http:
        for project in ("default", "acme"):
            r = http.post("/v1/sandboxes", json={"project": project})
            assert r.status_code == 201, r.text
            sid = out[project] = r.json()["id"]
            for path, size in (("/tmp/q", 4 * MiB), ("/tmp/r", OUT)):
                r = http.put(f"/v1/sandboxes/{sid}/files", params={"path": path},
                             content=b"q" * size)
                assert r.status_code in (200, 204), r.text
    return out


def _held(cluster: LocalCluster, tenant: str) -> int:
    return int(cluster.runtime.service.replies.budget.held(tenant))


def _until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _big_exec(sid: str) -> dict[str, Any]:
    return {"argv": ["cat", "/tmp/q", "/tmp/q", "/tmp/q"], "output_cap_bytes": OUT}


def _exec_status(cluster: LocalCluster, sid: str) -> int:
    with httpx.Client(base_url=cluster.url, timeout=30,
                      headers={"authorization": f"Bearer {cluster.api_key}"}) as http:
        r = http.post(f"/v1/sandboxes/{sid}/exec", json=_big_exec(sid))
        if r.status_code == 429:
            assert r.json()["code"] == "rate_limited", r.text
            assert "replies its clients have not read" in r.json()["message"]
        else:
            assert len(r.json()["stdout"]) == OUT
        return r.status_code


def _slow_socket(address: tuple[str, int]) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # it reads nothing for now
    s.connect(address)
    return s


def _drain(s: socket.socket, n: int) -> None:
    got = 0
    s.settimeout(30)
    while got < n:
        data = s.recv(1 << 20)
        assert data, f"closed after {got} bytes"
        got += len(data)


def _check_budget_holds(cluster: LocalCluster, boxes: dict[str, str],
                        s: socket.socket) -> None:
    """While ``s`` (tenant default's unread 12 MiB reply) is not read: default's next
    big exec is refused, acme's runs; once read, default's runs again."""
    _until(lambda: OUT <= _held(cluster, "default") < 2 * OUT,
           "the unread reply is charged its size (no longer its reservation)")
    metrics = cluster.runtime.service.metrics.registry
    refused = metrics.get_sample_value("dsec_reply_budget_refused_total")
    assert metrics.get_sample_value("dsec_reply_budget_bytes") >= OUT
    assert _exec_status(cluster, boxes["default"]) == 429
    assert metrics.get_sample_value("dsec_reply_budget_refused_total") == refused + 1
    assert _exec_status(cluster, boxes["acme"]) == 200
    assert _held(cluster, "acme") == 0
    _drain(s, OUT)
    _until(lambda: _held(cluster, "default") == 0, "a read reply is given back")
    assert _exec_status(cluster, boxes["default"]) == 200


def test_rest_an_unread_exec_reply_counts_against_its_tenant(
        cluster: LocalCluster, boxes: dict[str, str]) -> None:
    host, port = httpx.URL(cluster.url).host, httpx.URL(cluster.url).port
    assert port is not None
    body = json.dumps(_big_exec(boxes["default"])).encode()
    s = _slow_socket((host, port))
    try:
        s.sendall(f"POST /v1/sandboxes/{boxes['default']}/exec HTTP/1.1\r\n"
                  f"Host: {host}\r\nAuthorization: Bearer {cluster.api_key}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                  "\r\n".encode() + body)
        _check_budget_holds(cluster, boxes, s)
    finally:
        s.close()


def test_rest_an_unread_read_file_counts_too(cluster: LocalCluster,
                                            boxes: dict[str, str]) -> None:
    host, port = httpx.URL(cluster.url).host, httpx.URL(cluster.url).port
    assert port is not None
    s = _slow_socket((host, port))
    try:
        s.sendall(f"GET /v1/sandboxes/{boxes['default']}/files?path=/tmp/r HTTP/1.1\r\n"
                  f"Host: {host}\r\nAuthorization: Bearer {cluster.api_key}\r\n"
                  "\r\n".encode())
        _check_budget_holds(cluster, boxes, s)
    finally:
        s.close()


def test_rest_an_unread_exec_many_counts_too(cluster: LocalCluster,
                                            boxes: dict[str, str]) -> None:
    """A batch reserves an estimate per tenant (its worst case would serialise RL
    ticks), then is charged what its results hold, until read."""
    host, port = httpx.URL(cluster.url).host, httpx.URL(cluster.url).port
    assert port is not None
    body = json.dumps({"calls": [{"id": boxes["default"], "req": _big_exec(boxes["default"])}]
                       }).encode()
    s = _slow_socket((host, port))
    try:
        s.sendall(f"POST /v1/batch/exec HTTP/1.1\r\n"
                  f"Host: {host}\r\nAuthorization: Bearer {cluster.api_key}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                  "\r\n".encode() + body)
        _check_budget_holds(cluster, boxes, s)
    finally:
        s.close()


def _frame(sid: int, method: str, body: Any) -> bytes:
    p = method_prefix(method) + msgspec.msgpack.encode(body)
    return encode_parts(int(FrameType.REQUEST), sid, p) + p


def test_gateway_an_unread_exec_reply_counts_against_its_tenant(
        cluster: LocalCluster, boxes: dict[str, str]) -> None:
    assert cluster.gateway is not None
    host, _, port = cluster.gateway.removeprefix("tcp:").rpartition(":")
    s = _slow_socket((host, int(port)))
    try:
        s.sendall(_frame(1, "aether.auth", cluster.api_key.encode())
                  + _frame(3, "api.exec", {"id": boxes["default"],
                                           "req": _big_exec(boxes["default"])}))
        _check_budget_holds(cluster, boxes, s)
        # the same over the gateway with the SDK: refused while held, with its code
        s2 = _slow_socket((host, int(port)))
        try:
            s2.sendall(_frame(1, "aether.auth", cluster.api_key.encode())
                       + _frame(3, "api.exec", {"id": boxes["default"],
                                                "req": _big_exec(boxes["default"])}))
            _until(lambda: _held(cluster, "default") >= OUT, "charged again")
            with Client(cluster.url, cluster.api_key, gateway=cluster.gateway,
                        protocol="aether", session_lease_s=None) as c, \
                    pytest.raises(RateLimited, match="tenant 'default' holds"):
                c.sandboxes.get(boxes["default"]).exec(["cat", "/tmp/q"], output_cap=OUT)
        finally:
            s2.close()      # the connection goes: its reply's bytes are given back
        _until(lambda: _held(cluster, "default") == 0, "a closed connection gives back")
    finally:
        s.close()
