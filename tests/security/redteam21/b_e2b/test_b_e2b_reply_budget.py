"""B2: the per-tenant reply budget (dsec.control.replybudget) is held until a reply is
written only by the doors that wrap their policy call in ``hold_replies`` (REST's
endpoint, the gateway's handler). The E2B layer calls the same policies (``list_dir``,
``exec``, ``read_file``...) through ``service.handler`` without it, so
``keep_or_release`` finds no door and releases the lease as the policy returns: an E2B
``ListDir`` (or a ``files.list`` of any depth) whose client never reads its reply holds
its bytes in the apiserver uncounted, and a tenant can park as many as it opens
connections - the budget's whole point, bypassed by one door.

Repro: an E2B ListDir served through the E2B ASGI app with a ``send`` that records the
tenant's held bytes when the reply's body is handed to the transport (what the REST
door's ``_Released`` keeps charged until the body is sent)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from dsec import LocalCluster
from dsec.bench._e2b_calls import E2BTarget

pytestmark = pytest.mark.root


def test_e2b_list_dir_reply_counts_against_the_tenant_until_written(
        e2b_cluster: LocalCluster, e2b_target: E2BTarget,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox

    rt = e2b_cluster.runtime
    service, app = rt.service, rt.e2b.app
    acquired: list[int] = []
    real_acquire = service.replies.acquire

    async def acquire(tenant: str, n: int) -> Any:
        acquired.append(n)          # the policy does take a lease...
        return await real_acquire(tenant, n)
    monkeypatch.setattr(service.replies, "acquire", acquire)
    sb = Sandbox.create(e2b_target.template, timeout=120, **e2b_target.opts())
    try:
        sb.commands.run("mkdir -p /tmp/many && cd /tmp/many && i=0; "
                        "while [ $i -lt 300 ]; do : > f$i-$(printf %0100d 0); "
                        "i=$((i+1)); done", user="root")
        body = json.dumps({"path": "/tmp/many", "depth": 1}).encode()
        seen: dict[str, Any] = {}

        async def call() -> None:
            sent = False

            async def receive() -> dict[str, Any]:
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await asyncio.sleep(3600)
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    seen["status"] = message["status"]
                elif message["type"] == "http.response.body" and "held" not in seen:
                    seen["held"] = service.replies.budget.held("default")
                    seen["size"] = len(message.get("body", b""))

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                     "method": "POST", "scheme": "http",
                     "path": "/filesystem.Filesystem/ListDir", "raw_path": b"",
                     "query_string": b"", "root_path": "",
                     "headers": [(b"host", b"127.0.0.1"),
                                 (b"content-type", b"application/json"),
                                 (b"e2b-sandbox-id", sb.sandbox_id.encode()),
                                 (b"e2b-sandbox-port", b"49983"),
                                 (b"x-access-token", e2b_target.api_key.encode()),
                                 (b"content-length", str(len(body)).encode())],
                     "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
            await app(scope, receive, send)

        asyncio.run_coroutine_threadsafe(call(), e2b_cluster._loop).result(60)
        assert seen.get("status") == 200 and seen["size"] > 30_000, seen
        assert acquired, "the list_dir policy took no reply-budget lease"
        assert seen["held"] > 0, (
            f"an E2B ListDir reply of {seen['size']} bytes was being written while its "
            "tenant held 0 bytes of the reply budget (the lease was released before the "
            "reply was written: the E2B door keeps no leases)")
    finally:
        sb.kill()
