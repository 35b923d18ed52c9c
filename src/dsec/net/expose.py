"""URL tokens and URL shapes of exposed ports (pure: injected key and clock, no I/O).

A token lets whoever holds the URL reach one exposed port of one sandbox, without an
API key, until it expires or the port closes:

    token = "v1." gen "." expiry "." base64url(HMAC-SHA256(key, "dsec-port\\0" sid "\\0"
            port "\\0" gen "\\0" expiry))

``gen`` is the port's generation at the edge (new each time the port is opened), so
closing the port or destroying the sandbox makes every token of it worthless: the edge
refuses a tunnel for any other generation. The apiserver checks the MAC in constant
time before it asks the edge anything; a forged or altered token (another sandbox,
port, generation or a later expiry) fails the MAC. Any apiserver replica holding the
same key verifies it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from dataclasses import dataclass
from typing import Final

from dsec.errors import PermissionDenied, Unauthenticated

__all__ = ["PROXY_PREFIX", "TOKEN_PARAM", "TokenKey", "proxy_path"]

#: Where the apiserver serves exposed ports: ``/v1/proxy/{id}/{port}/...``.
PROXY_PREFIX: Final = "/v1/proxy/"
#: The query parameter (and, as ``X-Dsec-Token``, the header) carrying a token.
TOKEN_PARAM: Final = "dsec_token"

_TOKEN = re.compile(r"v1\.([0-9]{1,20})\.([0-9]{1,12})\.([A-Za-z0-9_-]{43})")


def proxy_path(sandbox_id: str, port: int) -> str:
    return f"{PROXY_PREFIX}{sandbox_id}/{port}/"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


@dataclass(frozen=True, slots=True)
class TokenKey:
    """The cluster's key for port URL tokens (32 random bytes)."""

    key: bytes

    def __post_init__(self) -> None:
        if len(self.key) < 16:
            raise ValueError("a port token key needs at least 16 bytes")

    def _mac(self, sandbox_id: str, port: int, generation: int, expiry: int) -> str:
        msg = f"dsec-port\0{sandbox_id}\0{port}\0{generation}\0{expiry}".encode()
        return _b64(hmac.new(self.key, msg, hashlib.sha256).digest())

    def mint(self, sandbox_id: str, port: int, generation: int, expiry: float) -> str:
        """A token for (sandbox, port, generation) valid until ``expiry`` (unix seconds)."""
        exp = int(expiry)
        return f"v1.{generation}.{exp}.{self._mac(sandbox_id, port, generation, exp)}"

    def verify(self, token: str, sandbox_id: str, port: int, now: float) -> int:
        """The generation a genuine, unexpired token for (sandbox, port) names; raises
        Unauthenticated for a malformed or forged one, PermissionDenied once expired."""
        m = _TOKEN.fullmatch(token)
        if m is None:
            raise Unauthenticated("malformed port token: use the URL port_expose answered")
        gen, exp = int(m.group(1)), int(m.group(2))
        if not hmac.compare_digest(m.group(3), self._mac(sandbox_id, port, gen, exp)):
            raise Unauthenticated(
                f"this token is not valid for port {port} of sandbox {sandbox_id}")
        if exp <= now:
            raise PermissionDenied(
                f"the token for port {port} of sandbox {sandbox_id} expired; call "
                "port_expose (sb.ports.expose) again for a fresh URL")
        return gen
