"""An edge's metrics are not every host user's (hx): a loopback port is reachable by any
local user, and the series name the node's sandboxes and what they do. With a token
(``dsec up --edge-metrics-port`` always makes one) a scrape without it gets 401 and no
series; ``dsec edge --metrics-listen`` refuses to start with neither a token nor an
explicit ``--metrics-public``."""

from __future__ import annotations

import asyncio
import os
import socket

import click
import pytest

from dsec.edge.metrics import authorized, read_token, serve_metrics
from dsec.errors import InvalidArgument
from tests.security.hx_hardening.probe_user import run_as

SCRAPE = r"""
import sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[1], headers=dict(
    [h.split(": ", 1) for h in sys.argv[2:]]))
try:
    with urllib.request.urlopen(req, timeout=10) as r:
        print(r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
"""
TOKEN = b"hx-0123456789abcdef-token"
SERIES = b'dsec_net_denied_packets_total{sandbox_id="sb-0123456789ab-edge-0"} 3.0\n'


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
async def test_a_host_user_without_the_token_reads_no_series() -> None:
    port = _port()
    server = await serve_metrics(f"127.0.0.1:{port}", lambda: SERIES, token=TOKEN)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        for headers in ((), ("Authorization: Bearer wrong-token-0123456789",),
                        ("Authorization: Basic " + TOKEN.decode(),)):
            code, out = await asyncio.to_thread(run_as, 65534, SCRAPE, url, *headers)
            assert code == 0, out
            assert out.startswith("401 "), (headers, out)
            assert "sandbox_id" not in out and "sb-" not in out, out
        code, out = await asyncio.to_thread(run_as, 65534, SCRAPE, url,
                                            "Authorization: Bearer " + TOKEN.decode())
        assert out.startswith("200 ") and "sb-0123456789ab-edge-0" in out, out
    finally:
        server.close()
        await server.wait_closed()


def test_authorized_is_exact() -> None:
    head = b"GET /metrics HTTP/1.0\r\nHost: x\r\nauthorization:  Bearer " + TOKEN + b"\r\n"
    assert authorized(head, TOKEN)
    assert authorized(b"GET /metrics HTTP/1.0\r\n", None)
    assert not authorized(b"GET /metrics HTTP/1.0\r\n", TOKEN)
    assert not authorized(head.replace(TOKEN, TOKEN[:-1]), TOKEN)
    assert not authorized(b"GET /metrics?Authorization: Bearer " + TOKEN + b" HTTP/1.0\r\n",
                          TOKEN)


def test_token_file_must_be_private(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "t")
    with open(path, "wb") as f:
        f.write(TOKEN + b"\n")
    os.chmod(path, 0o644)
    with pytest.raises(InvalidArgument, match="chmod 600"):
        read_token(path)
    os.chmod(path, 0o600)
    assert read_token(path) == TOKEN
    made = os.path.join(str(tmp_path), "edge", "made.token")   # before the state dir
    first = read_token(made, create=True)          # a unit's first start fills it
    assert os.stat(made).st_mode & 0o777 == 0o600 and len(first) >= 32
    assert read_token(made, create=True) == first


def test_edge_refuses_an_open_metrics_listener_by_default() -> None:
    from dsec.cli.edge import _metrics_token
    with pytest.raises(click.BadParameter, match="--metrics-token-file"):
        _metrics_token("127.0.0.1:9470", None, False)
    assert _metrics_token("127.0.0.1:9470", None, True) is None
    assert _metrics_token(None, None, False) is None


def test_dsec_up_passes_a_private_token_to_its_edges(tmp_path: object) -> None:
    from dsec.cluster.runtime import metrics_token_file
    path = metrics_token_file(str(tmp_path))
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert metrics_token_file(str(tmp_path)) == path and len(read_token(path)) >= 32
