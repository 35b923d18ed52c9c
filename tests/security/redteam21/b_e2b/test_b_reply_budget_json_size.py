"""B7: the reply budget charges an exec its output's byte count (``_reply_size``:
len(stdout) + len(stderr) + 4 KiB), but the REST door writes it as JSON text: valid UTF-8
output full of control characters becomes ``\\u00XX`` escapes, 6 bytes per byte (and the
body sits in the apiserver beside the decoded str and the result's bytes until the
client reads it). So every byte the budget counts can hold ~6 in the REST transport's
buffer: a 1 GiB budget is ~6 GiB of unread REST bodies (before B3's overshoot).

Repro: one REST exec printing 1 MiB of 0x01 bytes; the lease it was charged is compared
with the body the REST door wrote. Secure behaviour: the charge covers what is held (the
encoded body's size, or at least within 2x of it)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from dsec import LocalCluster
from dsec.bench._e2b_calls import E2BTarget

pytestmark = pytest.mark.root


def test_rest_exec_reply_is_charged_what_its_body_holds(
        e2b_cluster: LocalCluster, e2b_target: E2BTarget,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox

    service = e2b_cluster.runtime.service
    charged: list[Any] = []
    real_acquire = service.replies.acquire

    async def acquire(tenant: str, n: int) -> Any:
        lease = await real_acquire(tenant, n)
        charged.append(lease)           # lease.bytes: what it ends up charged
        return lease
    monkeypatch.setattr(service.replies, "acquire", acquire)
    sb = Sandbox.create(e2b_target.template, timeout=120, **e2b_target.opts())
    try:
        r = httpx.post(f"{e2b_cluster.url}/v1/sandboxes/{sb.sandbox_id}/exec",
                       headers={"authorization": f"Bearer {e2b_cluster.api_key}"},
                       json={"argv": ["/bin/sh", "-c",
                                      "head -c 1048576 /dev/zero | tr '\\0' '\\1'"],
                             "output_cap_bytes": 2 << 20}, timeout=60)
        assert r.status_code == 200, r.text[:300]
        assert r.json()["encoding"] == "utf-8"
        assert len(charged) == 1
        body, charge = len(r.content), charged[0].bytes
        assert charge * 2 >= body, (
            f"the REST exec reply's body was {body} bytes; the tenant was charged {charge} "
            f"({body / charge:.1f}x less)")
    finally:
        sb.kill()
