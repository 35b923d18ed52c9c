"""One tenant's concurrent ``read_file`` calls reach a node at most READS_PER_TENANT
pieces at a time (redteam-19 A1).

The edge parks finished replies behind the apiserver's link instead of cutting the link
(shared by every tenant), so the apiserver bounds what one tenant can make a node hold:
24 concurrent reads of one project are let through four pieces at a time, while another
project's read is not queued behind them."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from dsec import LocalCluster
from dsec.client.sync import Client
from dsec.control.api.service import READS_PER_TENANT
from dsec.edge.node import EdgeNode


def test_one_tenants_reads_reach_the_node_a_few_at_a_time(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    running: dict[str, int] = {}
    peak: dict[str, int] = {}
    orig = EdgeNode.read_file

    async def counted(self: EdgeNode, sandbox_id: str, path: str, **kw: Any) -> bytes:
        running[sandbox_id] = running.get(sandbox_id, 0) + 1
        peak[sandbox_id] = max(peak.get(sandbox_id, 0), running[sandbox_id])
        try:
            await asyncio.sleep(0.05)       # a slow disk: calls overlap
            return await orig(self, sandbox_id, path, **kw)
        finally:
            running[sandbox_id] -= 1

    monkeypatch.setattr(EdgeNode, "read_file", counted)
    with LocalCluster(backend="simulated", state_dir=str(tmp_path)) as cl:
        other_key = cl.create_key("victim", "victimproj", "member")
        with cl.client(session_lease_s=None) as c:
            sb = c.sandboxes.create()
            sb.files.write("/f", b"x" * (1 << 20))
        with Client(cl.url, other_key, gateway=cl.gateway, session_lease_s=None) as c2:
            victim = c2.sandboxes.create(project="victimproj")
            victim.files.write("/g", b"y" * 10)

        async def main() -> tuple[list[int], int]:
            async with httpx.AsyncClient(timeout=60) as h:
                async def read(sid: str, path: str, key: str) -> int:
                    r = await h.get(f"{cl.url}/v1/sandboxes/{sid}/files",
                                    params={"path": path},
                                    headers={"authorization": f"Bearer {key}"})
                    assert r.status_code == 200, r.text
                    return len(r.content)
                mine = [asyncio.ensure_future(read(sb.id, "/f", cl.api_key))
                        for _ in range(24)]
                await asyncio.sleep(0.02)
                theirs = await read(victim.id, "/g", other_key)
                return list(await asyncio.gather(*mine)), theirs

        mine, theirs = asyncio.run(main())
        assert mine == [1 << 20] * 24 and theirs == 10
        assert peak[sb.id] == READS_PER_TENANT, peak
        assert peak[victim.id] == 1
