"""A minimal read-only OCI distribution server (the hostile registry) for the red-team
tests: serves whatever manifests and blobs it is given, with no validation, on
loopback; records every request in ``log``."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
from typing import Any


class Hostile:
    def __init__(self) -> None:
        self.manifests: dict[tuple[str, str], tuple[bytes, str]] = {}
        self.blobs: dict[str, bytes] = {}
        self.log: list[tuple[str, str]] = []
        self.redirect_blobs: str | None = None   # 307 every blob GET to this base URL
        self.hang: set[str] = set()               # blob digests whose GET never answers
        self._release = threading.Event()         # (until close())
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, code: int, body: bytes = b"",
                      ctype: str = "application/octet-stream",
                      extra: dict[str, str] | None = None, head: bool = False) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Docker-Distribution-API-Version", "registry/2.0")
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def do_GET(self, head: bool = False) -> None:
                outer.log.append((self.command, self.path))
                if self.path in ("/v2/", "/v2"):
                    return self._send(200, b"{}", "application/json", head=head)
                m = re.match(r"^/v2/(.+)/manifests/([^/]+)$", self.path)
                if m:
                    repo, ref = m.groups()
                    got = outer.manifests.get((repo, ref))
                    for (r2, _), (b, t) in list(outer.manifests.items()):
                        if got is None and r2 == repo and _sha(b) == ref:
                            got = (b, t)
                    if got is None:
                        return self._send(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN",'
                                          b'"message":"manifest unknown"}]}',
                                          "application/json", head=head)
                    return self._send(200, got[0], got[1],
                                      {"Docker-Content-Digest": _sha(got[0])}, head=head)
                m = re.match(r"^/v2/(.+)/blobs/(sha256:[0-9a-f]{64})$", self.path)
                if m and m.group(2) in outer.hang:
                    outer._release.wait(120)
                    return None
                if m and outer.redirect_blobs is not None:
                    return self._send(307, extra={"Location": outer.redirect_blobs
                                                  + "/" + m.group(2)}, head=head)
                if m:
                    blob = outer.blobs.get(m.group(2))
                    if blob is None:
                        return self._send(404, b'{"errors":[{"code":"BLOB_UNKNOWN",'
                                          b'"message":"blob unknown"}]}',
                                          "application/json", head=head)
                    return self._send(200, blob, extra={"Docker-Content-Digest": m.group(2)},
                                      head=head)
                return self._send(404, b"{}", "application/json", head=head)

            def do_HEAD(self) -> None:
                self.do_GET(head=True)

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = int(self.srv.server_address[1])
        self.host = f"127.0.0.1:{self.port}"
        self._t = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self._t.start()

    def blob(self, data: bytes) -> str:
        d = _sha(data)
        self.blobs[d] = data
        return d

    def manifest(self, repo: str, tag: str, doc: dict[str, Any],
                 mt: str = "application/vnd.oci.image.manifest.v1+json") -> str:
        b = json.dumps(doc).encode()
        self.manifests[(repo, tag)] = (b, mt)
        return _sha(b)

    def close(self) -> None:
        self._release.set()
        self.srv.shutdown()
        self.srv.server_close()
        self._t.join(5)


def _sha(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()
