"""A pull killed with -9 in the middle of a blob resumes it: the retry asks for the rest
(``Range: bytes=N-``) and the registry sends each byte of the blob once over both pulls
(issue 15 §1 "resume of interrupted blobs"). Real CLI process, real kill -9, the test
registry counting what it sends."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsec.image import LayerStore
from dsec.image.localregistry import Entry, tar_entries, write_image
from dsec.image.pull import PullOptions, pull_image
from tests.image.registry_server import Registry

pytestmark = [pytest.mark.slow]

REPO = "team/big"
CUT = 1 << 20


def _parts(store: str) -> list[str]:
    return glob.glob(os.path.join(store, "oci-cache", "scopes", "*", "blobs", "sha256",
                                  "*.part"))


def test_a_pull_killed_mid_blob_resumes_where_it_stopped(tmp_path: Path) -> None:
    lay = str(tmp_path / "layout")
    built = write_image(lay, "1", [tar_entries([Entry("big", data=os.urandom(3 << 20))]),
                                   tar_entries([Entry("small", data=b"s")])])["amd64"]
    big = built.layers[0]
    reg = Registry(lay, REPO)
    store = str(tmp_path / "store")
    proc = None
    try:
        size = len(reg.blobs[big])
        reg.cut_at[big] = CUT
        proc = subprocess.Popen(
            [sys.executable, "-c", "from dsec.cli.main import main; main()", "image",
             "--root", store, "pull", "--insecure", "-q", f"{reg.host}/{REPO}:1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120

        def big_part() -> int:
            got = [p for p in _parts(store) if p.endswith(big[7:] + ".part")]
            return os.path.getsize(got[0]) if got else -1
        while big_part() < CUT and time.monotonic() < deadline:
            time.sleep(0.05)
        assert big_part() == CUT, "the cut blob never arrived"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert reg.sent_by[big] == CUT
        reg.cut_at.clear()
        reg.log.clear()

        res = pull_image(LayerStore(store), f"{reg.host}/{REPO}:1",
                         options=PullOptions(insecure=True, ambient_auth=True))
        gets = [(p, h) for m, p, h in reg.log if p.endswith(f"/blobs/{big}")]
        assert [h.get("Range") for _, h in gets] == [f"bytes={CUT}-"]
        # the big blob's bytes crossed the wire once over both pulls
        assert reg.sent_by[big] == size
        assert res.fetched_bytes >= size - CUT
        assert len(res.layers) == 2
        assert _parts(store) == []
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        reg.close()


def _one_blob_image(tmp_path: Path) -> tuple[str, Registry, LayerStore, str]:
    """A one-layer image (200 KB of random bytes) in a test registry, an empty store,
    and the cache's blob path of that layer for a pull of it."""
    from dsec.image.pull import BlobCache, cache_scope
    from dsec.image.registry import parse_registry_ref

    lay = str(tmp_path / "layout")
    built = write_image(lay, "1", [tar_entries([Entry("f", data=os.urandom(200_000))])])
    blob = built["amd64"].layers[0]
    reg = Registry(lay, REPO)
    store = LayerStore(str(tmp_path / "store"))
    r = parse_registry_ref(f"{reg.host}/{REPO}:1")
    return blob, reg, store, BlobCache(store, cache_scope(None, r, None)).path(blob)


def test_a_part_that_is_not_the_blobs_prefix_is_dropped_and_fetched_whole(
        tmp_path: Path) -> None:
    """A part file holding bytes that are not the blob's (a disk error, a registry that
    changed the blob under one digest): the resumed blob fails its digest, the part goes
    (CorruptLayer, nothing stored), and the retry fetches the blob whole."""
    from dsec.errors import CorruptLayer

    blob, reg, store, path = _one_blob_image(tmp_path)
    try:
        part = path + ".part"
        with open(part, "wb") as f:
            f.write(b"garbage that is not the blob's first bytes")
        with pytest.raises(CorruptLayer, match="did not match its digest"):
            pull_image(store, f"{reg.host}/{REPO}:1", options=PullOptions(insecure=True))
        assert not os.path.exists(part) and store.refs() == {}
        res = pull_image(store, f"{reg.host}/{REPO}:1", options=PullOptions(insecure=True))
        assert len(res.layers) == 1 and res.fetched_bytes == len(reg.blobs[blob])
    finally:
        reg.close()


def test_blobs_over_the_quota_room_are_refused_before_any_fetch(tmp_path: Path) -> None:
    """The manifest's blob sizes bound what the fetch may write: an image whose blobs
    exceed the pull's quota room is refused before a single blob byte is asked for."""
    from dsec.errors import QuotaExceeded

    lay = str(tmp_path / "layout")
    built = write_image(lay, "1", [tar_entries([Entry("f", data=os.urandom(100_000))])])
    reg = Registry(lay, REPO)
    store = LayerStore(str(tmp_path / "store"))
    try:
        with pytest.raises(QuotaExceeded, match="nothing was fetched"):
            pull_image(store, f"{reg.host}/{REPO}:1", options=PullOptions(insecure=True),
                       max_bytes=1000)
        layer = built["amd64"].layers[0]
        assert not [p for _, p, _ in reg.log if p.endswith(layer)] and reg.sent < 2000
        assert _parts(store.root) == [] and store.refs() == {}
    finally:
        reg.close()


@pytest.mark.parametrize("damage", ["zeros", "short"])
def test_a_cached_blob_that_lost_its_bytes_is_fetched_again(tmp_path: Path,
                                                           damage: str) -> None:
    """Red team 23b B4: a completed blob was renamed into the cache before its bytes
    were on disk, so a power cut could leave ``<digest>`` of zeros (or short); every
    retry then took it as complete and failed on it until the cache expired. The data
    is fsynced before the rename now, and a cached blob that is not its digest is
    removed and fetched again. Here the cache holds such a blob (as the power cut left
    it); the pull must fetch it once more and succeed."""
    blob, reg, store, path = _one_blob_image(tmp_path)
    try:
        size = len(reg.blobs[blob])
        with open(path, "wb") as f:
            f.write(bytes(size) if damage == "zeros" else reg.blobs[blob][: size // 2])
        res = pull_image(store, f"{reg.host}/{REPO}:1", options=PullOptions(insecure=True))
        assert len(res.layers) == 1 and reg.sent_by[blob] == size
        assert len(store.refs()) == 1
    finally:
        reg.close()


def test_a_fetched_blob_is_on_disk_before_the_cache_calls_it_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The order of the real syscalls: the blob's fsync comes before its rename into
    the cache, and the cache directory is fsynced after it."""
    lay = str(tmp_path / "layout")
    built = write_image(lay, "1", [tar_entries([Entry("f", data=os.urandom(50_000))])])
    blob = built["amd64"].layers[0]
    reg = Registry(lay, REPO)
    store = LayerStore(str(tmp_path / "store"))
    calls: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(a: str, b: str) -> None:
        calls.append(("rename", str(b)))
        real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    try:
        pull_image(store, f"{reg.host}/{REPO}:1", options=PullOptions(insecure=True))
    finally:
        reg.close()
    name = blob[7:]
    part_sync = calls.index(("fsync", next(p for op, p in calls
                                           if op == "fsync" and p.endswith(name + ".part"))))
    done = next(i for i, (op, p) in enumerate(calls) if op == "rename" and p.endswith(name))
    dir_sync = next(i for i, (op, p) in enumerate(calls)
                    if op == "fsync" and p == os.path.dirname(calls[done][1]))
    assert part_sync < done < dir_sync, calls
