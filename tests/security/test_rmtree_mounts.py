"""dsec.rmtree: recursive deletes never cross a mount point (red team 15, F18 class).
Real mounts (a tmpfs and binds of our own, under the test's tmp dir), unmounted in
``finally``."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.rmtree import mounts_at_or_below, remove_tree

pytestmark = pytest.mark.root


def _mounts_under(path: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return mounts_at_or_below(f.read(), path)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """``outside``: a directory of the SAME filesystem as the tree (a bind of it is
    invisible to an st_dev check); ``shm``: a tmpfs (another st_dev); ``tree``: the
    directory to delete, with both bound inside it, two levels down."""
    outside, shm, tree = tmp_path / "outside", tmp_path / "shm", tmp_path / "tree"
    for d in (outside, shm, tree / "root" / "dev" / "shm", tree / "root" / "home"):
        d.mkdir(parents=True)
    (outside / "keep").write_text("same filesystem, not ours\n")
    (tree / "root" / "mine").write_text("ours\n")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "fix15c", str(shm)], check=True)
    try:
        (shm / "segment").write_text("another process's shm\n")
        subprocess.run(["mount", "--bind", str(shm), str(tree / "root" / "dev" / "shm")],
                       check=True)
        subprocess.run(["mount", "--bind", str(outside), str(tree / "root" / "home")],
                       check=True)
        yield outside, shm, tree
    finally:
        for mp in _mounts_under(str(tmp_path)):
            subprocess.run(["umount", "-l", mp], check=False, capture_output=True)


def test_without_detach_the_walk_refuses_both_mounts_and_deletes_nothing_in_them(
        world: tuple[Path, Path, Path]) -> None:
    outside, shm, tree = world
    res = remove_tree(str(tree))
    assert sorted(res.refused) == sorted([str(tree / "root" / "dev" / "shm"),
                                          str(tree / "root" / "home")])
    assert not res.clean and res.detached == []
    assert (shm / "segment").exists() and (outside / "keep").exists()
    assert not (tree / "root" / "mine").exists()        # what is ours went
    assert len(_mounts_under(str(tree))) == 2             # refused: left as they were


def test_with_detach_the_mounts_go_first_and_their_sources_keep_their_files(
        world: tuple[Path, Path, Path]) -> None:
    outside, shm, tree = world
    res = remove_tree(str(tree), detach=True)
    assert res.clean, res.describe()
    assert len(res.detached) == 2
    assert not tree.exists() and _mounts_under(str(tree)) == []
    assert (shm / "segment").read_text() == "another process's shm\n"
    assert (outside / "keep").read_text() == "same filesystem, not ours\n"


def test_a_mount_point_as_the_top_is_refused_without_detach(tmp_path: Path) -> None:
    top = tmp_path / "m"
    top.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "fix15c", str(top)], check=True)
    try:
        (top / "f").write_text("x")
        res = remove_tree(str(top))
        assert res.refused == [str(top)] and (top / "f").exists()
    finally:
        subprocess.run(["umount", "-l", str(top)], check=False)


def test_symlinks_are_removed_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "f").write_text("x")
    tree = tmp_path / "tree"
    (tree / "d").mkdir(parents=True)
    os.symlink(victim, tree / "d" / "link")
    assert remove_tree(str(tree)).clean
    assert not tree.exists() and (victim / "f").exists()


def test_mounts_at_or_below_is_deepest_first_and_unescapes() -> None:
    info = ("1 0 0:1 / / rw - x x rw\n"
            "2 1 0:2 / /a rw - x x rw\n"
            "3 2 0:3 / /a/b\\040c/d rw - x x rw\n"
            "4 1 0:4 / /ab rw - x x rw\n"
            "5 2 0:5 / /a/e rw - x x rw\n")
    assert mounts_at_or_below(info, "/a") == ["/a/b c/d", "/a/e", "/a"]
