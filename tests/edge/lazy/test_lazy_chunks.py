"""The daemon's chunk path read straight through its FUSE file: corrupt chunks are never
served, concurrent readers share one fetch, the LRU budget holds, a restarted daemon
re-verifies what it finds on disk, prefetch and pin fill the cache."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time

import pytest

from dsec.edge.lazy.layers import LazyConfig, LazyLayers
from dsec.image.blob import layer_key
from dsec.image.chunks import DEFAULT_CHUNK_SIZE as CS
from tests.conftest import requires_root
from tests.edge.lazy.conftest import Remote

pytestmark = requires_root


def lazy_for(remote: Remote, tmp: str, **kw: object) -> LazyLayers:
    cfg = {"blob_url": remote.url, "cache_dir": os.path.join(tmp, "chunks"), "retry_budget_s": 0.5}
    cfg.update(kw)
    lazy = LazyLayers(LazyConfig(**cfg))  # type: ignore[arg-type]
    lazy.register(remote.workspace)
    return lazy


def layer_bytes(remote: Remote) -> bytes:
    with open(os.path.join(remote.blob_dir, layer_key(remote.workspace.digest)), "rb") as f:
        return f.read()


def test_a_corrupt_chunk_is_refetched_then_eio_never_served(remote: Remote,
                                                            tmp_path: object) -> None:
    good = layer_bytes(remote)
    path = os.path.join(remote.blob_dir, layer_key(remote.workspace.digest))
    bad = bytearray(good)
    bad[3 * CS + 100] ^= 0xFF                         # one flipped byte in chunk 3
    with open(path, "r+b") as f:
        f.write(bad)
    lazy = lazy_for(remote, str(tmp_path))
    try:
        fd = os.open(lazy.path(remote.workspace) or "", os.O_RDONLY)
        try:
            assert os.pread(fd, CS, 0) == good[:CS]    # other chunks are fine
            with pytest.raises(OSError) as ei:
                os.pread(fd, 4096, 3 * CS)
            assert ei.value.errno == errno.EIO
            st = lazy.stats(fresh=True)
            assert st["verify_failures"] >= 2 and st["failed_reads"] >= 1
            with open(path, "r+b") as f:               # the store is repaired
                f.write(good)
            assert os.pread(fd, CS, 3 * CS) == good[3 * CS:4 * CS]
        finally:
            os.close(fd)
    finally:
        lazy.close()


def test_16_concurrent_readers_fetch_each_chunk_once(remote: Remote, tmp_path: object) -> None:
    good = layer_bytes(remote)
    lazy = lazy_for(remote, str(tmp_path))
    try:
        path = lazy.path(remote.workspace) or ""
        digests: list[str] = []
        start = threading.Barrier(16)

        def reader() -> None:
            start.wait()
            with open(path, "rb", buffering=0) as f:
                digests.append(hashlib.sha256(f.read()).hexdigest())

        ts = [threading.Thread(target=reader) for _ in range(16)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert digests == [hashlib.sha256(good).hexdigest()] * 16
        st = lazy.stats(fresh=True)
        n = -(-len(good) // CS)
        assert st["distinct_chunks_fetched"] == n
        assert st["chunk_fetches"] == n and st["max_fetches_per_chunk"] == 1
    finally:
        lazy.close()


def test_lru_budget_and_restart_reverifies_the_cache(remote: Remote, tmp_path: object) -> None:
    good = layer_bytes(remote)
    n = -(-len(good) // CS)
    lazy = lazy_for(remote, str(tmp_path), cache_bytes=4 * CS)
    try:
        with open(lazy.path(remote.workspace) or "", "rb", buffering=0) as f:
            assert f.read() == good
        st = lazy.stats(fresh=True)
        assert st["cache_bytes"] <= 4 * CS and st["evictions"] >= n - 4
        data = os.path.join(str(tmp_path), "chunks", remote.workspace.hex + ".data")
        assert os.stat(data).st_blocks * 512 <= 4 * CS + 65536   # holes really punched
    finally:
        lazy.close()
    # a cached chunk rotted on disk while no daemon ran: the next daemon re-verifies it
    with open(data, "rb") as f:
        cached = [i for i in range(n) if f.seek(i * CS) >= 0 and f.read(CS).strip(b"\0")]
    with open(data, "r+b") as f:
        f.seek(cached[-1] * CS + 10)
        f.write(b"rot")
    lazy = lazy_for(remote, str(tmp_path))
    try:
        with open(lazy.path(remote.workspace) or "", "rb", buffering=0) as f:
            assert f.read() == good
        st = lazy.stats(fresh=True)
        assert st["chunk_fetches"] < n          # the good cached chunks were kept
    finally:
        lazy.close()


def test_prefetch_and_pin_fill_the_cache(remote: Remote, tmp_path: object) -> None:
    lazy = lazy_for(remote, str(tmp_path), cache_bytes=2 * CS)
    try:
        lazy.prefetch(remote.workspace.digest, [0, 1, 5])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            st = lazy.stats(fresh=True)
            if st.get("prefetched_chunks", 0) >= 2:
                break
            time.sleep(0.1)
        assert st["prefetched_chunks"] >= 2
        lazy.pin(remote.workspace.digest)                # whole layer, over the budget
        n = -(-remote.workspace.size_bytes // CS)
        while time.monotonic() < deadline:
            st = lazy.stats(fresh=True)
            if st["layers"][remote.workspace.hex]["present"] == n:
                break
            time.sleep(0.1)
        assert st["layers"][remote.workspace.hex]["present"] == n
        os.rename(remote.blob_dir, remote.blob_dir + ".away")
        try:   # all of it is served with the store gone
            with open(lazy.path(remote.workspace) or "", "rb", buffering=0) as f:
                assert len(f.read()) == remote.workspace.size_bytes
        finally:
            os.rename(remote.blob_dir + ".away", remote.blob_dir)
    finally:
        lazy.close()


def test_one_daemon_per_chunk_cache(remote: Remote, tmp_path: object) -> None:
    from dsec.errors import InUse

    lazy = lazy_for(remote, str(tmp_path))
    try:
        with pytest.raises(InUse):
            lazy_for(remote, str(tmp_path))
    finally:
        lazy.close()
    lazy_for(remote, str(tmp_path)).close()        # free again once closed
