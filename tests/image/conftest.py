"""Fixtures for image tests: a store in tmp, a node mount cache, and mount cleanup.

Every fixture unmounts what it mounted even when the test fails; a last sweep unmounts
anything still mounted under the test's tmp dir (deepest first).
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator

import pytest

from dsec.image import LayerStore, MountCache
from dsec.image.mount import sys_umount


def mounts_under(prefix: str) -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = line.split(" ")[4]
            if target == prefix or target.startswith(prefix.rstrip("/") + "/"):
                out.append(target)
    return out


def sweep_mounts(prefix: str) -> None:
    for target in sorted(mounts_under(prefix), key=len, reverse=True):
        try:
            sys_umount(target, detach=True)
        except OSError:
            pass


@pytest.fixture
def store(tmp_path: object) -> Iterator[LayerStore]:
    root = os.path.join(str(tmp_path), "store")
    try:
        yield LayerStore(root)
    finally:
        sweep_mounts(str(tmp_path))


@pytest.fixture
def cache(tmp_path: object) -> Iterator[MountCache]:
    c = MountCache()
    try:
        yield c
    finally:
        sweep_mounts(str(tmp_path))   # sandbox overlays first, then the layers
        c.close()
        sweep_mounts(c.root)


def write_tree(root: str, files: dict[str, str | bytes | tuple[str, str]]) -> None:
    """Create files (str/bytes content) and symlinks (('link', target)) under root."""
    for rel, content in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if isinstance(content, tuple):
            os.symlink(content[1], path)
        else:
            with open(path, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)


def tree_of(root: str) -> dict[str, tuple[object, ...]]:
    """What a user sees: type, mode, owner and content (or link target) of every path."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", os.readlink(path), st.st_uid, st.st_gid)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()[:16]
                out[rel] = ("f", stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, digest)
            else:
                out[rel] = ("o", st.st_mode, st.st_rdev)
    return out
