"""A6 (red21a): a hostile guest agent answers every ``read`` with one byte and
``eof=False``. AgentLink.read (vm/link.py) loops until it has ``max_bytes + 1`` bytes
(64 MiB + 1 for a read_file without a length), one agent call per reply: one tenant
read_file becomes ~67 million round trips on the edge's event loop (hours of edge CPU,
shared by every sandbox of the node), each a frame the edge builds, sends, decodes and
validates. A short read that is not at EOF should end the read (or count against a
small budget of calls), as it does for a regular file on any kernel.

The "guest" is an Aether server on a unix socket, as tests/edge/vm/test_hostile_agent.py.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from dsec.aether.connection import Router
from dsec.aether.transport import serve
from dsec.edge.backends.vm import agentproto as ap
from dsec.edge.backends.vm.link import AgentLink
from dsec.errors import DsecError


async def test_a_one_byte_replies_do_not_multiply_agent_calls(tmp_path: Any) -> None:
    calls = 0

    def read(body: Any) -> ap.ReadResult:
        nonlocal calls
        calls += 1
        return ap.ReadResult(data=b"r", eof=False)

    router = Router()
    router.add("hello", lambda body: ap.Hello(version=ap.PROTOCOL_VERSION, boot_id="b"))
    router.add("read", read)
    path = os.path.join(str(tmp_path), "a")
    server = await serve(router, "unix:" + path)
    link = await AgentLink.open(path, "sb-red21a", timeout=5)
    try:
        task = asyncio.ensure_future(link.read("/f", 0, None, max_bytes=1 << 20))
        done, _ = await asyncio.wait({task}, timeout=3.0)
        if not done:
            task.cancel()
        else:
            try:
                task.result()
            except DsecError:
                pass
        assert calls <= 1000, (
            f"one read of a file (max 1 MiB) made {calls} agent calls in "
            f"{'3 s and was still going' if not done else 'total'}: a guest answering one "
            "byte at a time multiplies a tenant's read into a call per byte")
    finally:
        await link.close()
        await server.close()
