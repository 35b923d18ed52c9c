"""The dashboard's login session and request checks: pure functions, no I/O.

The session *is* the API key, kept by the browser in an ``HttpOnly; SameSite=Strict``
cookie scoped to ``/ui``: never in a URL, never where a script can read it. Every page
and action authenticates it again through ``ApiService.authenticate`` (the same cache,
rate limit and revocation as REST), so the dashboard keeps no session table: any
apiserver replica serves any page, a restart logs nobody out, and revoking the key ends
the session within the principal cache time (5 s) everywhere. A server-side session id
would need a store shared by the replicas and would outlive a revoked key unless that
store were told.

CSRF: the cookie is ``SameSite=Strict`` (a cross-site request carries no session), every
state-changing POST must carry the page's token (``csrf_token``: an HMAC of the fixed
string under the key, so it is stateless too and says nothing of the key), and every POST
and WebSocket handshake must come from this origin (``same_origin``: ``Origin`` equal to
the request's host, ``Sec-Fetch-Site`` same-origin when the browser sends it). The login
form has no session to derive a token from: the origin check covers it (a cross-site
page cannot log a victim into the attacker's key).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from urllib.parse import urlsplit

__all__ = [
    "COOKIE", "COOKIE_PATH", "SESSION_MAX_AGE_S", "clear_cookie", "csrf_ok", "csrf_token",
    "plausible_key", "same_origin", "session_cookie",
]

COOKIE = "dsec_ui"
COOKIE_PATH = "/ui"
SESSION_MAX_AGE_S = 12 * 3600

# An API key is `dsk_<16 hex>_<43 urlsafe base64>`; the cookie only ever holds something
# of that shape (a cookie value must not carry ';', ',', spaces or quotes).
_KEY = re.compile(r"dsk_[0-9a-f]{16}_[A-Za-z0-9_-]{20,128}")


def plausible_key(text: str) -> bool:
    """Whether ``text`` has the shape of an API key (checked before it becomes a cookie;
    whether it is a valid key is the IAM's question)."""
    return _KEY.fullmatch(text) is not None


def session_cookie(api_key: str, *, secure: bool) -> str:
    """The ``Set-Cookie`` value that logs the browser in."""
    if not plausible_key(api_key):
        raise ValueError("not an API key")
    attrs = [f"{COOKIE}={api_key}", f"Path={COOKIE_PATH}", "HttpOnly", "SameSite=Strict",
             f"Max-Age={SESSION_MAX_AGE_S}"]
    if secure:
        attrs.append("Secure")
    return "; ".join(attrs)


def clear_cookie(*, secure: bool) -> str:
    """The ``Set-Cookie`` value that logs the browser out."""
    attrs = [f"{COOKIE}=", f"Path={COOKIE_PATH}", "HttpOnly", "SameSite=Strict", "Max-Age=0"]
    if secure:
        attrs.append("Secure")
    return "; ".join(attrs)


def csrf_token(api_key: str) -> str:
    """The token every POST form of this session carries: HMAC-SHA256 of a fixed label
    under the key. The key is 32 random bytes, so the token neither reveals it nor can be
    forged without it, and any replica computes the same one."""
    return hmac.new(api_key.encode(), b"dsec-ui-csrf-v1", hashlib.sha256).hexdigest()


def csrf_ok(api_key: str, sent: str | None) -> bool:
    return sent is not None and hmac.compare_digest(sent.encode(), csrf_token(api_key).encode())


def same_origin(headers: Mapping[str, str], *, require_origin: bool) -> bool:
    """Whether a request comes from a page of this origin: ``Sec-Fetch-Site`` (when sent)
    is ``same-origin`` (or ``none``: typed by the user), and ``Origin`` names the host the
    request was sent to. Browsers send ``Origin`` on every POST and WebSocket handshake;
    ``require_origin`` refuses a request without one (a non-browser client uses REST)."""
    site = headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = headers.get("origin")
    if origin is None or origin == "null":
        return not require_origin and origin is None
    host = headers.get("host")
    if not host:
        return False
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()
