"""A second container backend started on a live backend's root (an operator's second
``dsec edge`` on the same --root, a test edge, a restart script racing the old edge) is
refused - ``_lock_root`` raises ``InUse`` - but only *after* ``__init__`` has called
``claim_cgroup_name``, which re-binds the name to the refused process (same root dir:
taken over, no check that the owner still lives). Its ``_release_partial`` then, when
the live backend holds no sandbox right now, removes the live backend's base cgroups
(``governor.remove_base``) and releases its name.

So after one refused start: the live backend's cgroup name is bound to a dead process
(or to nobody), which makes any container edge's start sweep the live backend's empty
cgroups (census.idle_names; the reason the change re-claims at reconcile - but the live
backend reconciled long ago and never re-claims), and an idle backend has lost its base
cgroups (and the tier's pids total on them) under its feet.

Repro: an idle backend in this process; a second one on the same root in a child
process (refused, InUse); then the binding and the base cgroups are checked, and the
live backend must still create a sandbox.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.backends.container.census import NAMES_DIR, _binding, process_identity
from tests.edge.container.conftest import _cleanup, new_sid

from .conftest import spec

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

_SECOND = textwrap.dedent("""
    import sys
    from dsec.edge.backends.container import ContainerBackend, DirectoryImages
    from dsec.errors import InUse
    try:
        ContainerBackend(root_dir=sys.argv[1], images=DirectoryImages(sys.argv[2]))
    except InUse as exc:
        print("refused:", exc)
    else:
        print("not refused")
""")


async def test_a_refused_second_backend_leaves_the_live_ones_name_and_cgroups(
        tmp_path: object, images_dir: str) -> None:
    root = os.path.join(str(tmp_path), "r")
    b = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir))
    try:
        name = b.cgroup_name
        bases = dict(b.governor.layout.bases)
        mine = (b.root_dir, process_identity(os.getpid()))
        assert _binding(NAMES_DIR, name) == mine
        r = subprocess.run(  # noqa: ASYNC221 - a whole second backend process
            [sys.executable, "-c", _SECOND, root, images_dir], capture_output=True,
            text=True, timeout=120, check=False,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert r.stdout.startswith("refused:"), (r.stdout, r.stderr[-2000:])
        bound = _binding(NAMES_DIR, name)
        gone = sorted(c for c, d in bases.items() if not os.path.isdir(d))
        created: object = None
        sid = new_sid()
        try:
            await b.create(sid, spec("p", 64))
            created = True
        except Exception as exc:  # noqa: BLE001 - reported below
            created = f"{type(exc).__name__}: {exc}"
        assert (bound, gone, created) == (mine, [], True), (
            f"after a refused second backend on its root, the live backend's name is "
            f"bound to {bound} (it is {mine}); its base cgroups gone: {gone}; its next "
            f"create: {created}")
    finally:
        await _cleanup(b)
