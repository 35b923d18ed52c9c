"""Red team B (issue 19 files x judge set-ups): sandbox code hides files from
``files.watch`` by naming them like the file API's own temporary files.

The watch drops every event whose name starts with ``.dsec-upload-`` (the temporary
file of a streamed write: its atomic write should show as one create). The prefix is
public and any process in the sandbox may use it: an agent that writes its output, a
cached answer or a tool it drops into a watched workspace as ``.dsec-upload-x``
produces no event for the judge (or dashboard) that watches the directory. Only the
edge's own temporary files (which the edge knows by name, or by the descriptor it
holds) may be filtered.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from dsec.cluster.local import LocalCluster
from dsec.wire.files import FileEvent


def test_b_sandbox_files_named_like_uploads_are_still_watched() -> None:
    if os.geteuid() != 0:
        pytest.fail("container sandboxes need root (CI runs as root)")
    with LocalCluster(edges=1, backend="container") as cl, cl.client() as c:
        sb = c.sandboxes.create(ttl=300)
        try:
            sb.exec(["mkdir", "-p", "/work"])
            seen: list[FileEvent] = []

            def watch() -> None:
                seen.extend(sb.files.watch("/work", timeout=8))
            t = threading.Thread(target=watch)
            t.start()
            time.sleep(1.5)
            sb.exec(["sh", "-c", "echo a > /work/visible; echo b > /work/.dsec-upload-x"])
            t.join(30)
        finally:
            sb.kill()
    names = {e.name for e in seen}
    assert "visible" in names, seen                    # the watch worked
    assert ".dsec-upload-x" in names, (
        f"a file the sandbox's own code made, /work/.dsec-upload-x, raised no event: {seen}")
