"""B9: ``after_reply_written`` (what the gateway releases a reply-budget lease on) runs as
soon as a reply has been handed to the transport and writing is not paused - and writing
pauses only above the connection's write high-water mark, 4 MiB (WRITE_HIGH_WATER). So a
reply of up to ~4 MiB to a peer that reads nothing has its lease given back at once while
its bytes sit unread in the apiserver's transport buffer. A tenant opening C connections
(2,048 per peer address, 8,192 per listener by ServerLimits) and asking one ~4 MiB reply
on each holds ~C x 4 MiB (8 GiB per address) with 0 bytes charged to its reply budget.

Repro (the gateway's mechanism, directly on ``dsec.aether``): four peers that read
nothing each get one 3 MiB reply; all four "written" hooks run although not a byte was
read. Secure behaviour: a reply's hook waits until its bytes have left the process (the
transport buffer drained below a small mark, e.g. the low-water mark / 64 KiB), as it
already does for a reply past the high-water mark."""

from __future__ import annotations

import asyncio

import msgspec

from dsec.aether import Router, after_reply_written, serve
from dsec.aether.frame import FrameType
from dsec.aether.messages import encode_request
from tests.aether.conftest import RawPeer


async def test_unread_replies_below_the_high_water_mark_stay_pending(tmp_path: object) -> None:
    log: list[int] = []
    r = Router()

    async def big(n: int) -> bytes:
        after_reply_written(lambda: log.append(n))
        return b"x" * n

    r.add("big", big)
    srv = await serve(r, f"unix:{tmp_path}/s")
    peers: list[RawPeer] = []
    try:
        for _ in range(4):
            reader, writer = await asyncio.open_unix_connection(f"{tmp_path}/s")
            peer = RawPeer(reader, writer)
            peers.append(peer)
            peer.send(int(FrameType.REQUEST), 1,
                      encode_request("big", msgspec.msgpack.encode(3 << 20)))
        await asyncio.sleep(1.0)                   # all answered, nothing read
        assert log == [], (
            f"{len(log)} replies of 3 MiB were counted as written while their peers had "
            f"read nothing ({len(log) * 3} MiB held unbudgeted)")
    finally:
        for p in peers:
            await p.close()
        await srv.close()
