"""The vm tier has no one-backend-per-root lock (the container tier's ``_lock_root``),
and its name claim - at ``__init__`` and now again at every ``reconcile`` - re-binds
its cgroup name to whichever process on the same root claimed last. A second vm backend
started on a live one's root (a second edge, a test edge, a restart racing the old one)
takes the live backend's name at its start; once it is gone (kill -9, or it simply
exits) the name is bound to a dead claimer, and any container edge's start
(``reap_orphan_names`` -> ``idle_names``) sweeps the *live* vm tier's empty cgroups -
a paused VM's, and an idle tier's base with its pids total: the very failure the
re-claim at reconcile was added for, except that the live backend reconciled long ago
and never claims again.

Repro: an idle vm backend in this process; a second one on its root in a child
process runs its start (init + reconcile) and is killed; then what a container edge's
start does is run. The live backend's binding and base cgroups must be intact.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from dsec.edge.backends.container.census import (
    NAMES_DIR,
    _binding,
    process_identity,
    reap_orphan_names,
    release_cgroup_name,
)

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

_SECOND = textwrap.dedent("""
    import asyncio, os, signal, sys
    from dsec.edge.backends.vm.backend import VmBackend
    b = VmBackend(root_dir=sys.argv[1], images=None, kernel="/nonexistent",
                  initrd="/nonexistent")
    asyncio.run(b.reconcile(set()))          # its start, as the node runs it
    print("started", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)    # then killed -9
""")


async def test_a_second_vm_backend_on_a_live_root_leaves_its_name_and_cgroups(
        tmp_path: object) -> None:
    from dsec.edge.backends.vm.backend import VmBackend

    root = os.path.join(str(tmp_path), "vm")
    b = VmBackend(root_dir=root, images=None, kernel="/nonexistent",  # type: ignore[arg-type]
                  initrd="/nonexistent")
    name = b._claimed
    assert name is not None
    try:
        await b.reconcile(set())             # the live backend's own start
        mine = (b.root_dir, process_identity(os.getpid()))
        assert _binding(NAMES_DIR, name) == mine
        r = subprocess.run(  # noqa: ASYNC221 - a whole second backend process
            [sys.executable, "-c", _SECOND, root], capture_output=True, text=True,
            timeout=120, check=False,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        # refused at its start (InUse: one backend per root), or started and killed -9
        assert (r.returncode != 0 and "InUse" in r.stderr) or (
            r.returncode == -signal.SIGKILL and "started" in r.stdout), r.stderr[-2000:]
        bound = _binding(NAMES_DIR, name)
        # what any container edge's start does (reap_orphan_names), for this name only
        # (a names dir holding just its binding: no other backend of the host touched)
        only = os.path.join(str(tmp_path), "names")
        os.makedirs(only)
        shutil.copy(os.path.join(NAMES_DIR, name), os.path.join(only, name))
        reap_orphan_names(names_dir=only, unbound_scope=lambda _n: False)
        gone = sorted(c for c, d in b.governor.layout.bases.items() if not os.path.isdir(d))
        assert (bound, gone) == (mine, []), (
            f"after a second vm backend on its root started and was killed, the live "
            f"backend's name is bound to {bound} (it is {mine}); a container edge's "
            f"start then removed its base cgroups: {gone}")
    finally:
        await b.close()
        with contextlib.suppress(OSError):
            b.governor.remove_base()
        release_cgroup_name(name, b.root_dir)
