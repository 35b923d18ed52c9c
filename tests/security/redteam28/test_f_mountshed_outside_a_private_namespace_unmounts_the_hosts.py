"""``python -m dsec.mountshed`` detaches every mount it does not keep, trusting that it
runs "as the first process of a fresh private mount namespace" (shed_argv's
docstring) - it never checks, nor makes its mounts private itself. Run anywhere else
(by hand, a future caller that forgets ``--propagation private``, an ``unshare`` whose
default propagation differs: util-linux's default is private, but ``--propagation
unchanged`` or a ``nsenter`` is one word away), each MNT_DETACH propagates to its
peers: run in the host's namespace it unmounts every edge's disk pool, EROFS layer
and netns pin on the node at once.

Repro (confined to a scratch namespace of the test): a tmpfs made shared (as the
host's /run/netns is, ``ip netns`` makes it so) in a private namespace, a mount in it
(as a netns pin is); ``unshare --mount --propagation unchanged -- python -m dsec.mountshed
--keep T -- true`` in it; the tmpfs must still be mounted afterwards.

Severity: low (root only, needs a misuse; the outcome is node-wide).

Fix: in main(), ``mount(NULL, "/", NULL, MS_REC | MS_PRIVATE)`` before detaching
(idempotent in the intended use), and refuse when /proc/self/ns/mnt equals
/proc/1/ns/mnt.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.root]

_SCRIPT = """
set -e
mount -t tmpfs -o size=1m rt28f "$1"
mount --make-shared "$1"
mkdir "$1/pin"
mount -t tmpfs -o size=1m rt28f-pin "$1/pin"
unshare --mount --propagation unchanged -- "$2" -m dsec.mountshed --keep "$3" -- true
if mountpoint -q "$1/pin"; then echo kept; else echo detached; fi
umount -l "$1" 2>/dev/null || true
"""


def test_mountshed_never_unmounts_its_callers_mounts(tmp_path: object) -> None:
    tmp = str(tmp_path)
    victim = os.path.join(tmp, "victim")
    os.mkdir(victim)
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                        _SCRIPT, "sh", victim, sys.executable, os.path.join(tmp, "t")],
                       check=False, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1:] == ["kept"], (
        f"mountshed, run in a namespace that is not private, unmounted its caller's "
        f"mount {victim}/pin (its parent shared) ({r.stdout!r})")
