"""F10: the file:// blob store (documented for local disk and NFS) publishes objects 0644
in directories made 0755 (``os.makedirs`` with the umask): every project's pushed layers
- private workspaces, a promoted snapshot's files - are readable by any user of the host
(and of every NFS client), while the node's own layer store keeps them 0700/0600. The
store's objects must be reachable by the service's user only."""

from __future__ import annotations

import os
from pathlib import Path

from dsec.image.blob import layer_key, open_blobstore


def _other_can_read(root: str, path: str) -> bool:
    """Whether a user who is neither owner nor group can open ``path`` for reading."""
    p = path
    while True:
        st = os.stat(p)
        if p != path and not st.st_mode & 0o001:
            return False           # a directory on the way they cannot traverse
        if p == path and not st.st_mode & 0o004:
            return False
        if os.path.samefile(p, root):
            break
        p = os.path.dirname(p)
    return True


def test_file_blob_store_objects_are_not_readable_by_other_host_users(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        root = str(tmp_path / "blob")
        store = open_blobstore("file://" + root)
        key = layer_key("sha256:" + "ab" * 32)
        store.put_bytes(key, b"project teamb's private workspace layer")
        path = os.path.join(root, key)
        assert os.path.exists(path)
        modes = {os.path.relpath(d, root): oct(os.stat(d).st_mode & 0o777)
                 for d in (root, os.path.dirname(path), path)}
        assert not _other_can_read(root, path), (
            f"any host user reads a pushed layer of the file:// store: modes {modes}")
    finally:
        os.umask(old)
