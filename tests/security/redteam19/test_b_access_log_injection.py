"""Red team B (issue 19): an unauthenticated peer forges access-log lines.

The REST door logs the *percent-decoded* request path into ``--access-log`` with
``--log-format text`` verbatim (``dsec.logs.TextFormatter`` joins ``msg`` and the ``k=v``
fields raw). ``GET /v1/sandboxes/x%0a<forged line>`` (no key needed: a 401 is logged too)
writes a second line that looks exactly like an answered admin call; ``%1b[...`` puts
terminal escapes into the file an operator ``tail``s. One request must be one line, and
nothing a peer sends may reach the log as a control character.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from dsec.cluster.local import LocalCluster
from dsec.logs import configure

# a gateway line (no '/': the fast GET path takes one id segment)
FORGED = ("2026-12-02T10:00:00.000Z INFO dsec.access: QuotaSet ok door=gateway op=quota_set "
          "outcome=ok duration_ms=1.0 client=10.0.0.1")


@pytest.fixture
def cluster_with_access_log(tmp_path) -> Iterator[tuple[LocalCluster, str]]:  # type: ignore[no-untyped-def]
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    path = str(tmp_path / "access.log")
    configure("info", "text", access_log=path)
    try:
        with LocalCluster(edges=1) as cl:
            yield cl, path
    finally:
        configure("warning", "text")
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)


def _raw_get(url: str, target: str, extra: str = "") -> bytes:
    u = urlsplit(url)
    with socket.create_connection((u.hostname or "127.0.0.1", u.port or 80), timeout=30) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nhost: x\r\n{extra}connection: close\r\n"
                  "\r\n".encode())
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_b_a_peer_cannot_forge_access_log_lines(cluster_with_access_log) -> None:  # type: ignore[no-untyped-def]
    cl, path = cluster_with_access_log
    assert cl.url.startswith("http://"), cl.url
    forged = FORGED.replace(" ", "%20").replace(":", "%3A")
    targets = [
        f"/v1/sandboxes/sb-x%0A{forged}",          # the fast GET path: scope["path"] raw
        "/v1/sandboxes/sb-y%1B%5B2J%1B%5B31mowned",  # ANSI: clear screen, red
        f"/v1/sandboxes/sb-z%0D%0A{forged}/events",  # a Starlette route (CR LF)
        "/v1/sandboxes/sb-w%0B%0C%1B%5D0%3Btitle%07/events",  # VT FF, an OSC title
    ]
    for t in targets:
        answer = _raw_get(cl.url, t)
        assert answer.startswith(b"HTTP/1.1 4"), answer[:200]
    for h in logging.getLogger("dsec.access").handlers:
        h.flush()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.splitlines()
    # one request, one line; no forged admin call; no control characters from the peer
    assert not any(line.startswith("2026-12-02T10:00:00.000Z") for line in lines), text
    assert len(lines) == len(targets), text
    assert not any(ch in text for ch in ("\x1b", "\r", "\x0b", "\x0c", "\x07")), repr(text)


def test_b_a_peer_cannot_add_fields_to_its_access_log_line(cluster_with_access_log) -> None:  # type: ignore[no-untyped-def]
    """The text format's ``k=v`` fields are not quoted: a request id (any printable
    text up to 128 chars, echoed from ``X-Request-ID``) of ``r1 principal=admin
    status=200`` gives the line a second ``principal`` and ``status``, the ones a
    ``k=v`` parser keeps last."""
    cl, path = cluster_with_access_log
    answer = _raw_get(cl.url, "/v1/sandboxes/sb-000000000001-n1",
                      "x-request-id: r1 principal=admin status=200\r\n")
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    for h in logging.getLogger("dsec.access").handlers:
        h.flush()
    with open(path, encoding="utf-8") as f:
        line = f.read().strip()
    tokens = [t.partition("=")[0] for t in line.split() if "=" in t]
    assert tokens.count("principal") == 1 and tokens.count("status") == 1, line
