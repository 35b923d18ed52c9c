"""The REST door's server, checked the way the `api` bench compares candidates (issue 13,
plan 5.2): a server becomes the default only if it holds every check of
``dsec.bench.api.CHECKS`` with the real app, edge and sandbox behind it."""

from __future__ import annotations

import pytest

from dsec.bench.api import CHECKS, _wrk_percentile, check_server


def test_uvicorn_as_shipped_passes_every_check() -> None:
    res = check_server("uvicorn")
    failed = {c: res[c][1] for c in CHECKS if not res[c][0]}
    assert not failed, failed


def test_granian_cannot_hold_the_per_address_cap() -> None:
    """Why granian is not the default: its Rust accept loop gives no hook per connection,
    so an idle flood from one address is never refused (issue 12's fix). The other
    checks pass against it, so the probe itself is sound; if granian grows the hook this
    test fails and the decision in docs/api.md is to be made again."""
    pytest.importorskip("granian")
    res = check_server("granian")
    assert not res["per_address_cap"][0], res["per_address_cap"]
    assert "0 of the 6 over it refused" in res["per_address_cap"][1]
    for c in ("keep_alive", "body_limit", "header_limit", "idle_timeout", "sigterm_drain"):
        assert res[c][0], (c, res[c])


def test_wrk_latency_percentiles_are_read_in_ms() -> None:
    out = ("  Latency Distribution\n     50%  844.00us\n     75%    1.19ms\n"
           "     90%    1.63ms\n     99%    2.55s\n")
    assert _wrk_percentile(out, "50") == pytest.approx(0.844)
    assert _wrk_percentile(out, "99") == pytest.approx(2550.0)
    with pytest.raises(ValueError, match="no 95% line"):
        _wrk_percentile(out, "95")
