"""dsec.rmtree on trees a tenant shaped: deeper than Python's recursion limit and than
the fds one removal may hold (red team 22, B3: a sandbox's ``mkdir d; cd d`` loop made
the recursive walk raise RecursionError at destroy and keep its scratch files). The walk
must stay iterative, hold a bounded number of fds, never follow a symlink and never
enter another mount, however deep those sit."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dsec.rmtree import MAX_OPEN_DIRS, remove_tree, remove_tree_at

DEPTH = 1200   # > sys.getrecursionlimit() (1000) and >> MAX_OPEN_DIRS


def _chain(top: Path, depth: int, *, every: int = 100) -> list[int]:
    """``top/d/d/.../d`` ``depth`` deep with a file every ``every`` levels; the fds
    are not kept. Returns nothing useful but the levels with files."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    marks = []
    try:
        for i in range(depth):
            os.mkdir("d", dir_fd=fd)
            if i % every == 0:
                os.close(os.open(f"f{i}", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
                marks.append(i)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)
    return marks


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_chain_deeper_than_the_recursion_limit_goes_with_few_fds(tmp_path: Path) -> None:
    top = tmp_path / "t"
    top.mkdir()
    _chain(top, DEPTH)
    for i in range(20):   # and a wide level beside it
        (top / f"w{i}").mkdir()
        (top / f"w{i}" / "x").write_text("x")
    before = _open_fds()
    try:
        res = remove_tree(str(top))
        assert res.clean, res.describe()
        assert not top.exists()
        assert _open_fds() == before
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=False)


def test_remove_tree_at_of_a_deep_chain(tmp_path: Path) -> None:
    top = tmp_path / "t"
    top.mkdir()
    _chain(top, 2 * MAX_OPEN_DIRS + 5)
    pfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        res = remove_tree_at(pfd, "t", "/t")
    finally:
        os.close(pfd)
        subprocess.run(["rm", "-rf", str(top)], check=False)
    assert res.clean, res.describe()
    assert not top.exists()


def test_a_deep_symlink_is_removed_not_followed(tmp_path: Path) -> None:
    top, outside = tmp_path / "t", tmp_path / "outside"
    top.mkdir()
    outside.mkdir()
    (outside / "keep").write_text("not ours\n")
    depth = 3 * MAX_OPEN_DIRS
    _chain(top, depth, every=depth + 1)
    deep = os.path.join(str(top), *(["d"] * depth))
    os.symlink(str(outside), os.path.join(deep, "link"))
    os.symlink(str(outside), os.path.join(os.path.dirname(deep), "link2"))
    res = remove_tree(str(top))
    assert res.clean, res.describe()
    assert not top.exists()
    assert (outside / "keep").read_text() == "not ours\n"


@pytest.mark.root
def test_a_mount_below_the_fd_window_is_refused_not_walked(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    top, outside = tmp_path / "t", tmp_path / "outside"
    top.mkdir()
    outside.mkdir()
    (outside / "keep").write_text("not ours\n")
    depth = 2 * MAX_OPEN_DIRS + 3
    _chain(top, depth, every=depth + 1)
    mp = os.path.join(str(top), *(["d"] * depth), "m")
    os.mkdir(mp)
    subprocess.run(["mount", "--bind", str(outside), mp], check=True)
    try:
        res = remove_tree(str(top))
        assert res.refused and not res.clean, res.describe()
        assert (outside / "keep").read_text() == "not ours\n"
    finally:
        with open("/proc/self/mountinfo") as f:
            for line in reversed(f.read().splitlines()):
                point = line.split(" ")[4]
                if point.startswith(str(top) + "/"):
                    subprocess.run(["umount", "-l", point], check=False)
        subprocess.run(["rm", "-rf", str(top)], check=False)


def test_walk_of_a_deep_tree_matches_os_walk_without_recursion(tmp_path: Path) -> None:
    """dsec.fswalk.walk: what census (cgroup trees a nested sandbox makes), stats
    (overlay upper, fncall work dir) and fncall's chown walk use instead of Python
    3.11's recursive os.walk."""
    from dsec.fswalk import walk

    for p in ("a/b/c", "a/x", "e"):
        (tmp_path / "s" / p).mkdir(parents=True)
    (tmp_path / "s" / "a" / "b" / "f").write_text("f")
    os.symlink("/etc", tmp_path / "s" / "a" / "link")     # listed, never followed
    for topdown in (True, False):
        got = [(p, sorted(d), sorted(f)) for p, d, f in walk(str(tmp_path / "s"),
                                                            topdown=topdown)]
        want = [(p, sorted(d), sorted(f)) for p, d, f in os.walk(str(tmp_path / "s"),
                                                                 topdown=topdown)]
        for (gp, gd, gf), (wp, wd, wf) in zip(sorted(got), sorted(want), strict=True):
            assert (gp, sorted(gd + gf)) == (wp, sorted(wd + wf))
        if not topdown:   # children before their parent
            order = [p for p, _, _ in got]
            assert order.index(str(tmp_path / "s" / "a" / "b" / "c")) < order.index(
                str(tmp_path / "s" / "a" / "b"))
    pruned = [p for p, d, _ in walk(str(tmp_path / "s")) if not d.clear()]
    assert pruned == [str(tmp_path / "s")]      # top-down pruning in place
    top = tmp_path / "deep"
    top.mkdir()
    _chain(top, DEPTH, every=DEPTH + 1)
    try:
        assert sum(1 for _ in walk(str(top), topdown=False)) == DEPTH + 1
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=False)
