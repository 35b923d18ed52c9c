"""B5: a streamed download (E2B ``GET /files``, REST's Content-Length reads through
``dsec.control.filedoors.sized_read``) takes its length from ``stat`` - the link itself
(lstat) when the path is a symlink - and then reads the file the link points to. A
symlinked file therefore comes back cut to the length of the link's target path, or the
response dies mid-body ("shorter than Content-Length") when the target is shorter. This is
the length B4's agent uses to pick how many bytes of a root-only file it gets; on its own
it silently truncates every read of a symlinked file (config files, ``/etc/alternatives``,
``latest -> run-123/result.json``)."""

from __future__ import annotations

import pytest

from dsec.bench._e2b_calls import E2BTarget

pytestmark = pytest.mark.root


def test_reading_a_symlinked_file_returns_the_whole_file(e2b_target: E2BTarget) -> None:
    from e2b import Sandbox

    sb = Sandbox.create(e2b_target.template, timeout=120, **e2b_target.opts())
    try:
        body = "x" * 5000 + "\n"
        sb.files.write("/tmp/real.txt", body, user="root")
        sb.commands.run("ln -s /tmp/real.txt /tmp/link.txt", user="root")
        assert sb.files.read("/tmp/real.txt", user="root") == body
        got = sb.files.read("/tmp/link.txt", user="root")
        assert got == body, f"read through a symlink gave {len(got)} bytes of {len(body)}"
    finally:
        sb.kill()
