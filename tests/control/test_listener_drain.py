"""A stopping REST listener resets nothing it has queued (issue 16, rolling upgrade):
before it closes, new connections are refused by silence (their SYN is dropped, so the
client's connect fails once the listener is gone: nothing sent, the SDK repeats it)
and the ones already in the accept queue are accepted and answered."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket

from dsec.control.api.http_limits import (
    accept_queue_length,
    drain_accept_queue,
    refuse_new_connections,
)


def _listener() -> socket.socket:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    return srv


def test_refused_listener_keeps_its_queue_and_answers_no_new_syn() -> None:
    srv = _listener()
    queued = socket.create_connection(srv.getsockname(), timeout=5)
    late = socket.socket()
    try:
        assert accept_queue_length(srv) == 1
        refuse_new_connections(srv)
        late.setblocking(False)
        assert late.connect_ex(srv.getsockname()) == errno.EINPROGRESS
        # the queued connection is still there to accept and serve ...
        conn, _ = srv.accept()
        with conn:
            queued.sendall(b"ping")
            assert conn.recv(4) == b"ping"
        assert accept_queue_length(srv) == 0
        # ... the late one's SYN went unanswered: its connect has not completed
        late.settimeout(0.3)
        with contextlib.suppress(TimeoutError):
            late.recv(1)
        assert late.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        assert accept_queue_length(srv) == 0
        srv.close()
        # once the listener is gone its retransmitted SYN is refused: a failed connect
        late.settimeout(5)
        try:
            late.recv(1)
            raise AssertionError("the late connection was accepted")
        except ConnectionRefusedError:
            pass
        except OSError as exc:
            assert exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET), exc
    finally:
        queued.close()
        late.close()
        srv.close()


def test_drain_waits_for_the_queue_to_be_accepted() -> None:
    async def run() -> None:
        srv = _listener()
        clients = [socket.create_connection(srv.getsockname(), timeout=5) for _ in range(3)]
        try:
            task = asyncio.create_task(drain_accept_queue(srv, poll_s=0.005))
            await asyncio.sleep(0.05)
            assert not task.done() and accept_queue_length(srv) == 3
            for _ in clients:
                srv.accept()[0].close()
            await asyncio.wait_for(task, 5)
        finally:
            for c in clients:
                c.close()
            srv.close()
    asyncio.run(run())
