"""mountshed keeps a mount *exactly at* a system directory (/etc, /usr, ...) but sheds
everything below one. In a container or a Kubernetes pod - a common home for an edge
or for ``dsec image bootstrap`` - ``/etc/resolv.conf``, ``/etc/hosts`` and
``/etc/hostname`` are single-file bind mounts made by the runtime (often also
``/etc/ssl/certs`` and CA bundles). The shed namespace sees the image's own files
underneath instead: usually an empty or stale resolv.conf. mmdebstrap's apt (outside
the chroot, in that namespace) then cannot resolve the default mirror
(deb.debian.org), and mmdebstrap copies that resolv.conf into the new image: a
bootstrap that worked before the change fails on such hosts.

Repro (no change to the host: it runs in a private mount namespace of its own): a file
is bind-mounted over /etc/resolv.conf; ``contained(["cat", "/etc/resolv.conf"])`` must
print what the caller sees.

Severity: medium (bootstrap broken on container/Kubernetes hosts with an http(s)
mirror; silently wrong DNS/CA/hosts data elsewhere).

Fix: keep every mount whose mount point is a non-directory (a file bind) and mounts
under /etc (or an explicit list: /etc/resolv.conf, /etc/hosts, /etc/hostname,
/etc/ssl, /usr/share/ca-certificates); better, shed only mount types known to be
dsec's objects' (loop-backed btrfs/ext4/erofs, nsfs, fuse, overlay) instead of
everything not on an allowlist.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.root]

_INNER = """
import subprocess, sys
from dsec.image.bootstrap import contained
fake, target = sys.argv[1], sys.argv[2]
subprocess.run(["mount", "--bind", fake, "/etc/resolv.conf"], check=True)
host = open("/etc/resolv.conf").read()
out = subprocess.run(contained(["cat", "/etc/resolv.conf"], [target]),
                     capture_output=True, text=True, check=True).stdout
print(repr(host)); print(repr(out))
"""


def test_the_bootstrap_sees_the_callers_resolv_conf(tmp_path: object) -> None:
    tmp = str(tmp_path)
    fake = os.path.join(tmp, "resolv.conf")
    with open(fake, "w") as f:
        f.write("nameserver 127.0.0.53  # the container runtime's, bind-mounted\n")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "--",
                        sys.executable, "-c", _INNER, fake, os.path.join(tmp, "target")],
                       check=False, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-2000:]
    host, seen = r.stdout.splitlines()[-2:]
    assert seen == host, (f"the caller's /etc/resolv.conf (a bind mount) is {host}; the "
                          f"contained bootstrap helper reads {seen}: mountshed shed it")
