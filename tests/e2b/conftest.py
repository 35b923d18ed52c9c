"""A container cluster serving the E2B layer (``dsec up --e2b`` in-process), shared by
the tests of this directory: the stock ``e2b`` SDK is pointed at it through its public
options (``api_url``/``sandbox_url`` = ``E2B_API_URL``/``E2B_SANDBOX_URL``).

The template is ``e2b-base``: dsec's busybox ``base`` plus a ``/bin/bash`` that runs
busybox ``sh`` (the SDK runs every command as ``/bin/bash -l -c CMD``); the code
interpreter's is ``e2b-python``: ``base`` plus the host's python3 (stage_python_root)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

pytest.importorskip("e2b", reason="the e2b test extra: pip install -e '.[e2b]'")

from dsec import Image, LocalCluster
from dsec.bench._e2b_calls import TEMPLATE_SETUP, E2BTarget, stage_python_root


@pytest.fixture(scope="session")
def e2b_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if os.geteuid() != 0:
        pytest.fail("the E2B tests run container sandboxes: they need root (CI is root)")
    state = str(tmp_path_factory.mktemp("e2b-cluster"))
    root = stage_python_root(str(tmp_path_factory.mktemp("e2b-python")))
    with LocalCluster(backend="container", state_dir=state, e2b="127.0.0.1:0") as cl:
        with cl.client(session_lease_s=None) as c:
            Image.from_image("base").run(TEMPLATE_SETUP).build(c, name="e2b-base")
            Image.from_image("base").copy(root, "/").build(c, name="e2b-python")
        yield cl


@pytest.fixture(scope="session")
def e2b_target(e2b_cluster: LocalCluster) -> E2BTarget:
    cl = e2b_cluster
    tag = os.getpid()
    return E2BTarget(url=cl.runtime.e2b_url, api_key=cl.api_key,
                     reader_key=cl.create_key(f"e2b-reader-{tag}", "default", "reader"),
                     stranger_key=cl.create_key(f"e2b-stranger-{tag}", f"e2b-other-{tag}",
                                                "admin"),
                     template="e2b-base", python_template="e2b-python")
