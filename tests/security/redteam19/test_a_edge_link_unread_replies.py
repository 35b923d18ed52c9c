"""One tenant's ordinary reads make the edge close the apiserver's link, failing every
other tenant's calls on that node.

The edge serves the apiserver on a listener connection, so its ``unread_replies`` guard
(``dsec.aether.connection.UNREAD_REPLIES_MAX``, 64 MiB: meant for hostile peers that
pipeline calls and never read) applies to the control plane's own link. Replies are
written whole as calls finish; nothing holds the edge's handlers back while that link's
write buffer is full. 24 concurrent ``read_file`` calls of one 8 MiB file (a member key,
REST; well inside every documented limit) leave ~190 MB in the edge's write buffer
before the apiserver's loop can read it, and the edge cuts the link: all 24 reads answer
503, the node is marked unreachable, and **every call of every project in flight on
that node fails** (here: another project's ``sleep 1`` exec). The same holds for large
server-push STREAM output (``exec_stream``, ``process_connect``: the ``files`` stream saw
a 1 GiB ``cat`` through exec_stream drop the link at load 34) and for the gateway's
relays, which share the link.

What must hold: the reads succeed (slower), and the other project's exec is not hurt."""

from __future__ import annotations

import asyncio

import httpx

from dsec import LocalCluster

SIZE = 8 << 20
READERS = 24


def test_one_tenants_reads_do_not_cut_the_link_for_everybody(tmp_path: object) -> None:
    with LocalCluster(backend="simulated", state_dir=str(tmp_path)) as cl:
        other_key = cl.create_key("victim", "victimproj", "member")
        with cl.client(session_lease_s=None) as c:
            sb = c.sandboxes.create()
            sb.files.write("/big", b"x" * SIZE)
        from dsec.client.sync import Client
        with Client(cl.url, other_key, gateway=cl.gateway, session_lease_s=None) as c2:
            victim = c2.sandboxes.create(project="victimproj")
        url = cl.url

        async def main() -> tuple[list[object], object]:
            async with httpx.AsyncClient(timeout=120) as h:
                mine = {"authorization": f"Bearer {cl.api_key}"}
                theirs = {"authorization": f"Bearer {other_key}"}

                async def read() -> object:
                    r = await h.get(f"{url}/v1/sandboxes/{sb.id}/files",
                                    params={"path": "/big"}, headers=mine)
                    return r.status_code if r.status_code != 200 else len(r.content)

                async def victim_exec() -> object:
                    r = await h.post(f"{url}/v1/sandboxes/{victim.id}/exec",
                                     json={"shell": "sleep 1; echo done"}, headers=theirs)
                    return r.status_code, r.text[:300]

                v = asyncio.ensure_future(victim_exec())
                await asyncio.sleep(0.3)            # the other project's exec is running
                reads = await asyncio.gather(*[read() for _ in range(READERS)])
                return list(reads), await v

        reads, victim_res = asyncio.run(main())
        assert isinstance(victim_res, tuple) and victim_res[0] == 200, (
            f"another project's exec failed because one tenant read an 8 MiB file "
            f"{READERS} times at once: {victim_res}")
        assert all(r == SIZE for r in reads), (
            f"{READERS} concurrent reads of an {SIZE}-byte file answered {reads}: the edge "
            "cut the apiserver's link (unread_replies)")
