"""B10: ``files.list(path, depth=N, user="user")`` checks only ``path`` as the user
(``_MAY_LIST``: ``[ -r ] && [ -x ]``), then ``_walk`` lists every directory below it
with root's rights. So a user lists a directory it may read, and the walk at depth 2 lists the
contents of a mode-700 root directory below it (hidden tests, answers) and of any other directory the user may not read - no
race needed. The walk has no bound on the entries it gathers either (each level's
list_dir is whole; the sum sits in the apiserver as one JSON reply, uncharged: B2).

Secure behaviour: a directory the user may not list is not descended into (or each
level is listed as the user)."""

from __future__ import annotations

import pytest

from dsec.bench._e2b_calls import E2BTarget

pytestmark = pytest.mark.root


def test_user_listing_does_not_descend_where_the_user_may_not_list(
        e2b_target: E2BTarget) -> None:
    from e2b import Sandbox

    sb = Sandbox.create(e2b_target.template, timeout=120, **e2b_target.opts())
    try:
        sb.commands.run("mkdir -p /srv/task/hidden-tests && "
                        ": > /srv/task/hidden-tests/expected-42 && chmod 755 /srv/task && "
                        "chmod 700 /srv/task/hidden-tests", user="root")
        out = sb.commands.run("ls /srv/task/hidden-tests 2>&1 || true", user="user").stdout
        assert "expected-42" not in out             # the user cannot list it itself
        names = [e.path for e in sb.files.list("/srv/task", depth=2, user="user")]
        leaked = [n for n in names if "expected-42" in n]
        assert leaked == [], f"files.list(user='user') showed root-only entries: {leaked}"
    finally:
        sb.kill()
