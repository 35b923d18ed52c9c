"""``http(s)://host[:port][/prefix]``: any web server that answers ``Range`` GETs.

Reads are ``GET`` with ``Range: bytes=a-b``, checked to the byte: the answer must be
``206`` with ``Content-Range: bytes a-b/total`` naming exactly the range asked and a
body of exactly ``b-a+1`` bytes. A short or cut body, a 5xx, a 429, a refused or reset
connection and a timeout are :class:`~dsec.errors.BlobUnavailable` and retried within
:class:`~dsec.image.blob.retry.RetryPolicy`'s bound; a server that ignores ``Range``
(``200`` with the whole object) is a misconfigured server, refused as
:class:`~dsec.errors.RemoteProtocolError`, not read whole.

Writes are WebDAV ``PUT``/``DELETE`` (nginx: ``dav_methods PUT DELETE;
create_full_put_path on;``): nginx receives a PUT body into ``client_body_temp_path``
and renames it into place, so an object is visible whole or not at all - provided that
temp path is on the same filesystem as the served root (else it copies). A read-only
server answers 405 and a push says so.

Measured (nginx on loopback, 256 KiB ranged GETs one at a time, loaded 2-core machine):
this client costs 0.64-0.92 ms of CPU per GET (raw ``httpx.get`` the same, 0.69-0.8:
the cost is httpx's), obstore's ``HTTPStore`` 0.08-0.11 ms, p50 0.8-4 ms vs 0.12-0.15
ms. httpx stays for now because its answers are checked here to the byte (206 +
Content-Range + body length; a server ignoring Range refused, redirects not followed:
reqwest under obstore follows them by default); moving reads to obstore with those
checks is the next step if a node's fetch CPU shows up in the lazy bench.

Redirects are not followed: the URL is an operator's setting (``--blob-store``), and a
redirect would send a node to a host nobody configured (docs/images.md). Credentials:
``token=`` or ``$DSEC_BLOB_TOKEN`` as ``Authorization: Bearer``; never in the URL.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from typing import Any, NoReturn
from urllib.parse import quote, urlsplit

import httpx

from dsec.errors import (
    BlobNotFound,
    BlobUnavailable,
    InvalidArgument,
    PermissionDenied,
    RemoteProtocolError,
)
from dsec.image.blob.keys import check_key
from dsec.image.blob.retry import DEFAULT_RETRY, RetryPolicy

__all__ = ["TOKEN_ENV", "HttpBlobStore"]

TOKEN_ENV = "DSEC_BLOB_TOKEN"
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_UPLOAD_PIECE = 1 << 20


class HttpBlobStore:
    """Objects under ``base_url`` (``<base_url>/<key>``). Thread-safe (one httpx pool)."""

    def __init__(self, *, base_url: str, token: str | None = None,
                 timeout_s: float = 30.0, connect_timeout_s: float = 5.0,
                 min_bytes_per_s: float = 256 * 1024,
                 max_connections: int = 32, verify: bool | str = True,
                 retry: RetryPolicy = DEFAULT_RETRY,
                 transport: httpx.BaseTransport | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgument(f"HTTP blob store URL {base_url[:200]!r}: use "
                                  "http(s)://host[:port][/prefix]")
        if parts.username or parts.password or parts.query or parts.fragment:
            raise InvalidArgument(
                "HTTP blob store URL: no credentials, query or fragment in it (a URL is "
                f"printed in logs, errors and ps); pass a token in ${TOKEN_ENV}")
        self.base = base_url.rstrip("/")
        self.url = self.base
        self.retry = retry
        # One attempt's wall-clock bound: httpx's timeout is between two reads, so a
        # store (or a middlebox) trickling a byte a second would hold a 256 KiB read for
        # days and the retry deadline, checked only between attempts, never fires (F8 of
        # red team 17). An attempt gets timeout_s plus its bytes at min_bytes_per_s.
        self.timeout_s = timeout_s
        self.min_bytes_per_s = min_bytes_per_s
        if min_bytes_per_s <= 0:
            raise InvalidArgument(f"min_bytes_per_s {min_bytes_per_s}: must be > 0")
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(
            headers=headers, follow_redirects=False, verify=verify, transport=transport,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections))

    @classmethod
    def from_url(cls, url: str, **opts: Any) -> HttpBlobStore:
        return cls(base_url=url, **opts)

    def close(self) -> None:
        self._client.close()

    def _url(self, key: str) -> str:
        return f"{self.base}/{quote(check_key(key))}"

    # -- answers -----------------------------------------------------------------------
    def _unavailable(self, key: str, what: str, exc: BaseException | None = None,
                     status: int | None = None) -> NoReturn:
        why = f"HTTP {status}" if status is not None else (
            f"{type(exc).__name__}: {str(exc)[:200]}" if exc else "failed")
        raise BlobUnavailable(f"blob store {self.url}: {what} {key}: {why}",
                              store=self.url, key=key, status=status) from exc

    def _status(self, key: str, what: str, r: httpx.Response) -> None:
        """Raise for an answer that is not a success (404 excepted: callers decide)."""
        s = r.status_code
        if s in _TRANSIENT_STATUS or s >= 500:
            self._unavailable(key, what, status=s)
        if 300 <= s < 400:
            raise RemoteProtocolError(
                f"blob store {self.url} answered {what} {key} with a redirect ({s} to "
                f"{r.headers.get('location', '?')[:200]!r}); redirects are not followed - "
                "point --blob-store at the final location", store=self.url, key=key)
        if s in (401, 403):
            raise PermissionDenied(
                f"blob store {self.url} refused to {what} {key} (HTTP {s}): check the "
                f"token in ${TOKEN_ENV}", store=self.url, key=key)
        if s == 405 and what in ("upload", "delete"):
            raise PermissionDenied(
                f"blob store {self.url} does not accept {what}s (HTTP 405): it is "
                "read-only; enable WebDAV PUT/DELETE (nginx: dav_methods PUT DELETE) or "
                "push to the s3:// or file:// store it serves", store=self.url, key=key)

    # -- the protocol ------------------------------------------------------------------
    def head(self, key: str) -> int | None:
        url = self._url(key)

        def once() -> int | None:
            try:
                r = self._client.head(url)
            except httpx.HTTPError as exc:
                self._unavailable(key, "head", exc)
            if r.status_code == 404:
                return None
            self._status(key, "head", r)
            if r.status_code != 200 or "content-length" not in r.headers:
                raise RemoteProtocolError(
                    f"blob store {self.url}: HEAD {key} answered {r.status_code} without a "
                    "Content-Length", store=self.url, key=key)
            return int(r.headers["content-length"])
        return self.retry.call(once)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise InvalidArgument(f"range of {key}: offset {offset}, length {length}: "
                                  "negative")
        url = self._url(key)
        if length == 0:
            if self.head(key) is None:
                raise BlobNotFound(f"blob store {self.url} has no object {key}",
                                   store=self.url, key=key)
            return b""
        last = offset + length - 1

        def once() -> bytes:
            until = time.monotonic() + self.attempt_s(length)
            try:
                with self._client.stream(
                        "GET", url, headers={"Range": f"bytes={offset}-{last}"}) as r:
                    return self._range_body(key, offset, length, r, until)
            except httpx.HTTPError as exc:    # refused, reset, timed out, cut mid-body
                self._unavailable(key, f"read {length} bytes at {offset} of", exc)
        return self.retry.call(once)

    def attempt_s(self, length: int) -> float:
        """The wall-clock bound of one attempt moving ``length`` bytes."""
        return self.timeout_s + length / self.min_bytes_per_s

    def _range_body(self, key: str, offset: int, length: int, r: httpx.Response,
                    until: float) -> bytes:
        what = f"read {length} bytes at {offset} of"
        if r.status_code == 404:
            raise BlobNotFound(f"blob store {self.url} has no object {key}",
                               store=self.url, key=key)
        if r.status_code == 416:
            m = re.fullmatch(r"bytes \*/(\d+)", r.headers.get("content-range", ""))
            size = int(m.group(1)) if m else None
            raise InvalidArgument(
                f"range {offset}+{length} of {key} is past its end ({size} bytes)",
                store=self.url, key=key, size=size)
        self._status(key, what, r)
        if r.status_code == 200:
            raise RemoteProtocolError(
                f"blob store {self.url} ignored the Range of a read of {key} (200 with the "
                "whole object): serve it with a server that answers Range requests",
                store=self.url, key=key)
        if r.status_code != 206:
            raise RemoteProtocolError(f"blob store {self.url}: {what} {key} answered "
                                      f"{r.status_code}", store=self.url, key=key)
        m = _CONTENT_RANGE.fullmatch(r.headers.get("content-range", ""))
        if m is None:
            raise RemoteProtocolError(
                f"blob store {self.url}: {what} {key}: 206 without a single byte "
                f"Content-Range ({r.headers.get('content-range', '')[:80]!r})",
                store=self.url, key=key)
        first, end = int(m.group(1)), int(m.group(2))
        if first != offset:
            raise RemoteProtocolError(f"blob store {self.url}: {what} {key}: answered "
                                      f"bytes from {first}", store=self.url, key=key)
        if end != offset + length - 1:
            total = m.group(3)
            if total != "*" and offset + length > int(total):
                raise InvalidArgument(
                    f"range {offset}+{length} of {key} is past its end ({total} bytes)",
                    store=self.url, key=key, size=int(total))
            raise RemoteProtocolError(f"blob store {self.url}: {what} {key}: answered "
                                      f"bytes {first}-{end}", store=self.url, key=key)
        buf = bytearray()
        for piece in r.iter_bytes():
            buf += piece
            if time.monotonic() > until and len(buf) < length:
                self._unavailable(key, f"{what} (only {len(buf)} bytes within "
                                       f"{self.attempt_s(length):.1f}s: too slow)")
            if len(buf) > length:
                raise RemoteProtocolError(f"blob store {self.url}: {what} {key}: the body "
                                          f"ran past {length} bytes", store=self.url, key=key)
        if len(buf) != length:       # a cut connection httpx did not flag: never data
            self._unavailable(key, f"{what} (body ended at {len(buf)} bytes)")
        return bytes(buf)

    def _put(self, key: str, size: int, body: Any) -> None:
        url = self._url(key)

        def once() -> None:
            until = time.monotonic() + self.attempt_s(size)

            def timed() -> Iterator[bytes]:
                for piece in body():
                    if time.monotonic() > until:
                        self._unavailable(key, f"upload ({size} bytes) not done within "
                                               f"{self.attempt_s(size):.1f}s: too slow")
                    yield piece
            try:
                r = self._client.put(url, content=timed(),
                                     headers={"Content-Length": str(size)})
            except httpx.HTTPError as exc:
                self._unavailable(key, "upload", exc)
            self._status(key, "upload", r)
            if r.status_code not in (200, 201, 204):
                raise RemoteProtocolError(f"blob store {self.url}: upload {key} answered "
                                          f"{r.status_code}", store=self.url, key=key)
        self.retry.call(once)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._put(key, len(data), lambda: iter((data,)))

    def put_file(self, key: str, path: str) -> None:
        try:
            size = os.stat(path).st_size
        except OSError as exc:
            raise InvalidArgument(f"cannot upload {path}: {exc.strerror}") from exc

        def pieces() -> Iterator[bytes]:       # reopened on every try
            with open(path, "rb") as f:
                while piece := f.read(_UPLOAD_PIECE):
                    yield piece
        self._put(key, size, pieces)

    def delete(self, key: str) -> None:
        url = self._url(key)

        def once() -> None:
            try:
                r = self._client.delete(url)
            except httpx.HTTPError as exc:
                self._unavailable(key, "delete", exc)
            if r.status_code == 404:
                return
            self._status(key, "delete", r)
        self.retry.call(once)
