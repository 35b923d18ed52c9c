"""Lazy layers over a real HTTP blob store (Debian's nginx on loopback, behind a fault
proxy): an outage of 5xx answers fails reads of uncached chunks with EIO after the
bounded retry time, cached chunks keep being served, and the same reads succeed with the
exact bytes once the store answers again."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import time

import pytest

from dsec.edge.lazy.layers import LazyConfig, LazyLayers
from dsec.image.blob import layer_key
from dsec.image.chunks import DEFAULT_CHUNK_SIZE as CS
from tests.conftest import requires_root
from tests.edge.lazy.conftest import Remote
from tests.image.blob.conftest import http_dir, nginx_server
from tests.image.blob.servers import Fault, FaultProxy

__all__ = ["http_dir", "nginx_server"]   # fixtures, used by name

pytestmark = requires_root


def test_http_store_outage_is_eio_after_the_budget_then_recovers(
        remote: Remote, http_dir: tuple[str, str], tmp_path: object) -> None:
    served, url = http_dir
    shutil.copytree(remote.blob_dir, served, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(".partial"))
    for d, _, fs in os.walk(served):                 # nginx's worker runs as nobody
        os.chmod(d, 0o755)
        for f in fs:
            os.chmod(os.path.join(d, f), 0o644)
    port = int(url.split(":")[2].split("/")[0])
    proxy = FaultProxy(port)
    cfg = LazyConfig(blob_url=proxy.url + "/" + url.rsplit("/", 1)[1],
                     cache_dir=os.path.join(str(tmp_path), "chunks"), retry_budget_s=1.0)
    with open(os.path.join(remote.blob_dir, layer_key(remote.workspace.digest)), "rb") as f:
        good = f.read()
    buf = mmap.mmap(-1, CS)
    try:
        with LazyLayers(cfg) as lazy:             # chunk 0 into the node's chunk cache
            lazy.register(remote.workspace)
            with open(lazy.path(remote.workspace) or "", "rb") as f:
                assert f.read(CS) == good[:CS]
        # the store answers 503 to every new connection; a new daemon (no connection
        # kept alive) adopts the cache
        proxy.faults.extend(Fault(status=503) for _ in range(500))
        with LazyLayers(cfg) as lazy:
            fd = os.open(lazy.path(remote.workspace) or "", os.O_RDONLY | os.O_DIRECT)
            try:
                t0 = time.monotonic()
                with pytest.raises(OSError) as ei:
                    os.preadv(fd, [buf], 4 * CS)
                took = time.monotonic() - t0
                assert ei.value.errno == errno.EIO
                # the daemon's 1 s budget plus one blob call's own bounded retries
                assert took < 15, took
                assert os.preadv(fd, [buf], 0) == CS and buf[:] == good[:CS]  # cached
                st = lazy.stats(fresh=True)
                assert st["failed_reads"] >= 1 and st["retries"] >= 1
                assert st["bytes_fetched"] == 0              # nothing partial was kept
                proxy.faults.clear()
                assert os.preadv(fd, [buf], 4 * CS) == CS and buf[:] == good[4 * CS:5 * CS]
            finally:
                os.close(fd)
    finally:
        buf.close()
        proxy.close()
