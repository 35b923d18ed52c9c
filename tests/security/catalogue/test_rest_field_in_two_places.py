"""A request field given twice on REST with two values must be refused, not settled
silently. ``POST /v1/sandboxes`` takes ``session`` as a query parameter (the row's form,
which the SDK sends) and, for older clients, in the JSON body; given both, the body's
wins without a word (``?session=s1`` with ``{"session": "s2"}`` binds the sandbox to s2's
lease), while every row served by the generic route refuses a parameter its row does not
name. The sandbox lives and dies with a lease the caller did not mean.

Branch i13d: control/apiserver.py ``create`` (by-hand route: ``if session is not None and
body.session is None``). Also fails on main (a30dd26)."""

from __future__ import annotations

from tests.security.catalogue.conftest import Doors


def test_session_in_query_and_body_that_disagree_is_refused(doors: Doors) -> None:
    t = doors.tenant("sess2", "default/sess2")
    ans = doors.rest("POST", "/v1/sandboxes?session=ses-aaaaaaaaaaaaaaaa", t,
                     json={"session": "ses-bbbbbbbbbbbbbbbb"})
    bound = None if ans.code != "ok" else ans.value["spec"]["labels"].get("dsec.io/session")
    assert ans.status == 400, (
        f"session given twice (query ses-aaaa..., body ses-bbbb...): {ans.status}, the "
        f"sandbox is bound to {bound}")
