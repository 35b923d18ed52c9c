"""Hostile extension headers in image archives (the A2 class of red team 21 in
dsec.image.archive): bounded before tarfile reads them, and no pax header that Python
3.11.7's tarfile parses in quadratic time (CVE-2024-6232) gets to it."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
import time
import tracemalloc

import pytest

from dsec.errors import UnsafeArchive
from dsec.image.archive import MAX_PAX_BYTES, check_pax, extract_tar


def _ext(type_: bytes, data: bytes, fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    ti = tarfile.TarInfo("././@PaxHeader" if type_ != tarfile.GNUTYPE_LONGNAME else "x")
    ti.type, ti.size = type_, len(data)
    f = tarfile.TarInfo("f")
    return (ti.tobuf(format=fmt) + data + b"\0" * (-len(data) % 512)
            + f.tobuf(format=fmt) + b"\0" * 1024)


async def test_digit_pax_header_is_refused_without_stalling_the_loop(tmp_path: object) -> None:
    tar = _ext(tarfile.XHDTYPE, b"1" * (48 << 10))
    job = asyncio.ensure_future(asyncio.to_thread(
        lambda: extract_tar(io.BytesIO(tar), str(tmp_path))))
    worst = 0.0
    while not job.done():
        t = time.monotonic()
        await asyncio.sleep(0.01)
        worst = max(worst, time.monotonic() - t)
    with pytest.raises(UnsafeArchive):
        await job
    assert worst < 1.0


@pytest.mark.parametrize("type_,fmt", [(tarfile.GNUTYPE_LONGNAME, tarfile.GNU_FORMAT),
                                       (tarfile.XHDTYPE, tarfile.USTAR_FORMAT),
                                       (tarfile.XGLTYPE, tarfile.USTAR_FORMAT)])
def test_huge_extension_headers_are_refused_before_they_are_read(
        tmp_path: object, type_: bytes, fmt: int) -> None:
    tar = _ext(type_, b"ab/" * (16 << 20), fmt)
    tracemalloc.start()
    try:
        with pytest.raises(UnsafeArchive):
            extract_tar(io.BytesIO(tar), str(tmp_path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


@pytest.mark.parametrize("buf", [b"1" * 65, b"20 path=1 hdrcharset=x\n", b"8 path=a\n",
                                 b"12 path=a\n", b"zz path=a\n"])
def test_check_pax_refuses(buf: bytes) -> None:
    with pytest.raises(UnsafeArchive):
        check_pax(buf)


def test_ordinary_pax_archives_still_extract(tmp_path: object) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo("d" * 150 + "/f")
        ti.size = 3
        ti.pax_headers = {"SCHILY.xattr.user.k": "v" * 1000, "mtime": "1700000000.5"}
        tf.addfile(ti, io.BytesIO(b"abc"))
        ln = tarfile.TarInfo("l" * 120)
        ln.type, ln.linkname = tarfile.SYMTYPE, "t" * 200
        tf.addfile(ln)
    buf.seek(0)
    stats = extract_tar(buf, str(tmp_path))
    assert stats.members == 2
    with open(os.path.join(str(tmp_path), "d" * 150, "f"), "rb") as f:
        assert f.read() == b"abc"
    assert MAX_PAX_BYTES >= 1 << 16
