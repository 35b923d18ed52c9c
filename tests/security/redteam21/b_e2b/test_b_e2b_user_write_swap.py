"""B1: ``files.write(path, data, user="user")`` through the E2B layer is three steps: a
check as the user (``_MAY_WRITE``: may they write in the parent?), root's write of the
bytes (``file_write_stream``, symlinks resolved inside the sandbox's root), then root's
chown (``CHOWN_SCRIPT``, which refuses a directory swapped for a symlink). A hostile agent
running as ``user`` owns the parent directory, so it swaps it for a symlink to /etc between
the check and the write: root then writes the caller's bytes into /etc (here replacing
/etc/passwd), and only the chown afterwards is refused - the file stays written.
docs/e2b.md says a swapped directory "is refused".

The race is made deterministic by running the agent's swap right after the user check
returns (what a looping agent wins within a few tries)."""

from __future__ import annotations

import pytest

from dsec.bench._e2b_calls import E2BTarget

pytestmark = pytest.mark.root


def test_user_write_into_a_swapped_directory_writes_nothing_as_root(
        e2b_target: E2BTarget, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec.control import filedoors
    from dsec.wire import ops
    from dsec.wire.calls import ExecCall
    from dsec.wire.spec import ExecRequest
    from e2b import Sandbox

    # The agent wins the race right before root's (now: the user's) write: the hook sits
    # on the write itself (filedoors.write_chunks), which came after the user check in
    # the code this repro was written against, and is the only step now (fxuser: the
    # write runs as the user on the edge; there is no check left to race after).
    real_write = filedoors.write_chunks
    swapped: list[str] = []

    async def write_chunks(service, caller, req, chunks):  # type: ignore[no-untyped-def]
        if req.path == "/tmp/u/d/passwd" and not swapped:
            # the agent (uid "user") wins the race: its directory becomes a symlink
            swapped.append("/tmp/u/d")
            await service.handler(ops.EXEC)(caller, ExecCall(id=req.id, req=ExecRequest(
                argv=("/bin/sh", "-c", 'mv -- "$1" "$1.real" && ln -s /etc "$1"', "sh",
                      "/tmp/u/d"), user="user", timeout_s=30.0)))
        return await real_write(service, caller, req, chunks)

    monkeypatch.setattr(filedoors, "write_chunks", write_chunks)
    sb = Sandbox.create(e2b_target.template, timeout=120, **e2b_target.opts())
    try:
        sb.commands.run("mkdir -p /tmp/u/d && chown -R user /tmp/u", user="root")
        before = sb.files.read("/etc/passwd", user="root")
        assert "root:" in before
        try:
            sb.files.write("/tmp/u/d/passwd", "pwned-by-the-agent\n", user="user")
        except Exception:  # noqa: BLE001, S110 - any refusal will do
            pass        # the chown's refusal: expected, but not enough
        assert swapped == ["/tmp/u/d"]
        after = sb.files.read("/etc/passwd", user="root")   # no exec: a user lookup
        assert after == before, (
            "root wrote the user's file through the swapped directory into /etc/passwd: "
            f"{after[:80]!r}")
    finally:
        sb.kill()
