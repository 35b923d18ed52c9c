"""Blob store servers, one of each per test session (per xdist worker), on loopback."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.image.blob.servers import NGINX, FaultProxy, MotoServer, Nginx


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    pytest.importorskip("moto", reason="moto[server] is a dev dependency (pip install -e .[dev])")
    server = MotoServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> MotoServer:
    """Credentials the way operators pass them: the environment."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", MotoServer.ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", MotoServer.SECRET_KEY)
    return moto_server


@pytest.fixture
def s3_url(s3_env: MotoServer) -> str:
    """A fresh bucket (and prefix) of the session's moto server."""
    bucket = "dsec-" + secrets.token_hex(6)
    s3_env.create_bucket(bucket)
    return f"s3://{bucket}/layers-root?endpoint_url={s3_env.endpoint}&region=us-east-1"


@pytest.fixture(scope="session")
def nginx_server() -> Iterator[Nginx]:
    if not os.path.exists(NGINX):
        pytest.skip("nginx is not installed (Makefile APT_PACKAGES: nginx-light)")
    prefix = tempfile.mkdtemp(prefix="dsec-nginx-")
    server = Nginx(prefix)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(prefix, ignore_errors=True)


@pytest.fixture
def http_dir(nginx_server: Nginx) -> Iterator[tuple[str, str]]:
    """(directory nginx serves, its URL) for one test."""
    name = "t-" + secrets.token_hex(6)
    d = os.path.join(nginx_server.root, name)
    os.makedirs(d)
    os.chmod(d, 0o777)
    try:
        yield d, f"{nginx_server.url}/{name}"
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def fault_proxy() -> Iterator[list[FaultProxy]]:
    """Make proxies with ``FaultProxy(port)`` and append them here: closed at the end."""
    made: list[FaultProxy] = []
    try:
        yield made
    finally:
        for p in made:
            p.close()
