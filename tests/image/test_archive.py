"""Safe tar extraction: hostile members raise UnsafeArchive and leave nothing behind."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from dsec.errors import UnsafeArchive
from dsec.image import ExtractLimits, LayerStore, extract_tar
from tests.conftest import requires_root

pytestmark = requires_root


def make_tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti, data in members:
            if data is not None:
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            else:
                tf.addfile(ti)
    return buf.getvalue()


def ti(name: str, kind: bytes = tarfile.REGTYPE, *, mode: int = 0o644, link: str = "",
       uid: int = 0) -> tarfile.TarInfo:
    t = tarfile.TarInfo(name)
    t.type = kind
    t.mode = mode
    t.linkname = link
    t.uid = t.gid = uid
    t.mtime = 1_700_000_000
    return t


def test_extracts_files_dirs_links_and_metadata(tmp_path: object) -> None:
    x = ti("dir/file", mode=0o4755, uid=1234)
    x.pax_headers = {"SCHILY.xattr.user.k": "v", "SCHILY.xattr.trusted.overlay.opaque": "y"}
    data = make_tar([
        (ti("./dir", tarfile.DIRTYPE, mode=0o750), None),
        (x, b"hello"),
        (ti("dir/sym", tarfile.SYMTYPE, link="file"), None),
        (ti("abs", tarfile.SYMTYPE, link="/bin/busybox"), None),
        (ti("dir/hard", tarfile.LNKTYPE, link="dir/file"), None),
        (ti("implicit/parent/f"), b"x"),
    ])
    dest = str(tmp_path)
    stats = extract_tar(io.BytesIO(data), dest)
    assert stats.members == 6
    f = os.path.join(dest, "dir/file")
    st = os.stat(f)
    assert Path(f).read_bytes() == b"hello"
    assert (st.st_mode & 0o7777, st.st_uid, st.st_mtime) == (0o4755, 1234, 1_700_000_000)
    assert os.getxattr(f, "user.k") == b"v"
    # overlay's private xattrs in an archive are dropped (they could forge whiteouts)
    assert "trusted.overlay.opaque" not in os.listxattr(f)
    assert os.readlink(os.path.join(dest, "dir/sym")) == "file"
    assert os.readlink(os.path.join(dest, "abs")) == "/bin/busybox"
    assert os.stat(os.path.join(dest, "dir/hard")).st_ino == st.st_ino
    assert os.stat(os.path.join(dest, "dir")).st_mode & 0o777 == 0o750


@pytest.mark.parametrize("members, needle", [
    ([(ti("/etc/passwd"), b"x")], "absolute"),
    ([(ti("a/../../x"), b"x")], "'..'"),
    ([(ti("esc", tarfile.SYMTYPE, link="../../etc"), None)], "outside"),
    ([(ti("d/esc", tarfile.SYMTYPE, link="../../x"), None)], "outside"),
    ([(ti("lnk", tarfile.SYMTYPE, link="/etc"), None), (ti("lnk/passwd"), b"pwned")],
     "through the symlink"),
    ([(ti("h", tarfile.LNKTYPE, link="/etc/shadow"), None)], "absolute"),
    ([(ti("h", tarfile.LNKTYPE, link="missing"), None)], "not in the archive"),
])
def test_rejects_hostile_members(tmp_path: object, members: list, needle: str) -> None:
    with pytest.raises(UnsafeArchive, match=needle):
        extract_tar(io.BytesIO(make_tar(members)), str(tmp_path))
    assert not os.path.exists("/etc/passwd.pwned")


def test_device_members_go_by_the_one_rule(tmp_path: object) -> None:
    """Device nodes are left out and counted (they used to refuse the whole archive),
    a 0/0 character device is a whiteout and kept (tree.special_skip)."""
    null = ti("dev/null", tarfile.CHRTYPE)
    null.devmajor, null.devminor = 1, 3
    blk = ti("dev/sda", tarfile.BLKTYPE)
    blk.devmajor = 8
    stats = extract_tar(io.BytesIO(make_tar([(null, None), (blk, None),
                                             (ti("gone", tarfile.CHRTYPE), None)])),
                        str(tmp_path))
    assert stats.skipped == {"devices": 2}
    assert not os.path.exists(os.path.join(str(tmp_path), "dev", "null"))
    st = os.lstat(os.path.join(str(tmp_path), "gone"))
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def test_rejects_huge_members_and_totals(tmp_path: object) -> None:
    data = make_tar([(ti("big"), b"x" * 2000)])
    with pytest.raises(UnsafeArchive, match="over the limit"):
        extract_tar(io.BytesIO(data), str(tmp_path), limits=ExtractLimits(max_member_bytes=1000))
    data = make_tar([(ti(f"f{i}"), b"x" * 600) for i in range(3)])
    with pytest.raises(UnsafeArchive, match="exceeds"):
        extract_tar(io.BytesIO(data), os.path.join(str(tmp_path)),
                    limits=ExtractLimits(max_total_bytes=1000))


def test_truncated_stream_is_unsafe(tmp_path: object) -> None:
    data = make_tar([(ti("f"), b"y" * 5000)])
    with pytest.raises(UnsafeArchive):
        extract_tar(io.BytesIO(data[:2048]), str(tmp_path))


def test_failed_build_leaves_no_layer(store: LayerStore) -> None:
    data = make_tar([(ti("ok"), b"fine"), (ti("/abs"), b"bad")])
    with pytest.raises(UnsafeArchive):
        store.add_tar(io.BytesIO(data), kind="base", name="bad")
    assert store.manifests() == []
    assert store.refs() == {}
    assert os.listdir(os.path.join(store.root, "tmp")) == []
    assert os.listdir(os.path.join(store.root, "layers")) == []


def test_oci_whiteouts_translate_to_overlay_whiteouts(tmp_path: object) -> None:
    data = make_tar([
        (ti("etc/.wh.gone"), b""),
        (ti("var/.wh..wh..opq"), b""),
        (ti("var/new"), b"n"),
    ])
    dest = str(tmp_path)
    stats = extract_tar(io.BytesIO(data), dest, oci_whiteouts=True)
    st = os.lstat(os.path.join(dest, "etc/gone"))
    assert os.major(st.st_rdev) == 0 and os.minor(st.st_rdev) == 0
    assert os.getxattr(os.path.join(dest, "var"), "trusted.overlay.opaque") == b"y"
    assert not os.path.exists(os.path.join(dest, "etc/.wh.gone"))
    assert (stats.whiteouts, stats.opaque_dirs) == (1, 1)
