"""B4: ``files.read(path, user="user")`` through the E2B layer checks as the user
(``_MAY_READ``: ``[ -r "$1" ]``, an exec as them) and then reads with root's rights
(dsec's streamed read, symlinks followed inside the sandbox). A hostile agent running as
``user`` owns the file it asks the harness to read (its output, its answer), so between
the check and the read it swaps it for a symlink to a root-only file - the hidden test
or answer file an RL environment keeps from its agent with permissions - and the harness
gets that file's bytes as "the user's file" (and typically shows them to the agent or
grades them). The same shape holds for ``files.list(user=...)`` (``_MAY_LIST``, then
root's listing).

The race is made deterministic by running the agent's swap right after the user check
returns (what a looping agent wins within a few tries)."""

from __future__ import annotations

import pytest

from dsec.bench._e2b_calls import E2BTarget

pytestmark = pytest.mark.root

SECRET = "hidden-answer-42\n"


def test_user_read_never_returns_what_the_user_may_not_read(
        e2b_target: E2BTarget, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec.control import filedoors
    from dsec.wire import ops
    from dsec.wire.calls import ExecCall
    from dsec.wire.spec import ExecRequest
    from e2b import Sandbox

    # The agent wins the race right before the read: the hook sits on the read itself
    # (filedoors.sized_read), which came after the user check in the code this repro was
    # written against, and is the first step now (fxuser: the read runs as the user on
    # the edge; there is no check left to race after).
    real_read = filedoors.sized_read
    swapped: list[str] = []

    async def sized_read(service, caller, req):  # type: ignore[no-untyped-def]
        if req.path == "/tmp/w/out.txt" and not swapped:
            swapped.append(req.path)     # the agent (uid "user") wins the race
            await service.handler(ops.EXEC)(caller, ExecCall(id=req.id, req=ExecRequest(
                argv=("/bin/sh", "-c", 'ln -sf /root/answer "$1"', "sh", req.path),
                user="user", timeout_s=30.0)))
        return await real_read(service, caller, req)

    monkeypatch.setattr(filedoors, "sized_read", sized_read)
    sb = Sandbox.create(e2b_target.template, timeout=120, **e2b_target.opts())
    try:
        sb.files.write("/root/answer", SECRET, user="root")
        sb.commands.run("chmod 700 /root && chmod 600 /root/answer && "
                        "mkdir -p /tmp/w && echo mine > /tmp/w/out.txt && "
                        "chown -R user /tmp/w", user="root")
        denied = sb.commands.run("cat /root/answer 2>&1 || true", user="user").stdout
        assert SECRET.strip() not in denied            # the agent cannot read it itself
        try:
            got = sb.files.read("/tmp/w/out.txt", user="user")
        except Exception as exc:  # noqa: BLE001 - any refusal will do
            got = f"refused: {exc}"
        assert swapped == ["/tmp/w/out.txt"]
        # the read's length is the symlink's own size (12 bytes here: the agent pads or
        # shortens the link's target to choose how much of the file it gets)
        assert "hidden-answe" not in got, (
            "files.read(user='user') returned a root-only file the user swapped in after "
            f"the check: {got!r}")
    finally:
        sb.kill()
