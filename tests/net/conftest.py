"""Fixtures for network tests: a fake internet and a router whose uplink leads into it.

Both live in anonymous network namespaces held by fds, so nothing here has a name another
engineer's test could collide with, and closing the fds removes every namespace, link and
nft table they hold. A check at the end of each router test makes sure the host's own
ruleset did not grow a table named like the router's.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Iterator

import pytest

from dsec.net.router import Router, RouterConfig
from dsec.net.testinternet import Internet, start
from dsec.net.uplink import NetnsUplink

_uplinks = itertools.count()


def host_tables() -> set[str]:
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True)
    return {line.strip() for line in out.stdout.splitlines() if line.strip()}


@pytest.fixture
def internet() -> Iterator[Internet]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    inet = start()
    try:
        yield inet
    finally:
        inet.close()


@pytest.fixture
def router(internet: Internet) -> Iterator[Router]:
    before = host_tables()
    r = Router.create(RouterConfig(pool_min=2, build_batch=2),
                      NetnsUplink(internet.fd, f"nbup{next(_uplinks)}"))
    try:
        yield r
    finally:
        r.close()
    # the router's table lives in its own netns, never the host's
    assert host_tables() - before == set()

