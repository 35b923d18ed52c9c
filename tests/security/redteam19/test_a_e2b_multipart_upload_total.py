"""E2B ``POST /files`` (multipart): ``E2BConfig.max_upload`` is documented as "bytes of
one ``/files`` upload", but it is passed to Starlette as ``max_part_size``, which bounds
*non-file fields* only: a file part is unbounded, and ``max_files=1000`` parts may come
in one request. Starlette parses the whole form first, spooling every file part to the
apiserver's temporary directory (SpooledTemporaryFile rolls over at 1 MiB) before the
first byte reaches a sandbox (whose disk cap would have stopped it). Any member key of
any project fills the control plane's disk with one request (and holds it while it
trickles the body).

Below: ``max_upload`` set to 64 KiB; a single 144 KiB file part, and one request of four
48 KiB parts (192 KiB), must each be refused with 413."""

from __future__ import annotations

import httpx

from dsec import LocalCluster

LIMIT = 64 << 10
PART = 48 << 10


def _post(cl: LocalCluster, sid: str, files: list[tuple[str, tuple[str, bytes]]]
          ) -> httpx.Response:
    return httpx.post(f"{cl.runtime.e2b_url}/files", files=files,
                      headers={"E2b-Sandbox-Id": sid, "X-Access-Token": cl.api_key},
                      timeout=30)


def test_multipart_upload_total_is_bounded_by_max_upload(e2b_sim: LocalCluster) -> None:
    cl = e2b_sim
    app = cl.runtime.e2b.app
    old = app.config
    app.config = type(old)(domain=old.domain, max_upload=LIMIT, keepalive_s=old.keepalive_s)
    try:
        with cl.client(session_lease_s=None) as c:
            sb = c.sandboxes.create()
            try:
                one = _post(cl, sb.id, [("file", ("/tmp/big", b"x" * (3 * PART + 1)))])
                assert one.status_code == 413, (
                    f"a multipart /files upload of one {3 * PART + 1}-byte file part was "
                    f"accepted with max_upload={LIMIT}: HTTP {one.status_code} "
                    f"{one.text[:200]} (Starlette's max_part_size bounds fields, not files)")
                many = [("file", (f"/tmp/p{i}", b"y" * PART)) for i in range(4)]
                r = _post(cl, sb.id, many)
                assert r.status_code == 413, (
                    f"one /files upload of {4 * PART} bytes (4 parts of {PART}) was "
                    f"accepted with max_upload={LIMIT}: HTTP {r.status_code} {r.text[:200]}; "
                    "max_upload bounds each part, not the upload, so one request may "
                    "spool 1000 x max_upload bytes to the apiserver's disk")
            finally:
                sb.kill()
    finally:
        app.config = old
