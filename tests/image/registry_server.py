"""A small OCI distribution server on loopback for the pull tests that need what the
real registry will not do: redirect blob GETs or name a token realm elsewhere, cut a blob
mid-transfer, count the bytes it sends. It serves the images of an OCI layout written by
:func:`dsec.image.localregistry.write_image`; :class:`Listener` is a socket that only
counts who connects (the host a refused hop must never reach)."""

from __future__ import annotations

import base64
import http.server
import json
import os
import re
import socket
import threading
from typing import Any


class Listener:
    """A TCP listener on 127.0.0.1 that accepts, counts and closes connections."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.host = f"127.0.0.1:{self.port}"
        self.accepted = 0
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            if self._stop:
                c.close()
                return
            self.accepted += 1
            c.close()

    def close(self) -> None:
        self._stop = True
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            pass
        self.sock.close()
        self._t.join(5)


class Registry:
    """Serves ``repo`` from an OCI layout: ``/v2/<repo>/manifests/<tag|digest>`` and
    ``/v2/<repo>/blobs/<digest>`` (with ``Range``), plus the knobs:

    - ``redirect_blobs``: base URL every blob GET is answered 307 to (``<base>/<digest>``);
      the same server serves ``/blob/<digest>`` itself, so another Registry can be the
      redirect target;
    - ``token_realm``: the ``WWW-Authenticate: Bearer realm=`` it names; requests need
      ``Bearer <token>``, which ``/token`` hands out (for ``creds``, checked as basic);
    - ``cut_at``: blob digest -> byte count after which the GET stops sending and
      waits until :meth:`release` (a transfer cut mid-blob).
    ``log`` has (method, path, headers) of every request, ``sent`` the blob bytes sent
    (``sent_by``: per blob digest)."""

    def __init__(self, layout: str, repo: str) -> None:
        self.blobs: dict[str, bytes] = {}
        d = os.path.join(layout, "blobs", "sha256")
        for n in os.listdir(d):
            with open(os.path.join(d, n), "rb") as f:
                self.blobs["sha256:" + n] = f.read()
        with open(os.path.join(layout, "index.json")) as f:
            index = json.load(f)
        self.tags = {m["annotations"]["org.opencontainers.image.ref.name"]: m["digest"]
                     for m in index["manifests"]}
        self.repo = repo
        self.redirect_blobs: str | None = None
        self.token_realm: str | None = None
        self.token = "tok-" + os.urandom(8).hex()
        self.creds: tuple[str, str] | None = None
        self.cut_at: dict[str, int] = {}
        self.log: list[tuple[str, str, dict[str, str]]] = []
        self.sent = 0
        self.sent_by: dict[str, int] = {}         # blob digest -> bytes sent
        self._release = threading.Event()
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, code: int, body: bytes = b"", ctype: str = "application/json",
                      extra: dict[str, str] | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _authorized(self) -> bool:
                if outer.token_realm is None:
                    return True
                if self.headers.get("Authorization") == f"Bearer {outer.token}":
                    return True
                self._send(401, b'{"errors":[{"code":"UNAUTHORIZED"}]}', extra={
                    "WWW-Authenticate": f'Bearer realm="{outer.token_realm}",'
                                        f'service="dsec-test",scope="repository:'
                                        f'{outer.repo}:pull"'})
                return False

            def do_GET(self) -> None:
                outer.log.append((self.command, self.path, dict(self.headers.items())))
                path = self.path.split("?", 1)[0]
                if path == "/token":
                    want = None if outer.creds is None else "Basic " + base64.b64encode(
                        ":".join(outer.creds).encode()).decode()
                    if want is not None and self.headers.get("Authorization") != want:
                        return self._send(401, b"{}")
                    return self._send(200, json.dumps({"token": outer.token}).encode())
                if path in ("/v2/", "/v2"):
                    return self._send(200, b"{}")
                m = re.match(r"^/v2/(.+)/manifests/([^/]+)$", path)
                if m:
                    if not self._authorized():
                        return None
                    ref = m.group(2)
                    digest = outer.tags.get(ref, ref)
                    body = outer.blobs.get(digest) if m.group(1) == outer.repo else None
                    if body is None:
                        return self._send(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN",'
                                          b'"message":"manifest unknown"}]}')
                    mt = json.loads(body).get("mediaType",
                                              "application/vnd.oci.image.manifest.v1+json")
                    return self._send(200, body, mt, {"Docker-Content-Digest": digest})
                m = re.match(r"^/v2/(.+)/blobs/(sha256:[0-9a-f]{64})$", path)
                if m:
                    if not self._authorized():
                        return None
                    if outer.redirect_blobs is not None:
                        return self._send(307, extra={
                            "Location": f"{outer.redirect_blobs}/blob/{m.group(2)}"})
                    return self._blob(m.group(2))
                m = re.match(r"^/blob/(sha256:[0-9a-f]{64})$", path)
                if m:
                    return self._blob(m.group(1))
                return self._send(404, b"{}")

            def _blob(self, digest: str) -> None:
                data = outer.blobs.get(digest)
                if data is None:
                    return self._send(404, b'{"errors":[{"code":"BLOB_UNKNOWN"}]}')
                start = 0
                rng = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
                code = 200
                extra: dict[str, str] = {}
                if rng and int(rng.group(1)) < len(data):
                    start, code = int(rng.group(1)), 206
                    extra["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                body = data[start:]
                self.send_response(code)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                for k, v in extra.items():
                    self.send_header(k, v)
                self.end_headers()
                cut = outer.cut_at.get(digest)
                if cut is not None and cut > start:
                    first = body[:cut - start]
                    self.wfile.write(first)
                    self.wfile.flush()
                    outer.sent += len(first)
                    outer.sent_by[digest] = outer.sent_by.get(digest, 0) + len(first)
                    outer._release.wait(60)
                    self.close_connection = True
                    return
                self.wfile.write(body)
                outer.sent += len(body)
                outer.sent_by[digest] = outer.sent_by.get(digest, 0) + len(body)

            def do_HEAD(self) -> None:
                self.do_GET()

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        self.port = int(self.srv.server_address[1])
        self.host = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.host}"
        self._t = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self._t.start()

    def release(self) -> None:
        self._release.set()

    def close(self) -> None:
        self._release.set()
        self.srv.shutdown()
        self.srv.server_close()
        self._t.join(5)
