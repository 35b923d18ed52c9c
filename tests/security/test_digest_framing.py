"""Content digests are framed per field (red team 15, F8's class): no field's bytes can
spell another's boundary, and names that are not UTF-8 hash instead of crashing."""

from __future__ import annotations

import os
from pathlib import Path

from dsec.client.build import _framed, tree_digest


def test_framing_tells_field_boundaries_apart() -> None:
    assert _framed(b"ab", b"c") != _framed(b"a", b"bc")
    assert _framed(b"a\0", b"") != _framed(b"a", b"\0")
    assert _framed(b"x") != _framed(b"x", b"")


def test_a_file_and_a_symlink_with_the_same_bytes_differ(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    (one / "a").write_bytes(b"target")
    os.symlink("target", two / "a")
    (one / "a").chmod(0o777)
    assert tree_digest(str(one)) != tree_digest(str(two))


def test_names_that_are_not_utf8_hash_and_differ(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    (one / os.fsdecode(b"caf\xe9")).write_bytes(b"x")     # latin-1 name, not UTF-8
    (two / os.fsdecode(b"caf\xe8")).write_bytes(b"x")
    assert tree_digest(str(one)) != tree_digest(str(two))
