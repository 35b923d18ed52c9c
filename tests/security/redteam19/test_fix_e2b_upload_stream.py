"""A7 follow-ups: the E2B ``/files`` upload streams multipart parts into the sandbox as
they arrive and holds every door of the bound - a chunked body (no length to check up
front), too many parts, an octet-stream body - while a legitimate multi-file upload
still lands whole."""

from __future__ import annotations

from collections.abc import Iterator

import httpx

from dsec import LocalCluster
from dsec.control.e2b.app import MULTIPART_MAX_PARTS
from dsec.errors import NotFound

LIMIT = 64 << 10


def _headers(cl: LocalCluster, sid: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sid, "X-Access-Token": cl.api_key}


def _multipart(parts: list[tuple[str, bytes]], boundary: str = "xYzZy") -> bytes:
    out = b""
    for name, data in parts:
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                f"filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
                ).encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def _chunked(body: bytes) -> Iterator[bytes]:
    for i in range(0, len(body), 16 << 10):
        yield body[i:i + (16 << 10)]


def test_upload_bounds_at_every_door(e2b_sim: LocalCluster) -> None:
    cl = e2b_sim
    app = cl.runtime.e2b.app
    old = app.config
    app.config = type(old)(domain=old.domain, max_upload=LIMIT, keepalive_s=old.keepalive_s)
    url = f"{cl.runtime.e2b_url}/files"
    try:
        with cl.client(session_lease_s=None) as c:
            sb = c.sandboxes.create()
            try:
                h = _headers(cl, sb.id)
                # within the bound: two files in one request, both written whole
                ok = httpx.post(url, files=[("file", ("/tmp/a", b"a" * 20000)),
                                            ("file", ("/tmp/b", b"b" * 30000))],
                                headers=h, timeout=30)
                assert ok.status_code == 200, ok.text
                assert sb.files.read("/tmp/a") == b"a" * 20000
                assert sb.files.read("/tmp/b") == b"b" * 30000
                # chunked (no Content-Length): found while streaming, 413, the part
                # being written is not kept
                body = _multipart([("/tmp/big", b"z" * (LIMIT + 1))])
                r = httpx.post(url, content=_chunked(body), timeout=30, headers={
                    **h, "content-type": "multipart/form-data; boundary=xYzZy"})
                assert r.status_code == 413, (r.status_code, r.text)
                try:
                    got = sb.files.read("/tmp/big")
                except NotFound:
                    got = b""
                assert got == b"", f"{len(got)} bytes of a refused upload were kept"
                # too many (empty) parts in one chunked request
                body = _multipart([(f"/tmp/e{i}", b"") for i in range(MULTIPART_MAX_PARTS + 1)])
                r = httpx.post(url, content=_chunked(body), timeout=30, headers={
                    **h, "content-type": "multipart/form-data; boundary=xYzZy"})
                assert r.status_code == 413, (r.status_code, r.text)
                # octet-stream: by its length, and chunked while streaming
                r = httpx.post(url, params={"path": "/tmp/o"}, content=b"o" * (LIMIT + 1),
                               headers={**h, "content-type": "application/octet-stream"},
                               timeout=30)
                assert r.status_code == 413, (r.status_code, r.text)
                r = httpx.post(url, params={"path": "/tmp/o"},
                               content=_chunked(b"o" * (LIMIT + 1)),
                               headers={**h, "content-type": "application/octet-stream"},
                               timeout=30)
                assert r.status_code == 413, (r.status_code, r.text)
                try:
                    got = sb.files.read("/tmp/o")
                except NotFound:
                    got = b""
                assert got == b""
            finally:
                sb.kill()
    finally:
        app.config = old
