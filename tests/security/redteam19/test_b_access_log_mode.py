"""Red team B (issue 19): the access log is world-readable for a moment, long enough.

``dsec.logs.configure(access_log=PATH)`` creates the file with ``logging.FileHandler``
(mode 0666 & ~umask: 0644 under the usual 022) and only then ``os.chmod``s it to 0600.
A local user watching the directory (inotify ``IN_CREATE``) opens it in that window and
keeps the descriptor: every later line (client addresses, principals, request ids,
sandbox ids of every tenant) is theirs, the chmod changes nothing for an open file. The
audit log does it right (``os.open(..., 0o600)``). Asserted deterministically: the file
must never exist with bits beyond 0600 (the mode is observed at the chmod).
"""

from __future__ import annotations

import logging
import os
import stat

from dsec.logs import configure


def test_b_access_log_never_exists_world_readable(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "access.log")
    seen: list[int] = []
    real_chmod = os.chmod

    def spy(p, mode, *a, **kw):  # type: ignore[no-untyped-def]
        if os.fspath(p) == path and os.path.exists(path):
            seen.append(stat.S_IMODE(os.stat(path).st_mode))
        return real_chmod(p, mode, *a, **kw)

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    old_umask = os.umask(0o022)
    monkeypatch.setattr(os, "chmod", spy)
    try:
        configure("info", "json", access_log=path)
        created = stat.S_IMODE(os.stat(path).st_mode)
    finally:
        os.umask(old_umask)
        monkeypatch.undo()
        configure("warning", "text")
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
    assert created == 0o600
    # before the chmod (if any) the file already had only the owner's bits
    assert all(m & 0o077 == 0 for m in seen), [oct(m) for m in seen]
