"""``BootstrapPlan`` accepts a ``file://`` mirror and the mountshed change keeps its
directory in the bootstrap's namespace (``keep_paths``) - but a bootstrap from one
never succeeds: mmdebstrap (root mode, directory format) installs with dpkg *inside*
the chroot, and refuses a mirror whose .debs are not reachable from there ("package
file ... not accessible from chroot directory -- use copy:// instead of file:// or a
bind-mount ... --hook-dir=/usr/share/mmdebstrap/hooks/file-mirror-automount").
``test_the_file_mirror_and_target_are_kept`` only checks the argv, so the one
documented non-network way to bootstrap is untested and broken.

Repro: the local repository ``make debian-repo`` keeps (the one the bootstrap tests
serve over loopback) given as ``file://<dir>``; ``bootstrap_tree`` must build a tree
with /usr/bin/python3.

Severity: medium (a documented mirror form fails every time, with mmdebstrap's error).

Fix: for a ``file://`` mirror pass ``--hook-dir=/usr/share/mmdebstrap/hooks/
file-mirror-automount`` (it bind-mounts the mirror into the chroot - inside the
contained namespace, so it dies with it), or use mmdebstrap's ``copy://``; and keep a
real bootstrap test over ``file://``.
"""

from __future__ import annotations

import os

import pytest

from dsec.image.bootstrap import BootstrapPlan, bootstrap_tree, repo_dir
from dsec.rmtree import remove_tree

pytestmark = [pytest.mark.root, pytest.mark.slow]


def test_a_file_mirror_bootstraps(tmp_path: object) -> None:
    local = BootstrapPlan.parse(suite="bookworm", include="python3,python3-pytest")
    repo = repo_dir(local)
    if not os.path.exists(os.path.join(repo, ".complete")):
        pytest.fail(f"no local Debian repo at {repo}: run `make debian-repo` (setup)")
    plan = BootstrapPlan.parse(suite="bookworm", include="python3,python3-pytest",
                               mirror=f"file://{repo}", trusted=True)
    target = os.path.join(str(tmp_path), "root")
    try:
        bootstrap_tree(plan, target)
        assert os.path.exists(os.path.join(target, "usr/bin/python3"))
        # the hook's mount point chain for the mirror is not left in the image
        assert not os.path.exists(os.path.join(target, repo.lstrip("/")))
    finally:
        if os.path.lexists(target):
            remove_tree(target)
