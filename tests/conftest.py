"""Shared fixtures. Tests that need root or a kernel feature use ``requires_root``.

The suite runs in parallel (pytest-xdist, ``make test``): read tests/README.md before
adding a test that makes host resources (cgroups, mounts, netns, nft tables, servers) or
looks at the whole host. In short: name everything per test (uuid or pid), bind port 0,
keep files under ``tmp_path``, and mark ``@pytest.mark.serial`` a test that reaps or
counts host-wide, measures time, or exhausts a shared resource.
"""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import settings

# Every container/fncall backend makes a preallocated btrfs disk pool (its size is taken
# from the host while it exists; see dsec.edge.backends.container.disk). The default -
# half the free space, at most 64 GiB - is for a node; a test suite makes hundreds of
# backends, one at a time, so it asks for 2 GiB each (subprocesses inherit it).
os.environ.setdefault("DSEC_DISK_POOL_BYTES", str(2 << 30))

# Hypothesis' per-example deadline (200 ms) is a timing assertion, and timing belongs to
# `dsec bench`: on this 2-core machine under a full suite, pure property tests missed it
# (test_net_pure) with nothing wrong. Examples stay bounded by max_examples.
settings.register_profile("dsec", deadline=None)
settings.load_profile("dsec")

def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker, leave out the tests marked ``serial``: they must not run
    beside other tests, and `make test` runs them in a pass of their own
    (``pytest -n 0 -m serial``). Deselected, not skipped: the count shows in the summary."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    serial = [i for i in items if i.get_closest_marker("serial") is not None]
    if serial:
        config.hook.pytest_deselected(items=serial)
        items[:] = [i for i in items if i.get_closest_marker("serial") is None]


# A test that needs root, a binary or a kernel feature must run on CI, not skip: with
# DSEC_STRICT_SKIPS=1 (set by `make test`, which installs every prerequisite first) a skip
# fails the test and names what is missing. Only skips whose reason starts with
# "by design:" (opt-in sets such as DSEC_VM_FULL, a test of an absent feature) stay skips.
STRICT_SKIPS = os.environ.get("DSEC_STRICT_SKIPS") == "1"
BY_DESIGN = "by design:"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if not (STRICT_SKIPS and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if reason.removeprefix("Skipped: ").startswith(BY_DESIGN):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped under DSEC_STRICT_SKIPS=1 ({reason}): CI must run every "
                       "test; install what it needs in `make setup`, or mark an opt-in "
                       f"skip with a reason starting {BY_DESIGN!r}")


requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")


# --- PostgreSQL (stream pg): one throwaway server per test session (so one per xdist
# worker: each worker is a session of its own), a fresh database
# per test (CREATE DATABASE ... TEMPLATE: ~50 ms). The server runs in a short /tmp dir
# (a Unix socket path must stay under 108 bytes; the server account must be able to
# enter it), which is removed with everything in it at the end of the session.
@pytest.fixture(scope="session")
def pg_server():  # type: ignore[no-untyped-def]
    import shutil
    import tempfile

    from dsec.cluster.pgserver import PgServer

    d = tempfile.mkdtemp(prefix="dsec-pg-", dir="/tmp")
    server = PgServer(d, fsync=False, remove=True)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def pg_dsn(pg_server):  # type: ignore[no-untyped-def]
    """The URL of a new, empty database on the session's PostgreSQL server; dropped
    after the test (with every connection to it)."""
    import psycopg

    name = f"t{os.getpid()}_{next(_pg_ids)}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE template0")
    try:
        yield pg_server.dsn_for(name)
    finally:
        try:
            with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        except psycopg.Error:
            pass   # the server is down (a fault test stopped it): the dir goes anyway


_pg_ids = itertools.count()
