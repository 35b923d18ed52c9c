"""F8 (as a sandbox sees it): issue 17 promises that with the blob store failing, reads of
uncached chunks "fail with EIO inside the sandbox after a bounded retry time". A store
that answers 206 and then trickles its body (a byte every half second: alive for every
per-read timeout) holds the read of a FUSE-backed layer far past ``retry_budget_s``: the
reader waits in the kernel (D state in ps) for as long as the body is long.

Layers, manifest and chunk table are in a file:// store (the node registers them from
it); the daemon's data reads go to a trickling HTTP server on loopback this test starts."""

from __future__ import annotations

import os
import re
import socket
import threading
import time

from dsec.edge.lazy.layers import LazyConfig, LazyLayers
from dsec.image.blob import open_blobstore
from tests.conftest import requires_root
from tests.edge.lazy.conftest import Remote

pytestmark = requires_root


def _serve(sock: socket.socket, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            conn, _ = sock.accept()
        except OSError:
            return

        def one(c: socket.socket) -> None:
            try:
                head = c.recv(65536).decode("latin-1")
                m = re.search(r"[Rr]ange: bytes=(\d+)-(\d+)", head)
                first, last = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
                n = last - first + 1
                c.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %d-%d/*\r\n"
                          b"Content-Length: %d\r\n\r\n" % (first, last, n))
                for _ in range(n):
                    if stop.wait(0.5):
                        break
                    c.sendall(b"\0")
            except OSError:
                pass
            finally:
                c.close()
        threading.Thread(target=one, args=(conn,), daemon=True).start()


def test_a_stalled_store_gives_eio_within_the_retry_budget(remote: Remote,
                                                           tmp_path: object) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    stop = threading.Event()
    threading.Thread(target=_serve, args=(sock, stop), daemon=True).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/blob"
    lazy = LazyLayers(LazyConfig(blob_url=url, cache_dir=os.path.join(str(tmp_path), "c"),
                                 retry_budget_s=1.0),
                      blob=open_blobstore(remote.url))
    out: list[object] = []
    try:
        lazy.register(remote.workspace)
        path = lazy.path(remote.workspace) or ""

        def read() -> None:
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    out.append(os.pread(fd, 4096, 0))
                finally:
                    os.close(fd)
            except OSError as exc:
                out.append(exc)

        t0 = time.monotonic()
        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(10.0)
        assert not t.is_alive(), (
            f"a read of a lazy layer was still waiting after {time.monotonic() - t0:.0f} s "
            "on a trickling blob store (retry budget 1 s)")
        assert isinstance(out[0], OSError), out
    finally:
        stop.set()
        sock.close()
        lazy.close()
