"""The E2B listener's write coalescing (dsec.control.e2b.coalesce): small writes of one
loop step leave as one write, in order; large ones flush and go at once; close flushes,
abort drops, a closing transport gets nothing. Pure asyncio with a recording transport."""

from __future__ import annotations

import asyncio
from typing import Any

from dsec.control.e2b.coalesce import DIRECT, CoalescingTransport


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False
        self.events: list[str] = []

    def write(self, data: Any) -> None:
        assert not self.closing, "written after close"
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.events.append("close")
        self.closing = True

    def abort(self) -> None:
        self.events.append("abort")
        self.closing = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"

    def get_write_buffer_size(self) -> int:
        return 0


def test_small_writes_of_one_step_leave_as_one_in_order() -> None:
    async def main() -> _Transport:
        t = _Transport()
        c = CoalescingTransport(t, asyncio.get_running_loop())
        c.write(b"HTTP/1.1 200 OK\r\n\r\n")
        c.write(b"")
        c.write(b"5\r\nhello\r\n")
        assert t.writes == [] and c.get_write_buffer_size() == 29
        await asyncio.sleep(0)
        c.write(b"0\r\n\r\n")
        await asyncio.sleep(0)
        assert c.get_extra_info("peername") == "info:peername"   # the rest delegates
        return t
    t = asyncio.run(main())
    assert t.writes == [b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n", b"0\r\n\r\n"]


def test_large_writes_flush_first_and_go_at_once() -> None:
    async def main() -> _Transport:
        t = _Transport()
        c = CoalescingTransport(t, asyncio.get_running_loop())
        c.write(b"head")
        big = b"x" * DIRECT
        c.write(big)
        assert t.writes == [b"head", big]             # at once, after what was held
        for _ in range(DIRECT // 1024):               # held bytes reaching DIRECT flush
            c.write(b"y" * 1024)
        assert t.writes[2:] == [b"y" * DIRECT]
        await asyncio.sleep(0)
        return t
    assert len(asyncio.run(main()).writes) == 3


def test_close_flushes_abort_drops_and_a_closing_transport_gets_nothing() -> None:
    async def main() -> tuple[_Transport, _Transport, _Transport]:
        loop = asyncio.get_running_loop()
        a, b, gone = _Transport(), _Transport(), _Transport()
        ca = CoalescingTransport(a, loop)
        ca.write(b"last words")
        ca.close()
        cb = CoalescingTransport(b, loop)
        cb.write(b"dropped")
        cb.abort()
        cg = CoalescingTransport(gone, loop)
        cg.write(b"late")
        gone.closing = True                  # the client went away before the flush
        await asyncio.sleep(0)
        return a, b, gone
    a, b, gone = asyncio.run(main())
    assert a.writes == [b"last words"] and a.events == ["close"]
    assert b.writes == [] and b.events == ["abort"]
    assert gone.writes == []
