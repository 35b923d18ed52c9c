"""F8: an HTTP blob store read has a per-read timeout (httpx: time between bytes) and a
retry deadline (no new *attempt* after it), but no deadline on one attempt: a store (or a
middlebox) that answers 206 and then trickles a byte every second keeps one
``get_range`` going for as long as the body is long (256 KiB: three days). In the lazy
daemon that pins a fetch slot and every sandbox reading the chunk (FUSE under EROFS: in
D state) far past ``retry_budget_s``, the bound issue 17 promises ("EIO after a bounded
retry time"). A read must end (data or BlobUnavailable) within its budget.

The store is a loopback HTTP server this test starts; the client is dsec's."""

from __future__ import annotations

import socket
import threading
import time

from dsec.errors import DsecError
from dsec.image.blob.http import HttpBlobStore
from dsec.image.blob.retry import RetryPolicy

LENGTH = 4096


def _trickler(sock: socket.socket, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            conn, _ = sock.accept()
        except OSError:
            return

        def serve(c: socket.socket) -> None:
            try:
                c.recv(65536)
                c.sendall(b"HTTP/1.1 206 Partial Content\r\n"
                          b"Content-Range: bytes 0-%d/%d\r\n"
                          b"Content-Length: %d\r\n\r\n" % (LENGTH - 1, LENGTH, LENGTH))
                for _ in range(LENGTH):
                    if stop.wait(0.5):
                        break
                    c.sendall(b"x")
            except OSError:
                pass
            finally:
                c.close()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def test_a_trickling_store_cannot_hold_a_read_past_its_budget() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    stop = threading.Event()
    threading.Thread(target=_trickler, args=(sock, stop), daemon=True).start()
    store = HttpBlobStore(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/b",
                          timeout_s=2.0, connect_timeout_s=2.0,
                          retry=RetryPolicy(deadline_s=2.0))
    out: list[object] = []

    def read() -> None:
        try:
            out.append(store.get_range("layers/sha256/" + "a" * 64, 0, LENGTH))
        except DsecError as exc:  # BlobUnavailable: the bounded answer
            out.append(exc)

    t0 = time.monotonic()
    t = threading.Thread(target=read, daemon=True)
    t.start()
    try:
        t.join(12.0)
        alive = t.is_alive()
        assert not alive, (
            f"a read of {LENGTH} bytes from a store trickling 2 bytes/s was still running "
            f"after {time.monotonic() - t0:.0f} s (timeout 2 s, retry deadline 2 s)")
    finally:
        stop.set()
        sock.close()
        t.join(10.0)
        store.close()
