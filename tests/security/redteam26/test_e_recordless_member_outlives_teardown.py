"""A grouped sandbox whose record is missing (the edge killed -9 between the init's
start and ``save_record`` at the end of ``create`` - every in-flight create at the
crash) cannot be killed by the teardown that cleans it up.

``_teardown(sid, d, None, None)`` (adopt of a sandbox with no record; ``destroy`` of
one the backend does not hold) works on ``governor.paths(sid)``, which names a memory
cgroup ``<memory base>/<sid>`` of its own. A member has none (its memory cgroup is the
group's), so ``Governor.exists`` is False and ``kill_all`` returns at once without a
signal; ``_remove_cgroup`` then retries for 5 s on cgroups its live init keeps busy
and raises. ``_remove_leftover`` skips its freeze-and-kill for the same reason.
Without memory groups the same adopt kills the init and answers False.

At the node: ``adopt`` raises after 5 s for each such sandbox, one after the other
(``_adopt_all`` is sequential): a crash during a burst of creates stalls the restart
by 5 s per in-flight create before the edge serves.

Repro: a member's ``state.json`` removed (as the crash leaves it), its backend closed
(the sandbox runs on); a new backend adopts it: expected False, its init dead.
"""

from __future__ import annotations

import os

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.errors import DsecError
from tests.edge.container.conftest import _cleanup, new_sid

from .conftest import spec

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return False
    return raw[raw.rfind(b")") + 2:].split()[0] != b"Z"


async def test_adopting_a_recordless_member_kills_it(tmp_path: object,
                                                     images_dir: str) -> None:
    root = os.path.join(str(tmp_path), "r")
    b1 = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir),
                          memory_group_size=2)
    b2: ContainerBackend | None = None
    a = new_sid()
    try:
        await b1.create(a, spec("p", 64))
        init = b1.box(a).init_pid
        os.unlink(os.path.join(root, "sb", a, "state.json"))   # crashed before the record
        await b1.close()
        b2 = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir),
                              memory_group_size=2)
        try:
            adopted: object = await b2.adopt(a, spec("p", 64))
        except DsecError as exc:
            adopted = f"raised {type(exc).__name__}: {exc}"
        assert (adopted, _alive(init)) == (False, False), (
            f"adopt of a member with no record: {adopted!r}; its init {init} alive: "
            f"{_alive(init)}")
    finally:
        b = b2 or b1
        await b.reconcile(set())          # the census kills what is left
        await _cleanup(b)


async def test_reconcile_removes_a_paused_member_the_node_does_not_keep(
        tmp_path: object, images_dir: str) -> None:
    """The same skipped freeze-kill-thaw in ``_remove_leftover``: its sweep SIGKILLs the
    listed tasks but never thaws, and a v1-frozen task does not die until thawed. A
    paused member the node does not keep (its adopt failed - see C -, or the journal
    lost it) is SIGKILLed frozen: reconcile gives up after 5 s and the sandbox stays on
    the host, frozen with its memory, for every later retry and restart."""
    root = os.path.join(str(tmp_path), "r")
    b1 = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir),
                          memory_group_size=2)
    b2: ContainerBackend | None = None
    a = new_sid()
    init = 0
    try:
        await b1.create(a, spec("p", 64))
        init = b1.box(a).init_pid
        await b1.pause(a)
        await b1.close()
        b2 = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir),
                              memory_group_size=2)
        await b2.reconcile(set())
        left = b2.census().sandboxes()
        assert (_alive(init), left) == (False, set()), (
            f"after reconcile the paused member's init {init} is alive: {_alive(init)}; "
            f"the host still holds {left}")
    finally:
        freezer = f"/sys/fs/cgroup/freezer/dsec-{(b2 or b1).cgroup_name}/{a}/freezer.state"
        if os.path.exists(freezer):
            with open(freezer, "w") as f:  # noqa: ASYNC230
                f.write("THAWED")
        b = b2 or b1
        await b.reconcile(set())
        await _cleanup(b)
