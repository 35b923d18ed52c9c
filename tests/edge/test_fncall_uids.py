"""The host-wide registry of fncall sandbox uids (``fncall_uids.UidRegistry``) on a
directory of the test's own: claims, stale claims, releases."""

from __future__ import annotations

import os

import pytest

from dsec.edge.backends.fncall_uids import UidRegistry


@pytest.fixture
def reg(tmp_path: object) -> UidRegistry:
    return UidRegistry(os.path.join(str(tmp_path), "uids"))


def test_a_held_uid_is_never_claimed_twice(reg: UidRegistry, tmp_path: object) -> None:
    r1, r2 = (os.path.join(str(tmp_path), n) for n in ("root1", "root2"))
    os.mkdir(r1)
    os.mkdir(r2)
    assert reg.claim(r1, "a", iter([10, 11, 12])) == 10
    assert reg.claim(r2, "b", iter([10, 11, 12])) == 11
    assert reg.claim(r1, "a", iter([10])) == 10          # its own claim again
    assert reg.claim(r2, "c", iter([10, 11])) is None    # all held
    assert not reg.hold(10, r2, "c") and reg.hold(12, r2, "c")
    reg.release(10, r2, "b")                             # not b's: stays
    assert reg.claim(r2, "d", iter([10])) is None
    reg.release(10, r1, "a")
    assert reg.claim(r2, "d", iter([10])) == 10


def test_claims_of_a_root_that_is_gone_or_of_removed_sandboxes_are_freed(
        reg: UidRegistry, tmp_path: object) -> None:
    gone, live = (os.path.join(str(tmp_path), n) for n in ("gone", "live"))
    os.mkdir(gone)
    os.mkdir(live)
    assert reg.claim(gone, "a", iter([5])) == 5
    assert reg.claim(live, "b", iter([6])) == 6
    assert reg.claim(live, "c", iter([7])) == 7
    os.rmdir(gone)                                       # e.g. a temp root removed
    assert reg.claim(live, "x", iter([5])) == 5          # stale: taken over
    assert reg.release_gone(live, lambda sid: sid != "c") == 1
    assert reg.claim(live, "y", iter([7])) == 7 and reg.claim(live, "z", iter([6])) is None


def test_the_registry_must_be_private(tmp_path: object) -> None:
    d = os.path.join(str(tmp_path), "open")
    os.mkdir(d)
    os.chmod(d, 0o777)
    with pytest.raises(PermissionError, match="no one else can write"):
        UidRegistry(d)
