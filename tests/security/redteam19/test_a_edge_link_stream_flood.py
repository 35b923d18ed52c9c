"""Server-push output (``exec_stream``) of a few fast commands makes the edge drop the
apiserver's link, failing every project's calls on that node - even when every reader
reads as fast as it can.

STREAM frames have no per-stream credit; the edge's stream senders wait only for the
link's write buffer to fall below its high-water mark, and the edge serves the apiserver
on a guarded listener connection (``unread_replies`` and friends). Four (here six) members' commands
printing 400 MB each (``head -c 419430400 /dev/zero``, REST ``POST .../exec/stream`` read
at full speed) end with the link closed mid-frame: all four streams end in
``edge_unreachable`` after ~250 MB, the node is reported silent, and another project's
``echo`` exec, sent meanwhile, answers 503. (The ``files`` stream saw the same with one
1 GiB ``cat`` at load 34; the file rows moved to credited duplex streams, exec_stream
and process_connect did not.)

What must hold: the other project's execs all succeed; the floods are cut (if at all)
stream by stream, never by closing the link."""

from __future__ import annotations

import asyncio
import os

import httpx

from dsec import LocalCluster
from dsec.client.sync import Client

FLOODS = 6
CMD = "head -c 419430400 /dev/zero"


def test_stream_floods_do_not_drop_the_link_for_other_projects(tmp_path: object) -> None:
    if os.geteuid() != 0:
        raise AssertionError("needs root (CI runs as root)")
    with LocalCluster(backend="container", state_dir=str(tmp_path)) as cl:
        other_key = cl.create_key("victim", "victimproj", "member")
        with cl.client(session_lease_s=None) as c:
            floods = [c.sandboxes.create() for _ in range(FLOODS)]
        with Client(cl.url, other_key, gateway=cl.gateway, session_lease_s=None) as c2:
            victim = c2.sandboxes.create(project="victimproj")
        url = cl.url

        async def main() -> tuple[list[str], list[int]]:
            async with httpx.AsyncClient(timeout=300) as h:
                mine = {"authorization": f"Bearer {cl.api_key}"}
                theirs = {"authorization": f"Bearer {other_key}"}

                async def flood(sid: str) -> str:
                    last = b""
                    async with h.stream("POST", f"{url}/v1/sandboxes/{sid}/exec/stream",
                                        json={"shell": CMD, "output_cap_bytes": 1 << 30},
                                        headers=mine) as r:
                        async for chunk in r.aiter_bytes():
                            last = (last + chunk)[-400:]
                    return last.decode(errors="replace")

                async def victim_execs() -> list[int]:
                    out = []
                    for _ in range(20):
                        r = await h.post(f"{url}/v1/sandboxes/{victim.id}/exec",
                                         json={"shell": "echo hi"}, headers=theirs)
                        out.append(r.status_code)
                        await asyncio.sleep(0.2)
                    return out

                v = asyncio.ensure_future(victim_execs())
                ends = await asyncio.gather(*[flood(s.id) for s in floods])
                return list(ends), await v

        ends, victim_codes = asyncio.run(main())
        assert all(code == 200 for code in victim_codes), (
            f"another project's execs answered {victim_codes} while {FLOODS} commands "
            f"streamed 400 MB each: the edge dropped the apiserver's link (flood ends: "
            f"{[e[-160:] for e in ends]})")
        assert not any("edge_unreachable" in e for e in ends), ends
