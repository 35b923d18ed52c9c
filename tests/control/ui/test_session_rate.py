"""The dashboard's pure parts: the session cookie, CSRF token and origin rule
(dsec.control.ui.session) and the creation-rate series (dsec.control.ui.rate)."""

from __future__ import annotations

import pytest

from dsec.control.ui.rate import CreationSeries
from dsec.control.ui.session import (
    csrf_ok,
    csrf_token,
    plausible_key,
    same_origin,
    session_cookie,
)

KEY = "dsk_0123456789abcdef_" + "A" * 43
OTHER = "dsk_0123456789abcdef_" + "B" * 43


def test_the_cookie_is_httponly_strict_and_scoped() -> None:
    c = session_cookie(KEY, secure=True)
    assert c.startswith(f"dsec_ui={KEY};")
    for attr in ("HttpOnly", "SameSite=Strict", "Path=/ui", "Secure"):
        assert attr in c.split("; ")
    assert "Secure" not in session_cookie(KEY, secure=False)
    for bad in (KEY + "; Path=/", "dsk_x", KEY + " ", "a=b", ""):
        assert not plausible_key(bad)
        with pytest.raises(ValueError):
            session_cookie(bad, secure=False)


def test_the_csrf_token_is_the_keys_own() -> None:
    t = csrf_token(KEY)
    assert KEY not in t and "A" * 8 not in t
    assert csrf_ok(KEY, t)
    assert not csrf_ok(OTHER, t)
    assert not csrf_ok(KEY, None) and not csrf_ok(KEY, "") and not csrf_ok(KEY, t[:-1])


@pytest.mark.parametrize(("headers", "ok"), [
    ({"host": "h:1", "origin": "http://h:1", "sec-fetch-site": "same-origin"}, True),
    ({"host": "h:1", "origin": "https://H:1"}, True),
    ({"host": "h:1", "origin": "http://h:2"}, False),
    ({"host": "h:1", "origin": "http://evil.h:1"}, False),
    ({"host": "h:1", "origin": "null"}, False),
    ({"host": "h:1"}, False),                                 # no Origin on a POST
    ({"host": "h:1", "origin": "http://h:1", "sec-fetch-site": "cross-site"}, False),
    ({"host": "h:1", "origin": "http://h:1", "sec-fetch-site": "same-site"}, False),
    ({"origin": "http://h:1"}, False),                        # no Host
    ({"host": "h:1", "origin": "javascript://h:1"}, False),
])
def test_same_origin(headers: dict[str, str], ok: bool) -> None:
    assert same_origin(headers, require_origin=True) is ok


def test_the_series_counts_per_bucket_and_only_visible_projects() -> None:
    s = CreationSeries(bucket_s=60, window_s=600)
    now = 6000.0
    for t, p in [(5460.0, "a"), (5999.0, "a"), (5999.0, "b"), (5940.0, "a/x"),
                 (5459.0, "a"),           # before the window: dropped
                 (9000.0, "a")]:          # from the future: dropped
        s.add(t, p, now)
    pts = s.series(lambda p: p == "a" or p.startswith("a/"), now)
    assert len(pts) == 10 and pts[0].start == 5460.0 and pts[-1].start == 6000.0
    assert [p.count for p in pts] == [1, 0, 0, 0, 0, 0, 0, 0, 2, 0]
    assert sum(p.count for p in s.series(lambda p: p == "b", now)) == 1
    assert sum(p.count for p in s.series(lambda p: False, now)) == 0
    # time moves on: old buckets fall out of the window and are dropped
    later = s.series(lambda p: True, now + 600)
    assert sum(p.count for p in later) == 0 and not s._buckets
