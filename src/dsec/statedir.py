"""The state directory of ``dsec up`` / ``dsec edge``: private to the user running dsec.

Everything under it is some tenant's or the cluster's secret: ``control.sqlite`` holds API
key hashes and stored create requests with their ``env``, ``layers/`` every project's
images and snapshots, ``container/`` the sandboxes' roots, ``edges/`` the journals and
the edges' Aether sockets (no token on a Unix socket: who can connect can run commands).
So the directory is made 0700 at every start, also when it already existed with a looser
mode (a pre-created 0755 directory used to leave all of that world-readable), and it is
refused when another user owns it (that user could read or swap anything in it).
Files inside get private modes of their own as well (the SQLite store 0600, the layer
store 0700/0600), which matters where they live outside a state dir.
"""

from __future__ import annotations

import os
import stat

from dsec.errors import InvalidArgument

__all__ = ["ensure_private_dir"]


def ensure_private_dir(path: str, *, what: str = "state dir") -> str:
    """Create ``path`` (and parents) if needed, then make it mode 0700. Returns its
    absolute path. ``InvalidArgument`` when it is not a directory or another user owns
    it."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as exc:
        raise InvalidArgument(f"cannot create the {what} {path}: {exc.strerror or exc}; "
                              "pick a directory this user may create") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"the {what} {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise InvalidArgument(
            f"the {what} {path} is owned by uid {st.st_uid}, not by this process's uid "
            f"{os.geteuid()}: that user could read or replace the cluster's keys, layers "
            "and sandboxes; chown it or pick another directory")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path
