"""Red team, issue 15 stream ia: a decompression bomb from a registry, on a small
filesystem the test mounts itself (tmpfs, 64 MiB), so a full disk stays contained."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from dsec.errors import DsecError, QuotaExceeded
from dsec.image import LayerStore
from dsec.image.localregistry import LocalRegistry, push, write_image
from dsec.image.pull import PullOptions, pull_image

pytestmark = [pytest.mark.root]

FS_BYTES = 64 << 20
QUOTA = 1 << 20


def _bomb_tar(size: int) -> bytes:
    """A tar holding one ``size``-byte file of a repeating (non-zero, so not sparse)
    32 KiB pattern: deflate compresses it ~1000:1."""
    import io
    import tarfile
    pattern = bytes(range(256)) * 128
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo("bomb.bin")
        ti.size = size

        class R(io.RawIOBase):
            left = size

            def read(self, n: int = -1) -> bytes:
                n = min(self.left, n if n >= 0 else self.left)
                self.left -= n
                return (pattern * (n // len(pattern) + 1))[:n]
        tf.addfile(ti, R())
    return buf.getvalue()


def test_a_gzip_bomb_fills_the_store_disk_whatever_the_quota(tmp_path: Path) -> None:
    """Attack: a project whose layer quota has 1 MiB of room pulls an image whose one
    layer blob is ~200 KiB of gzip that inflates to 256 MiB (non-zero data: really
    written). ``_unpack`` extracts the whole layer into the store's staging dir with the
    DEFAULT limits (16 GiB a member, 64 GiB a layer) before ``add_tree`` looks at
    ``max_bytes`` (the quota room): one small blob writes up to 64 GiB per layer onto the
    disk the store, the state dir and every tenant share.

    Safe: extraction is bounded by what the caller may store (ExtractLimits derived from
    ``max_bytes``/the quota and from the store's free space), so the pull is refused with
    QuotaExceeded after writing about the quota, and the disk never fills.
    Observed: the 64 MiB filesystem is filled to the last block (ENOSPC), and the error
    is reported as a corrupt layer ("not a readable gzip tar: No space left on device")."""
    work = tempfile.mkdtemp(prefix="rt15-reg-")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES},mode=0700", "rt15bomb",
                    str(mnt)], check=True)
    try:
        with LocalRegistry(os.path.join(work, "open")) as reg:
            lay = os.path.join(work, "layout")
            write_image(lay, "bomb", [_bomb_tar(256 << 20)])
            blob = os.path.join(lay, "blobs", "sha256")
            assert max(os.path.getsize(os.path.join(blob, b)) for b in os.listdir(blob)) \
                < 2 << 20
            push(lay, "bomb", f"{reg.host}/t/bomb:1")
            store = LayerStore(str(mnt / "store"))
            peak = [0]
            stop = threading.Event()

            def watch() -> None:
                while not stop.wait(0.01):
                    st = os.statvfs(mnt)
                    peak[0] = max(peak[0], (st.f_blocks - st.f_bfree) * st.f_frsize)
            t = threading.Thread(target=watch, daemon=True)
            t.start()
            err: DsecError | None = None
            try:
                pull_image(store, f"{reg.host}/t/bomb:1", namespace="teama",
                           options=PullOptions(insecure=True), max_bytes=QUOTA)
            except DsecError as exc:
                err = exc
            finally:
                stop.set()
                t.join()
            assert err is not None
            assert peak[0] < FS_BYTES // 2, (
                f"a pull with {QUOTA} bytes of quota room wrote {peak[0] >> 20} MiB of the "
                f"{FS_BYTES >> 20} MiB filesystem ({type(err).__name__}: {err})")
            assert isinstance(err, QuotaExceeded), f"{type(err).__name__}: {err}"
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        shutil.rmtree(work, ignore_errors=True)
