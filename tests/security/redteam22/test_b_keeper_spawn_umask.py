"""Red team 22 B10: ``FdStore._spawn`` narrows the umask of the whole edge process
(``os.umask(0o177)`` around ``bind``) while other threads run: a file or directory any
edge thread creates meanwhile gets mode & ~0o177 - 0600 / 0700.

``bind`` releases the GIL, so the window is real: the container backend's file pool
(``files.mkdir`` does ``os.mkdir(name, 0o755, dir_fd=...)`` with no chmod after) runs
other tenants' file operations during the first ``process_start`` of a node (the keeper
is spawned then) and every keeper restart. A directory a tenant creates through the API
lands 0700 root-owned in its sandbox - unusable by its non-root user - and anything
else the edge creates in a thread then (layer unpacking, state files) has its mode cut.
Measured here: hit within 12-100 keeper spawns while one thread creates files.

Fix: never change the process umask in a threaded process - bind in a directory only the
edge can enter (the state dir is 0700) and ``chmod`` the socket path after, or bind in
a forked child.
"""

from __future__ import annotations

import os
import threading
import time

from dsec.edge.fdstore import FdStore


def test_keeper_spawn_does_not_narrow_modes_created_by_other_threads(
        tmp_path: object) -> None:
    base = str(tmp_path)
    work, state = os.path.join(base, "w"), os.path.join(base, "s")
    os.mkdir(work)
    os.mkdir(state)
    old = os.umask(0o022)
    bad: list[str] = []
    stop = threading.Event()

    def files_pool() -> None:          # what files.mkdir does, in a thread
        i = 0
        while not stop.is_set():
            p = os.path.join(work, f"d{i % 64}")
            os.mkdir(p, 0o755)
            mode = os.stat(p).st_mode & 0o777
            os.rmdir(p)
            if mode != 0o755:
                bad.append(oct(mode))
            i += 1

    t = threading.Thread(target=files_pool)
    t.start()
    spawns = 0
    try:
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline and not bad and spawns < 3000:
            s = FdStore(state, orphan_s=1.0)
            s._spawn().close()
            assert s.keeper is not None
            s.keeper.kill()
            s.keeper.wait()
            spawns += 1
    finally:
        stop.set()
        t.join()
        os.umask(old)
    assert not bad, (f"a directory made with mode 0755 by another thread came out "
                     f"{bad[0]} during one of {spawns} keeper spawns (process-wide umask "
                     "0o177 around bind)")
