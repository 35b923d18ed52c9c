"""Per-sandbox access tokens of the E2B layer (red team 21, B8): what the create, connect
and detail answers hand out as ``envdAccessToken`` and ``trafficAccessToken`` instead of
the caller's API key.

E2B's tokens are per sandbox: the envd token opens that sandbox's envd, the traffic token
its ports (the one users hand to browsers and previews). Handing out the caller's API key
there gave whoever got "the token of one sandbox" the whole key (every sandbox of every
project it reaches, create, destroy, keys). A token here is the caller's key sealed with
AES-256-GCM under a key of the apiserver's, the sandbox id and the token's scope bound as
associated data:

- only the apiserver opens it (no one learns the key from it), and only for that
  sandbox and scope: a token of sandbox A names nothing on sandbox B, an envd token is
  not a traffic token and the other way round, and neither is an API key anywhere
  (``dse2b1.`` never parses as ``dsk_...``);
- opened, it is the caller's key again, authenticated like any key: a revoked key's
  tokens stop working, the principal's roles apply as they are now, and the code
  interpreter still picks the kernel dsec's own SDK reaches with that key
  (:func:`dsec.code._token` derives it from the key).

The key is derived from the port-URL key (``ApiConfig.port_token_key``: the state dir's
``port-token.key``, the ``dsec-port-token-key`` Secret on Kubernetes), so tokens survive
an apiserver restart and every replica opens every other's. Pure: no I/O; the nonce
source is injected.

Opened tokens are remembered (a bounded LRU of :data:`OPENED_CACHE` entries, keyed by
the whole token string: every ``commands.run`` sends the same one, and AES-GCM plus the
base64 was ~7% of the layer's time per call). A hit still checks the sandbox and the
scope the token was opened for against the request's, so a cached token opens nothing
it would not open sealed; only genuine tokens are cached (a refused one is opened, and
refused, every time); and what it yields is the API key, which the caller still
authenticates per request (a revoked key's tokens stop working as before)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Final, Literal

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from dsec.errors import Unauthenticated

__all__ = ["PREFIX", "SandboxTokens", "Scope", "is_token"]

Scope = Literal["envd", "traffic"]
#: What every token starts with (never a dsec API key's ``dsk_``).
PREFIX: Final = "dse2b1."
_SCOPES: Final = ("envd", "traffic")
_NONCE = 12
_MAX_TOKEN_CHARS = 512          # a sealed key is ~130 characters
_MAX_KEY_BYTES = 256
#: Opened tokens remembered (each entry ~0.5 KiB: the token, the key, two short strings).
OPENED_CACHE: Final = 4096


def is_token(value: str) -> bool:
    """``value`` is shaped like one of these tokens (not an API key)."""
    return value.startswith(PREFIX)


def _aad(scope: str, sandbox_id: str) -> bytes:
    return f"dsec-e2b-token\0{scope}\0{sandbox_id}".encode()


class SandboxTokens:
    """Seals an API key into a token for (sandbox, scope), and opens it again."""

    def __init__(self, secret: bytes, *,
                 nonce: Callable[[int], bytes] = os.urandom) -> None:
        if len(secret) < 16:
            raise ValueError("the E2B token secret needs at least 16 bytes")
        # a key of its own (never the port-URL key itself: one key, one use)
        self._aead = AESGCM(hmac.new(secret, b"dsec-e2b-sandbox-token-v1",
                                     hashlib.sha256).digest())
        self._nonce = nonce
        # token -> (sandbox id, scope, API key) of a token this instance opened
        self._opened: OrderedDict[str, tuple[str, str, str]] = OrderedDict()

    def mint(self, api_key: str, sandbox_id: str, scope: Scope) -> str:
        """The ``scope`` token of ``sandbox_id`` for the caller holding ``api_key``."""
        raw = api_key.encode()
        if not raw or len(raw) > _MAX_KEY_BYTES:
            raise ValueError("an E2B token seals a non-empty API key of at most "
                             f"{_MAX_KEY_BYTES} bytes")
        n = self._nonce(_NONCE)
        sealed = self._aead.encrypt(n, raw, _aad(scope, sandbox_id))
        return f"{PREFIX}{scope}.{base64.urlsafe_b64encode(n + sealed).rstrip(b'=').decode()}"

    def open(self, token: str, sandbox_id: str, scopes: Collection[Scope]) -> str:
        """The API key ``token`` seals, if it is a genuine token of ``sandbox_id`` with one
        of ``scopes``; else :class:`Unauthenticated` (never echoing the token)."""
        hit = self._opened.get(token)
        if hit is not None and hit[0] == sandbox_id and hit[1] in scopes:
            self._opened.move_to_end(token)
            return hit[2]
        if len(token) > _MAX_TOKEN_CHARS or not is_token(token):
            raise Unauthenticated("malformed E2B access token: use the envdAccessToken / "
                                  "trafficAccessToken the create or connect answer gave")
        scope, _, body = token[len(PREFIX):].partition(".")
        if scope not in _SCOPES:
            raise Unauthenticated("malformed E2B access token: unknown scope")
        if scope not in scopes:
            raise Unauthenticated(
                f"an E2B {scope} access token is not accepted here (this route takes "
                + " or ".join(f"the {s} token" for s in scopes)
                + " of its sandbox, or an API key)")
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except (binascii.Error, ValueError):
            raise Unauthenticated("malformed E2B access token") from None
        if len(raw) <= _NONCE + 16:
            raise Unauthenticated("malformed E2B access token")
        try:
            key = self._aead.decrypt(raw[:_NONCE], raw[_NONCE:], _aad(scope, sandbox_id))
        except InvalidTag:
            raise Unauthenticated(
                f"this E2B access token is not valid for sandbox {sandbox_id[:80]} (a token "
                "opens only the sandbox whose create or connect answer gave it)") from None
        api_key = key.decode("utf-8", "replace")
        self._opened[token] = (sandbox_id, scope, api_key)
        if len(self._opened) > OPENED_CACHE:
            self._opened.popitem(last=False)
        return api_key
