"""``BootstrapPlan.keep_paths`` takes a ``file://`` mirror's directory as the URL text
after ``file://``, undecoded. The URL may not hold a space (``_URL``), so a directory
with one is written percent-encoded - ``file:///srv/my%20repo`` - which apt decodes
(its ``apt-get update`` reads such a mirror). mountshed is then told to keep
``/srv/my%20repo``, a path that does not exist, and detaches the mount the mirror is
really on (``/srv/my repo``): the bootstrap's apt finds an empty directory. Likewise
``file://localhost/srv/repo`` becomes a *relative* ``localhost/srv/repo`` (made
absolute against the cwd).

Repro: a directory bind-mounted at tmp/"my repo"; ``contained(["ls", ...])`` with
``plan.keep_paths`` of ``file://<tmp>/my%20repo`` must see its files.

Severity: low (a file mirror on a mount of its own, at a path with a space or other
escaped character).

Fix: ``urllib.parse.urlsplit`` the mirror; keep ``unquote(path)`` (refuse a host other
than empty/localhost).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from dsec.image.bootstrap import BootstrapPlan, contained

pytestmark = [pytest.mark.root]


def test_a_percent_encoded_file_mirror_stays_in_the_namespace(tmp_path: object) -> None:
    tmp = str(tmp_path)
    src, mirror = os.path.join(tmp, "src"), os.path.join(tmp, "my repo")
    os.makedirs(os.path.join(src, "dists"))
    os.mkdir(mirror)
    subprocess.run(["mount", "--bind", src, mirror], check=True)
    try:
        plan = BootstrapPlan.parse(suite="bookworm",
                                   mirror="file://" + mirror.replace(" ", "%20"),
                                   trusted=True)
        r = subprocess.run(contained(["ls", mirror], plan.keep_paths(os.path.join(tmp, "t"))),
                           check=False, capture_output=True, text=True, timeout=60)
        assert r.stdout.split() == ["dists"], (
            f"the bootstrap's namespace lost the mirror's mount at {mirror!r} (kept "
            f"{plan.keep_paths(os.path.join(tmp, 't'))}): ls gave {r.stdout!r} {r.stderr!r}")
    finally:
        subprocess.run(["umount", "-l", mirror], check=False)
