"""B11: ``files.write(path, data, user="user")`` with a path that holds ``..`` after a
symlink: the user check (``_MAY_WRITE``, an exec: the kernel resolves ``..`` physically,
after following the symlink) and root's write (the edge's ``split_path``: ``..`` removed
*lexically* before anything is opened) look at two different directories. No race: the
agent makes ``/tmp/u/l -> /tmp/u/a/b/c`` and ``/tmp/u/etc/``; for
``/tmp/u/l/../../../etc/passwd`` the check sees ``/tmp/u/etc`` (the user's, writable) and
root writes ``/etc/passwd``. A harness passes ``user=`` exactly when the path is the
agent's to choose ("write your answer where you said").

Secure behaviour: the check and the write name the same file (refuse ``..``, or resolve
once, physically, and use that)."""

from __future__ import annotations

import pytest

from dsec.bench._e2b_calls import E2BTarget

pytestmark = pytest.mark.root


def test_user_write_with_dotdot_after_a_symlink_stays_where_the_user_may_write(
        e2b_target: E2BTarget) -> None:
    from e2b import Sandbox

    sb = Sandbox.create(e2b_target.template, timeout=120, **e2b_target.opts())
    try:
        sb.commands.run("mkdir -p /tmp/u && chown user /tmp/u", user="root")
        sb.commands.run("mkdir -p /tmp/u/a/b/c /tmp/u/etc && ln -s /tmp/u/a/b/c /tmp/u/l",
                        user="user")                  # the agent, as itself
        before = sb.files.read("/etc/passwd", user="root")
        try:
            sb.files.write("/tmp/u/l/../../../etc/passwd", "pwned\n", user="user")
        except Exception:  # noqa: BLE001, S110 - any refusal will do
            pass
        after = sb.files.read("/etc/passwd", user="root")
        assert after == before, f"root wrote /etc/passwd for user=: {after[:40]!r}"
    finally:
        sb.kill()


def test_user_list_with_dotdot_after_a_symlink_lists_what_the_user_may_list(
        e2b_target: E2BTarget) -> None:
    """The same for ``files.list(user=...)``: the edge's ``list`` normalises lexically too
    (``split_path``), so ``/tmp/u/l/../../../srv/task/hidden-tests`` is checked as the
    agent's own ``/tmp/u/srv/task/hidden-tests`` and listed as the root-only one."""
    from e2b import Sandbox

    sb = Sandbox.create(e2b_target.template, timeout=120, **e2b_target.opts())
    try:
        sb.commands.run("mkdir -p /tmp/u /srv/task/hidden-tests && chown user /tmp/u && "
                        ": > /srv/task/hidden-tests/expected-42 && "
                        "chmod 700 /srv/task/hidden-tests", user="root")
        sb.commands.run("mkdir -p /tmp/u/a/b/c /tmp/u/srv/task/hidden-tests && "
                        "ln -s /tmp/u/a/b/c /tmp/u/l", user="user")
        try:
            names = [e.name for e in sb.files.list(
                "/tmp/u/l/../../../srv/task/hidden-tests", user="user")]
        except Exception as exc:  # noqa: BLE001 - any refusal will do
            names = [f"refused: {exc}"]
        assert "expected-42" not in names, f"root-only entries listed for user=: {names}"
    finally:
        sb.kill()
