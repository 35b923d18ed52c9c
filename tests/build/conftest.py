"""Fixtures for the image builder's end-to-end tests: a real Debian base bootstrapped with
mmdebstrap from a local apt repository served on loopback (never the network: ``make
debian-repo`` fetched the packages at setup), in the layer store of a container cluster.

Bootstrapping costs ~20-30 s here, so the image and the cluster are built once per test
session and shared by every test of this directory."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from dsec import LocalCluster
from dsec.image.bootstrap import BootstrapPlan, repo_dir

# The vendored project under project/ is data, not part of dsec's suite.
collect_ignore_glob = ["project/*"]

# Keep in step with the Makefile's TEST_DEBIAN (make debian-repo fetches exactly this).
PLAN = BootstrapPlan.parse(suite="bookworm", include="python3,python3-pytest")
DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]
# The name dsec.Image.debian("bookworm", include=[...]) looks for, so the builder's
# Image.debian path finds this bootstrap.
IMAGE = PLAN.image_name()


@dataclass(frozen=True)
class Debian:
    cluster: LocalCluster
    store_root: str
    image: str
    mirror: str
    bootstrap_output: str


@pytest.fixture(scope="session")
def debian_mirror() -> Iterator[str]:
    """The local apt repo of PLAN's packages, served by http.server on 127.0.0.1."""
    repo = repo_dir(PLAN)
    if not os.path.exists(os.path.join(repo, ".complete")):
        pytest.fail(f"no local Debian repo at {repo}: run `make debian-repo` (setup "
                    "downloads the packages once; the tests never do)")
    handler = functools.partial(_QuietHandler, directory=repo)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/"
    finally:
        srv.shutdown()
        srv.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="session")
def debian(debian_mirror: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Debian]:
    """A one-edge container cluster whose store holds IMAGE: bookworm + python3
    + python3-pytest, bootstrapped by the real CLI (`dsec image bootstrap debian`)."""
    if os.geteuid() != 0:
        pytest.fail("the image builder tests need root (CI runs as root)")
    state = str(tmp_path_factory.mktemp("debian-cluster"))
    layers = os.path.join(state, "layers")
    out = subprocess.run(
        [*DSEC, "image", "--root", layers, "bootstrap", "debian", "--suite", PLAN.suite,
         "--include", ",".join(PLAN.include), "--mirror", debian_mirror, "--trusted"],
        check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    try:
        with LocalCluster(edges=1, backend="container", state_dir=state) as cl:
            yield Debian(cluster=cl, store_root=layers, image=IMAGE, mirror=debian_mirror,
                         bootstrap_output=out.stdout + out.stderr)
    finally:  # ~250 MB of layers: not left for pytest's last-three-runs retention
        shutil.rmtree(state, ignore_errors=True)
