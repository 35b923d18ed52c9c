"""vm/upper.py's own tar reader: what the agent writes round-trips, and every header or
record outside that subset is refused before it is buffered (A2 of red team 21)."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from dsec.edge.backends.vm.upper import MAX_PAX_BYTES, Bounds, extract_upper, parse_pax
from dsec.errors import UnsafeArchive

B = Bounds(data_bytes=1 << 20)


def _tar(fmt: int, *members: tuple[tarfile.TarInfo, bytes]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data))
    buf.seek(0)
    return buf


def _ti(name: str, type_: bytes = tarfile.REGTYPE, size: int = 0, **kw: object
        ) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.size, ti.uid, ti.gid, ti.mode = type_, size, os.getuid(), os.getgid(), 0o644
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def test_long_names_and_targets_come_through_pax_records(tmp_path: object) -> None:
    dest = os.path.join(str(tmp_path), "u")
    os.mkdir(dest)
    long_dir = "d" * 120
    name = f"{long_dir}/{'f' * 200}"
    target = "/" + "t" * 300
    n, data = extract_upper(_tar(tarfile.PAX_FORMAT,
                                 (_ti(long_dir, tarfile.DIRTYPE, mode=0o755), b""),
                                 (_ti(name, size=5), b"hello"),
                                 (_ti("l" * 150, tarfile.SYMTYPE, linkname=target), b"")),
                            dest, B)
    assert (n, data) == (3, 5)
    with open(os.path.join(dest, name), "rb") as f:
        assert f.read() == b"hello"
    assert os.readlink(os.path.join(dest, "l" * 150)) == target


@pytest.mark.parametrize("tar", [
    # GNU long-name headers: not what the agent writes
    lambda: _tar(tarfile.GNU_FORMAT, (_ti("x" * 200, size=1), b"a")),
    # a pax header over the bound: refused from its size field alone
    lambda: io.BytesIO(_ti("././@PaxHeader", tarfile.XHDTYPE, MAX_PAX_BYTES + 1)
                       .tobuf(format=tarfile.USTAR_FORMAT) + b"1" * (MAX_PAX_BYTES + 1)),
    # pax records the format does not use
    lambda: _tar(tarfile.PAX_FORMAT, (_ti("f", size=1, pax_headers={"comment": "x"}), b"a")),
    lambda: _tar(tarfile.PAX_FORMAT, (_ti("f", size=1, pax_headers={"hdrcharset": "BINARY"}),
                                      b"a")),
])
def test_headers_outside_the_agents_format_are_refused(tmp_path: object, tar: object) -> None:
    dest = os.path.join(str(tmp_path), "u")
    os.mkdir(dest)
    with pytest.raises(UnsafeArchive):
        extract_upper(tar(), dest, B)  # type: ignore[operator]


def test_a_bad_checksum_or_a_cut_member_is_refused(tmp_path: object) -> None:
    good = _tar(tarfile.PAX_FORMAT, (_ti("f", size=1000), b"a" * 1000)).getvalue()
    bad = bytearray(good)
    bad[0] ^= 1
    for i, raw in enumerate([bytes(bad), good[:900]]):
        dest = os.path.join(str(tmp_path), f"u{i}")
        os.mkdir(dest)
        with pytest.raises(UnsafeArchive):
            extract_upper(io.BytesIO(raw), dest, B)


@pytest.mark.parametrize("buf", [b"8 path=a\n", b"20 path=a\n", b"5 path=a\n", b"x path=a\n",
                                 b"10 patha\n" + b"\0", b"12345678901 path=a\n",
                                 b"1" * 4096])
def test_malformed_pax_records_are_refused(buf: bytes) -> None:
    with pytest.raises(UnsafeArchive):
        parse_pax(buf)


def test_pax_records_parse() -> None:
    assert parse_pax(b"10 path=a\n16 linkpath=bcd\n" + b"\0" * 20) == {
        "path": "a", "linkpath": "bcd"}
