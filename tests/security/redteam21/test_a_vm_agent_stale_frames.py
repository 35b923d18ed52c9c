"""A10 (red21a): a hostile guest agent floods the host's end of its channel with frames
for stream ids the host never opened (or calls it abandoned): STREAM and RESPONSE frames
with stale ids are dropped one by one by the Aether connection (connection.py
``_on_frame``: "a reply to a call we abandoned; drop it", "late bytes are dropped"),
and the link stays open. Nothing answers them, so no write-side backpressure slows the
guest either: the edge decodes, checks the CRC of and dispatches every frame at whatever
rate the guest sends - the event loop every sandbox of the node shares spends its time
on one guest's garbage, for as long as the guest likes, with no call in flight.

A peer that answers streams nobody asked for has broken the protocol: the host should
close the channel (the link re-dials on the next call, docs/vm.md) or at least bound
what it spends on it. Here the "guest" is a separate process writing such frames to the
socket AgentLink dialled (what QEMU's chardev relays); the host's CPU time is measured
while no call is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from typing import Any

from dsec.edge.backends.vm.link import AgentLink

_GUEST = r"""
import os, socket, sys, msgspec
sys.path[:0] = sys.argv[2].split(os.pathsep)
from dsec.aether.frame import encode_parts
from dsec.edge.backends.vm import agentproto as ap
srv = socket.socket(socket.AF_UNIX); srv.bind(sys.argv[1]); srv.listen(1)
print("ready", flush=True)
c, _ = srv.accept()
buf = b""
while len(buf) < 25:                                  # the host's hello REQUEST
    buf += c.recv(65536)
sid = int.from_bytes(buf[6:14], "big")
body = msgspec.msgpack.encode(ap.Hello(version=ap.PROTOCOL_VERSION, boot_id="b"))
c.sendall(encode_parts(2, sid, body) + body)
junk = b"".join(encode_parts(t, 10**9 + i, b"x") + b"x"
                for i in range(2000) for t in (4, 2))   # STREAM, RESPONSE: stale ids
try:
    while True:
        c.sendall(junk)
except OSError:
    pass
"""


async def test_a_stale_stream_frames_do_not_hold_the_edge(tmp_path: Any) -> None:
    path = os.path.join(str(tmp_path), "a")
    guest = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _GUEST, path, os.pathsep.join(sys.path),
        stdout=asyncio.subprocess.PIPE)
    try:
        assert guest.stdout is not None
        assert (await guest.stdout.readline()).strip() == b"ready"
        link = await AgentLink.open(path, "sb-red21a-flood", timeout=10)
        try:
            t0, c0 = time.monotonic(), time.process_time()
            await asyncio.sleep(2.0)
            busy = (time.process_time() - c0) / (time.monotonic() - t0)
            assert link.closed or busy < 0.3, (
                f"with no call in flight, the edge spent {busy:.0%} of a CPU on a guest's "
                "frames for stream ids it never opened, and kept the channel open")
        finally:
            await link.close()
    finally:
        with contextlib.suppress(ProcessLookupError):   # it exits once it is cut off
            guest.kill()
        await guest.wait()
