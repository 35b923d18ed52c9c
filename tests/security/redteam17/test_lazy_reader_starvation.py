"""F11: one sandbox starves every other sandbox's lazy reads. A request waiting for a
fetch holds its FUSE request slot (the connection's background queue - the kernel's
``max_background``, 12 by default, used by readahead and async direct I/O - and one of
the daemon's 32 worker tasks) for as long as the fetch takes, and fetches share 8 slots
(``max_inflight``) with no per-layer or per-reader fairness. A sandbox issuing 20-40
concurrent reads of uncached chunks while the store is slow or failing (each waits up to
``retry_budget_s``, or - stalled - without bound, F8) fills them: another sandbox's read
of a chunk that is *in the chunk cache* is not answered (with no noisy reader the same
read is answered at once: checked). Issue 17: "the node and other sandboxes keep
working".

Layers come from a file:// store (registered from it); the daemon's data reads go to a
stalling HTTP server on loopback; the toolkit layer's chunks are already in the cache."""

from __future__ import annotations

import mmap
import os
import shutil
import socket
import threading

from dsec.edge.lazy.layers import LazyConfig, LazyLayers
from dsec.image.blob import layer_key, open_blobstore
from tests.conftest import requires_root
from tests.edge.lazy.conftest import Remote

pytestmark = requires_root


def _stall(sock: socket.socket, stop: threading.Event) -> None:
    conns = []
    while not stop.is_set():
        try:
            conn, _ = sock.accept()      # accept, read nothing back: a stalled store
        except OSError:
            break
        conns.append(conn)
    for c in conns:
        c.close()


def _pread(path: str, off: int, out: list[object]) -> None:
    buf = mmap.mmap(-1, 4096)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [buf], off)
            out.append(bytes(buf[:16]))
        finally:
            os.close(fd)
    except OSError as exc:
        out.append(exc)
    finally:
        buf.close()


def test_one_readers_misses_do_not_block_another_layers_cached_reads(
        remote: Remote, tmp_path: object) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    stop = threading.Event()
    threading.Thread(target=_stall, args=(sock, stop), daemon=True).start()
    cache = os.path.join(str(tmp_path), "c")
    lazy = LazyLayers(LazyConfig(blob_url=f"http://127.0.0.1:{sock.getsockname()[1]}/b",
                                 cache_dir=cache, retry_budget_s=30.0),
                      blob=open_blobstore(remote.url))
    threads: list[threading.Thread] = []
    try:
        ws, tk = remote.workspace, remote.toolkit
        lazy.register(ws)
        lazy.register(tk)
        # the toolkit layer is in the chunk cache already (as after an earlier read)
        shutil.copyfile(os.path.join(remote.blob_dir, layer_key(tk.digest)),
                        os.path.join(cache, tk.hex + ".data"))
        ws_path, tk_path = lazy.path(ws) or "", lazy.path(tk) or ""
        noisy: list[object] = []
        for k in range(40):                   # the noisy sandbox: 40 uncached reads
            t = threading.Thread(target=_pread, args=(ws_path, (k * 13 % 500) * 4096, noisy),
                                 daemon=True)
            t.start()
            threads.append(t)
        stop.wait(2.0)                        # let them take the daemon's workers
        got: list[object] = []
        probe = threading.Thread(target=_pread, args=(tk_path, 0, got), daemon=True)
        probe.start()
        probe.join(8.0)
        assert not probe.is_alive() and got and isinstance(got[0], bytes), (
            "a read of a cached chunk of another layer was not answered within 8 s while "
            f"one reader had 40 misses waiting on the store (got {got})")
    finally:
        stop.set()
        sock.close()
        lazy.close()
        for t in threads:
            t.join(5.0)
