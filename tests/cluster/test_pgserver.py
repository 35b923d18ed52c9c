"""The throwaway PostgreSQL server (dsec.cluster.pgserver): its own directory, a socket
only it and root can reach, an unprivileged account when run as root, kill -9 and
restart with nothing committed lost, and nothing left behind."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from dsec.cluster.pgserver import SERVER_USER, PgServer, find_pg_bin
from dsec.errors import InvalidArgument


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dsec-pgt-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _owner(pid: int) -> str:
    return pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name


def test_a_server_lives_in_its_dir_survives_kill9_and_leaves_nothing(short_dir: Path) -> None:
    server = PgServer(short_dir, fsync=False, remove=True)
    with server as dsn:
        pid = server.pid()
        assert pid is not None
        if os.geteuid() == 0:
            assert _owner(pid) == SERVER_USER          # never root
        assert (short_dir / ".s.PGSQL.5432").exists()
        assert oct(short_dir.stat().st_mode & 0o777) == "0o700"
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SHOW listen_addresses").fetchone() == ("",)
            conn.execute("CREATE TABLE t (x int)")
            conn.execute("INSERT INTO t VALUES (1), (2)")
        children = [p for p in os.listdir("/proc") if p.isdigit()
                    and _ppid(int(p)) == pid]
        server.kill9()
        assert server.pid() is None
        assert not any(_running(int(p)) for p in [str(pid), *children])
        assert server.start() == dsn                        # recovers from its WAL
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT sum(x) FROM t").fetchone() == (3,)
        assert server.restart() == dsn
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT count(*) FROM t").fetchone() == (2,)
        pid = server.pid()
    assert pid is not None and not _running(pid)
    assert not short_dir.exists()


def test_tcp_on_loopback_needs_the_generated_password(short_dir: Path) -> None:
    port = 20000 + os.getpid() % 20000
    server = PgServer(short_dir, fsync=False, tcp_port=port, remove=True)
    with server as dsn:
        assert dsn.startswith("postgresql://dsec:") and f"@127.0.0.1:{port}/" in dsn
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SHOW listen_addresses").fetchone() == ("127.0.0.1",)
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(f"postgresql://dsec:wrong@127.0.0.1:{port}/postgres").close()


def test_bad_places_are_clear_errors(short_dir: Path) -> None:
    with pytest.raises(InvalidArgument, match="too long for a Unix socket"):
        PgServer(short_dir / ("x" * 120))
    if os.geteuid() == 0:
        server = PgServer(short_dir / "pg")      # short_dir is root's, mode 0700
        with pytest.raises(InvalidArgument, match="cannot enter"):
            server.start()
    assert (find_pg_bin() / "initdb").exists()


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_server_whose_owner_was_killed_is_stopped_by_the_next_start(
        short_dir: Path, tmp_path: Path) -> None:
    """kill -9 of the process that started a server (a bench killed mid-run) leaves the
    server running; the next PgServer start on the host stops it and removes its dir."""
    import subprocess
    import sys
    import time

    from dsec.cluster.pgserver import reap_orphan_servers

    orphan_dir = Path(tempfile.mkdtemp(prefix="dsec-pgo-", dir="/tmp"))   # traversable parent
    ready = tmp_path / "ready"
    code = ("import sys, time, pathlib; from dsec.cluster.pgserver import PgServer\n"
            f"s = PgServer({str(orphan_dir)!r}, fsync=False, remove=True); s.start()\n"
            f"pathlib.Path({str(ready)!r}).write_text(str(s.pid())); time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert owner.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        postmaster = int(ready.read_text())
        assert reap_orphan_servers() == []                 # its owner lives: left alone
        owner.kill()
        owner.wait(10)
        assert os.path.exists(f"/proc/{postmaster}")       # the server outlived its owner
        with PgServer(short_dir, fsync=False):
            pass                                           # a start reaps first
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{postmaster}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{postmaster}")
        assert not orphan_dir.exists()
    finally:
        if owner.poll() is None:
            owner.kill()
        if (orphan_dir / "data").exists():
            PgServer(orphan_dir).kill9()
        shutil.rmtree(orphan_dir, ignore_errors=True)
