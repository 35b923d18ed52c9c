"""Red team 22 B2: the v1 best-effort cpu parent ``dsec-<name>.be`` is another backend's
base cgroup when that backend's cgroup name is ``<name>.be``.

``claim_cgroup_name`` accepts any 1-64 of ``[A-Za-z0-9._-]`` (so both ``x`` and ``x.be``);
``be_cpu_parent`` puts backend ``x``'s BE sandboxes under ``<own>/dsec-x.be`` in the cpu
hierarchy - backend ``x.be``'s own parent there. Then:

- ``take_census(root_x, "x")`` walks ``dsec-x.be`` (``cgroup_parents`` includes the BE
  parent) and sees every sandbox of backend ``x.be`` (LS ones too) as a cgroup of its
  own with no dir under its root: its reconciliation takes them for crash leftovers;
- ``_owner("dsec-x.be")`` is ``x``: ``reap_orphan_names`` of a dead ``x`` removes (kills
  the tasks of) ``dsec-x.be`` in *every* hierarchy - all of backend ``x.be``'s sandboxes;
  and ``x.be``'s own dirs are never attributed to ``x.be``.

The two names are distinct and both accepted; nothing warns. The secure behaviour: either
such a pair is refused at claim, or no cgroup dir is owned by both names.
"""

from __future__ import annotations

import os

import pytest

from dsec.edge.backends.container import census
from dsec.edge.governor import all_leaf_dirs
from dsec.errors import DsecError
from tests.edge.container.conftest import images_dir  # noqa: F401  (fixture)


def _has_v1() -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(" - cgroup " in ln for ln in f)


pytestmark = pytest.mark.skipif(not _has_v1(), reason="needs a cgroup v1 hierarchy")


def test_cgroup_names_x_and_x_be_never_share_a_cgroup_dir(tmp_path: object) -> None:
    names_dir = os.path.join(str(tmp_path), "names")
    roots = {n: os.path.join(str(tmp_path), n) for n in ("rt22b", "rt22b.be")}
    for n, root in roots.items():
        os.makedirs(root)
    try:
        for n, root in roots.items():
            census.claim_cgroup_name(n, root, names_dir=names_dir)
    except DsecError:
        return      # refused at claim: the collision cannot happen
    with open("/proc/self/mountinfo") as f:
        mountinfo = f.read()
    with open("/proc/self/cgroup") as f:
        own = f.read()
    a = set(all_leaf_dirs(mountinfo, own, name="rt22b"))
    b = set(all_leaf_dirs(mountinfo, own, name="rt22b.be"))
    shared = sorted(a & b)
    assert not shared, (f"backends named 'rt22b' and 'rt22b.be' (both accepted) both take "
                        f"{shared} for theirs: one's census/reap kills the other's sandboxes")
    # the reaper's attribution of a dir to a name must agree with the claimant
    for d in b:
        assert census._owner(d) == "rt22b.be", (
            f"{d} (backend 'rt22b.be''s parent) is attributed to {census._owner(d)!r}: "
            "reap_orphan_names of that name removes it with its tasks")


@pytest.mark.root
async def test_reconcile_of_backend_x_leaves_backend_x_be_sandboxes_alone(
        tmp_path: object, images_dir: str) -> None:  # noqa: F811
    """The same collision with real backends: backend ``rt22c`` reconciling at its start
    takes backend ``rt22c.be``'s running sandbox for its own leftover and kills it."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    from dsec.edge.backends.container import ContainerBackend, DirectoryImages
    from dsec.wire.spec import ExecRequest
    from tests.edge.container.conftest import SPEC, _cleanup, new_sid

    base = str(tmp_path)
    try:
        other = ContainerBackend(root_dir=os.path.join(base, "rb"),
                                 images=DirectoryImages(images_dir), cgroup_name="rt22c.be")
    except DsecError:
        return      # refused at claim: the collision cannot happen
    mine = None
    try:
        sid = new_sid()
        await other.create(sid, SPEC)
        try:
            mine = ContainerBackend(root_dir=os.path.join(base, "ra"),
                                    images=DirectoryImages(images_dir), cgroup_name="rt22c")
        except DsecError:
            return
        found = await mine.reconcile(set())
        try:
            r = await other.exec(sid, ExecRequest(shell="echo alive"))
            ok, what = r.exit_code == 0 and b"alive" in r.stdout, repr(r)
        except DsecError as exc:
            ok, what = False, str(exc)
        assert ok, (f"backend 'rt22c' reconciled away backend 'rt22c.be''s sandbox {sid} "
                    f"(leftovers it found: {found}); exec now: {what}")
    finally:
        if mine is not None:
            await _cleanup(mine)
        await _cleanup(other)
