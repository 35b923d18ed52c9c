"""The port proxy's pure rules (dsec.control.proxy): which request headers reach a
sandbox, which response headers reach the client, and the tunnel shares. The end-to-end
forms are in test_ports_redteam.py; these pin every case of the tables."""

from __future__ import annotations

import pytest

from dsec.control.api.service import api_key_of
from dsec.control.proxy import (
    CSP_SANDBOX,
    TunnelShares,
    inbound_headers,
    outbound_headers,
)
from dsec.errors import PermissionDenied, RateLimited, Unauthenticated, Unavailable

KEY = "dsk_0123456789abcdef_secretsecretsecret"


@pytest.mark.parametrize("value", [KEY, f"Bearer {KEY}", f"bearer  {KEY}",
                                   f"BEARER {KEY}  ", f"Bearer {KEY}\t"])
def test_every_spelling_the_apiserver_accepts_is_taken_and_never_forwarded(
        value: str) -> None:
    assert api_key_of(value) == KEY
    inb = inbound_headers([(b"authorization", value.encode()), (b"accept", b"*/*")])
    assert inb.authorization == value
    assert inb.fwd == [(b"accept", b"*/*")]


@pytest.mark.parametrize("value", ["Basic dXNlcjpwYXNz", f"Token {KEY}", f"Digest {KEY}"])
def test_another_scheme_is_not_a_credential_and_not_forwarded_either(value: str) -> None:
    with pytest.raises(Unauthenticated):
        api_key_of(value)
    inb = inbound_headers([(b"authorization", value.encode())])
    assert inb.authorization is None and inb.fwd == []


def test_tokens_cookies_and_forged_forwarding_headers_are_removed() -> None:
    inb = inbound_headers([
        (b"x-dsec-token", b"v1.tok"), (b"proxy-authorization", f"Bearer {KEY}".encode()),
        (b"cookie", b"a=1; dsec_token=v1.cookie; b=2"), (b"x-forwarded-for", b"10.0.0.1"),
        (b"forwarded", b"for=10.0.0.1"), (b"x-real-ip", b"10.0.0.1"),
        (b"referer", b"http://api/v1/proxy/sb/80/x?a=1&dsec%5Ftoken=v1.ref&b=2"),
        (b"user-agent", b"ua")])
    assert inb.token == "v1.tok"          # the header wins over the cookie
    assert inb.fwd == [(b"referer", b"http://api/v1/proxy/sb/80/x?a=1&b=2"),
                       (b"user-agent", b"ua")]
    assert inbound_headers([(b"cookie", b"dsec_token=v1.c")]).token == "v1.c"


def test_a_service_worker_script_fetch_is_refused() -> None:
    with pytest.raises(PermissionDenied, match="service workers"):
        inbound_headers([(b"service-worker", b"script")])


def test_origin_wide_response_headers_are_dropped_and_csp_sandbox_added() -> None:
    sent = [(b"Content-Type", b"text/html"), (b"Set-Cookie", b"a=1; Path=/"),
            (b"set-cookie2", b"b=1"), (b"Clear-Site-Data", b'"*"'),
            (b"Strict-Transport-Security", b"max-age=1"), (b"Alt-Svc", b'h2=":443"'),
            (b"NEL", b"{}"), (b"Report-To", b"{}"), (b"Service-Worker-Allowed", b"/"),
            (b"Access-Control-Allow-Origin", b"null"),
            (b"Access-Control-Allow-Credentials", b"true"),
            (b"Link", b'</sw.js>; rel="serviceworker"'), (b"Link", b"</a.css>; rel=preload"),
            (b"Content-Security-Policy", b"default-src 'self'"), (b"Date", b"x"),
            (b"Transfer-Encoding", b"chunked"), (b"X-App", b"1")]
    out = outbound_headers(sent)
    assert out == [(b"content-type", b"text/html"), (b"link", b"</a.css>; rel=preload"),
                   (b"content-security-policy", b"default-src 'self'"), (b"x-app", b"1"),
                   (b"content-security-policy", CSP_SANDBOX)]
    assert CSP_SANDBOX.split()[0] == b"sandbox" and b"allow-same-origin" not in CSP_SANDBOX
    # a public CORS answer (never credentialed) passes
    assert (b"access-control-allow-origin", b"*") in outbound_headers(
        [(b"Access-Control-Allow-Origin", b"*")])


def test_shares_refuse_naming_the_share_and_give_places_back() -> None:
    sh = TunnelShares(8)
    assert sh.limits() == (1, 2, 2)
    a = sh.take("sb-a", "p1", "1.1.1.1")
    with pytest.raises(RateLimited, match=r"sandbox 'sb-a' .* share is 1 of 8 "
                                          r"\(RestConfig.proxy_tunnels_per_sandbox\)"):
        sh.take("sb-a", "p1", "2.2.2.2")
    b = sh.take("sb-b", "p1", "2.2.2.2")
    with pytest.raises(RateLimited, match="project 'p1' .*proxy_tunnels_per_project"):
        sh.take("sb-c", "p1", "3.3.3.3")
    c = sh.take("sb-c", "p2", "1.1.1.1")
    with pytest.raises(RateLimited, match="client address '1.1.1.1'"):
        sh.take("sb-d", "p3", "1.1.1.1")
    assert sh.open == 3
    for lease in (a, b, c, c):           # released twice: counted once
        sh.release(lease)
    assert sh.open == 0 and not sh.by_sandbox and not sh.by_project and not sh.by_client
    full = TunnelShares(2, per_sandbox=5, per_project=5, per_client=5)
    full.take("x", "p", "c")
    full.take("y", "p", "c")
    with pytest.raises(Unavailable, match="max_proxy_tunnels"):
        full.take("z", "q", "d")
    # the edge never takes more than 256 per sandbox: the derived share stays below it
    assert TunnelShares(4096).limits() == (256, 1024, 1024)
