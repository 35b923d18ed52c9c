"""Blob stores: where layers (and their chunk tables, manifests and access traces) live
off-node, so a node that lacks a layer can fetch it whole or 256 KiB at a time.

One synchronous, thread-safe interface (:class:`BlobStore`) and three backends, chosen
by URL (:func:`open_blobstore`)::

    file:///abs/dir                                  a directory (tests, one machine, NFS)
    s3://bucket[/prefix]?endpoint_url=..&region=..   S3-compatible object storage (boto3)
    http(s)://host[:port][/prefix]                   any server with Range GETs (WebDAV
                                                     PUT/DELETE to push through it)

Keys are ``/``-separated relative paths (:func:`check_key`); the layout the image side
uses is in :mod:`dsec.image.blob.keys`. Every backend answers ``get_range`` with exactly
the bytes asked or raises: :class:`~dsec.errors.BlobNotFound` (no such key) or
:class:`~dsec.errors.BlobUnavailable` (transient: connect, timeout, 5xx, short body -
after bounded retries). A short read is an error, never data. ``put_*`` are atomic from
a reader's view: an object is visible whole or not at all, also when the writer is
killed mid-upload.

Who chooses the URL matters for egress (:mod:`dsec.image.egress`): the blob store URL is
an *operator* setting (``--blob-store`` on ``dsec edge``/``up``/``apiserver``), not a
tenant's, so its host - loopback or private included - is trusted as configured; tenants
only ever name keys (digests), which :func:`check_key` confines to the store's prefix.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

from dsec.errors import InvalidArgument
from dsec.image.blob.keys import (
    check_key,
    layer_chunks_key,
    layer_key,
    layer_manifest_key,
    trace_key,
    trace_prefix,
)

__all__ = [
    "BlobStore",
    "check_key",
    "layer_chunks_key",
    "layer_key",
    "layer_manifest_key",
    "open_blobstore",
    "redact_url",
    "trace_key",
    "trace_prefix",
]


@runtime_checkable
class BlobStore(Protocol):
    """A flat key → bytes store. Synchronous and thread-safe: one instance per URL,
    shared by every thread of a process."""

    url: str                                            # credentials redacted

    def head(self, key: str) -> int | None:
        """The object's size in bytes, or None when there is no object under ``key``."""
        ...

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset`` or an error (``BlobNotFound``,
        ``BlobUnavailable``; ``InvalidArgument`` for a range past the object's end)."""
        ...

    def put_file(self, key: str, path: str) -> None:
        """Upload a file (multipart above the backend's threshold), atomically."""
        ...

    def put_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, atomically."""
        ...

    def delete(self, key: str) -> None:
        """Remove the object (no error when it is already gone)."""
        ...


def redact_url(url: str) -> str:
    """``url`` without userinfo or query values that could be secrets (for logs/errors)."""
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port:
        netloc = f"{netloc}:{parts.port}"
    query = "&".join(q.split("=", 1)[0] + ("=..." if "=" in q else "")
                     for q in parts.query.split("&") if q)
    return parts._replace(netloc=netloc, query=query).geturl()


def open_blobstore(url: str, **opts: Any) -> BlobStore:
    """The store behind ``url`` (``file://``, ``s3://``, ``http://``, ``https://``).
    ``opts`` are backend options (see each backend's constructor)."""
    if not isinstance(url, str) or len(url) > 4096:
        raise InvalidArgument("blob store URL must be a string of at most 4096 characters")
    scheme = urlsplit(url).scheme.lower()
    if scheme == "file":
        from dsec.image.blob.file import FileBlobStore
        return FileBlobStore.from_url(url, **opts)
    if scheme == "s3":
        from dsec.image.blob.s3 import S3BlobStore
        return S3BlobStore.from_url(url, **opts)
    if scheme in ("http", "https"):
        from dsec.image.blob.http import HttpBlobStore
        return HttpBlobStore.from_url(url, **opts)
    raise InvalidArgument(
        f"blob store URL {redact_url(url)[:200]!r}: unknown scheme {scheme!r}; use "
        "file:///abs/dir, s3://bucket/prefix?endpoint_url=...&region=... or "
        "http(s)://host/prefix")
