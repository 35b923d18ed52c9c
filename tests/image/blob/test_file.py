"""The file:// backend: exact ranged reads, safe keys, atomic publication under kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dsec.errors import BlobNotFound, BlobUnavailable, InvalidArgument
from dsec.image.blob import BlobStore, layer_key, open_blobstore
from dsec.image.blob.file import FileBlobStore


def test_round_trip_and_exact_ranges(tmp_path: os.PathLike[str]) -> None:
    store = open_blobstore(f"file://{tmp_path}/bs")
    assert isinstance(store, BlobStore)
    data = os.urandom(300_000)
    key = layer_key("sha256:" + "ab" * 32)
    assert store.head(key) is None
    store.put_bytes(key, data)
    assert store.head(key) == len(data)
    assert store.get_range(key, 0, 10) == data[:10]
    assert store.get_range(key, 262144, 300_000 - 262144) == data[262144:]
    assert store.get_range(key, 5, 0) == b""
    with pytest.raises(InvalidArgument, match="past its end"):
        store.get_range(key, 299_999, 2)
    store.delete(key)
    store.delete(key)                     # already gone: no error
    with pytest.raises(BlobNotFound):
        store.get_range(key, 0, 1)


@pytest.mark.parametrize("key", ["../x", "/etc/passwd", "a//b", "a/./b", ".partial/x",
                                 "a/..", "", "x" * 1025, "a b", "a/\x00"])
def test_unsafe_keys_are_refused(tmp_path: os.PathLike[str], key: str) -> None:
    store = open_blobstore(f"file://{tmp_path}")
    with pytest.raises(InvalidArgument):
        store.put_bytes(key, b"x")
    with pytest.raises(InvalidArgument):
        store.head(key)


def test_bad_urls(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(InvalidArgument, match="unknown scheme"):
        open_blobstore("ftp://x/y")
    with pytest.raises(InvalidArgument, match="file:///abs/dir"):
        open_blobstore("file://relative/dir")


def test_truncated_object_is_never_a_short_read(tmp_path: os.PathLike[str]) -> None:
    store = FileBlobStore(root=str(tmp_path))
    store.put_bytes("k", b"x" * 100)
    # an object shrinking under a reader (pread returns 0): an error, not 60 bytes
    path = os.path.join(str(tmp_path), "k")
    with open(path, "r+b") as f:
        f.truncate(60)
    with pytest.raises(InvalidArgument, match="past its end"):
        store.get_range("k", 50, 50)


_WRITER = """
import sys
from dsec.image.blob import open_blobstore
open_blobstore(sys.argv[1]).put_file("layers/big", sys.argv[2])
"""


def test_kill_9_mid_upload_leaves_no_visible_object(tmp_path: os.PathLike[str]) -> None:
    root = os.path.join(str(tmp_path), "bs")
    fifo = os.path.join(str(tmp_path), "src")
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, f"file://{root}", fifo])
    try:
        with open(fifo, "wb") as w:
            w.write(os.urandom(1 << 20))
            w.flush()
            store = FileBlobStore(root=root)
            deadline = time.monotonic() + 30
            while not os.listdir(os.path.join(root, ".partial")):   # upload under way
                assert time.monotonic() < deadline, "writer never started its upload"
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    except BrokenPipeError:
        pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert store.head("layers/big") is None
    with pytest.raises(BlobNotFound):
        store.get_range("layers/big", 0, 1)
    assert store.sweep_partial(older_than=-1.0) == 1
    assert os.listdir(os.path.join(root, ".partial")) == []


def test_write_error_maps_to_unavailable(tmp_path: os.PathLike[str]) -> None:
    store = FileBlobStore(root=str(tmp_path))
    store.put_bytes("a", b"1")
    with pytest.raises(BlobUnavailable):        # "a" is a file: "a/b" cannot be created
        store.put_bytes("a/b", b"2")
    assert os.listdir(os.path.join(str(tmp_path), ".partial")) == []


def test_objects_are_private_or_shared_with_one_group_only(tmp_path: os.PathLike[str]) -> None:
    """Red team 17 F10: objects 0600 in 0700 dirs whatever the umask; ``?group=`` (the
    group of a server that serves the directory) gives that group read access, never
    other users."""
    import grp

    old = os.umask(0)
    try:
        root = os.path.join(str(tmp_path), "private")
        store = open_blobstore("file://" + root)
        store.put_bytes("layers/sha256/x", b"secret")
        for p, mode in ((root, 0o700), (os.path.join(root, "layers"), 0o700),
                        (os.path.join(root, "layers", "sha256"), 0o700),
                        (os.path.join(root, "layers", "sha256", "x"), 0o600)):
            assert os.stat(p).st_mode & 0o777 == mode, p
        gid = grp.getgrnam("nogroup").gr_gid
        shared = os.path.join(str(tmp_path), "shared")
        store = open_blobstore("file://" + shared + "?group=nogroup")
        store.put_bytes("a/b", b"served")
        for p, mode in ((shared, 0o750), (os.path.join(shared, "a"), 0o750),
                        (os.path.join(shared, "a", "b"), 0o640)):
            st = os.stat(p)
            assert (st.st_mode & 0o777, st.st_gid) == (mode, gid), p
        assert store.get_range("a/b", 0, 6) == b"served"
    finally:
        os.umask(old)
    with pytest.raises(InvalidArgument, match="no such group"):
        open_blobstore("file://" + os.path.join(str(tmp_path), "g") + "?group=no-such-group-dsec")
    with pytest.raises(InvalidArgument, match="no other query"):
        open_blobstore("file://" + os.path.join(str(tmp_path), "g") + "?mode=0777")
