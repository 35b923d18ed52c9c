"""Red team 24 E1: the gVisor platform probe killed on its timeout still leaves a
``runsc-do<N>`` directory (its config.json and a lock file) in ``$TMPDIR`` (/tmp) - the
same class as the ``runsc-<n>`` cgroups ``--ignore-cgroups`` now avoids (commit
4fa6dca3): ``runsc do`` makes the directory and removes it only when it exits on its own.
On this VM the kvm platform hangs, so every probe that tries it is killed (20 such
directories were in /tmp when this was written).

Fix: run the probe with ``TMPDIR`` set to a private directory made for it (e.g. under
its ``--root`` state dir) and remove that directory after the probe, killed or not.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from dsec.edge.backends.container.runsc import _probe_one

pytestmark = pytest.mark.root


def _leftovers(tmp: str) -> set[str]:
    return {n for n in os.listdir(tmp) if n.startswith("runsc-do")}


def test_a_killed_probe_leaves_nothing_in_tmp(tmp_path: object) -> None:
    runsc = "/usr/bin/runsc"
    if not os.path.exists(runsc) or not os.access("/dev/kvm", os.R_OK | os.W_OK):
        pytest.skip("needs runsc and a /dev/kvm whose platform hangs (PVM) to time out")
    tmp = os.environ.get("TMPDIR") or "/tmp"
    before = _leftovers(tmp)
    state = os.path.join(str(tmp_path), "state")
    os.makedirs(state)
    t0 = time.monotonic()
    ok = _probe_one(runsc, state, "kvm", 2.0)
    if ok or time.monotonic() - t0 < 1.9:
        pytest.skip("the kvm probe did not hang here; nothing was killed")
    new = _leftovers(tmp) - before
    try:
        assert not new, f"the killed probe left {sorted(new)} in {tmp}"
    finally:
        for n in new:
            shutil.rmtree(os.path.join(tmp, n), ignore_errors=True)
