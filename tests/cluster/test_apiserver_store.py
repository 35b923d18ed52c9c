"""``dsec apiserver --store URL``: two apiserver processes over one PostgreSQL database
and one ``dsec edge`` behave as one service (a sandbox created through one is listed
and destroyed through the other); a bad or unreachable store is a clear error at start
that never shows the password."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec.statedir import read_local

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    out: list[subprocess.Popen[bytes]] = []
    try:
        yield out
    finally:
        for p in out:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _wait(pred, what: str, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_two_apiservers_over_one_postgresql_serve_one_cluster(
        tmp_path: Path, pg_dsn: str, procs: list[subprocess.Popen[bytes]]) -> None:
    sock = tmp_path / "e0.sock"
    procs.append(subprocess.Popen([*DSEC, "edge", "--listen", f"unix:{sock}", "--node-id",
                                   "e0", "--state-dir", str(tmp_path / "edge"),
                                   "--log-level", "warning"]))
    _wait(sock.exists, "dsec edge did not start")
    urls, keys = [], []
    for name in ("a", "b"):
        d = tmp_path / name
        procs.append(subprocess.Popen(
            [*DSEC, "apiserver", "--edge", f"e0=unix:{sock}", "--state-dir", str(d),
             "--store", pg_dsn, "--listen", "127.0.0.1:0", "--gateway", "off", "--quiet"]))
        local = _wait(lambda d=d: read_local(str(d)), f"apiserver {name} did not start")
        urls.append(local["url"])
        keys.append(local["api_key"])
    ha, hb = ({"authorization": f"Bearer {k}"} for k in keys)
    # the key minted by a works on b: one store of keys
    made = httpx.post(f"{urls[0]}/v1/sandboxes", json={}, headers=hb, timeout=30)
    assert made.status_code == 201, made.text
    sid = made.json()["id"]

    def listed_by_b() -> bool:
        r = httpx.get(f"{urls[1]}/v1/sandboxes", headers=ha, timeout=30)
        return sid in {s["id"] for s in r.json()["items"]}
    _wait(listed_by_b, "replica b never listed the sandbox made through a")
    gone = httpx.delete(f"{urls[1]}/v1/sandboxes/{sid}", headers=ha, timeout=30)
    assert gone.status_code in (200, 204), gone.text

    def gone_from_a() -> bool:
        r = httpx.get(f"{urls[0]}/v1/sandboxes", headers=hb, timeout=30)
        return sid not in {s["id"] for s in r.json()["items"]}
    _wait(gone_from_a, "replica a still lists the sandbox destroyed through b")


def test_a_bad_store_url_stops_the_apiserver_with_what_to_change(tmp_path: Path) -> None:
    for url, words in ((f"postgresql://dsec:hunter2@/db?host={tmp_path}&port=5999",
                        "cannot reach the PostgreSQL state store"),
                       ("mongodb://x/y", "unknown state store scheme")):
        run = subprocess.run(
            [*DSEC, "apiserver", "--edge", f"e0=unix:{tmp_path}/none.sock", "--state-dir",
             str(tmp_path / "s"), "--store", url, "--listen", "127.0.0.1:0", "--gateway",
             "off", "--quiet"], capture_output=True, text=True, timeout=60, check=False)
        assert run.returncode != 0
        assert words in run.stderr, run.stderr
        assert "hunter2" not in run.stderr + run.stdout


def test_dsec_up_keeps_its_state_in_the_store_it_is_given(tmp_path: Path,
                                                          pg_dsn: str) -> None:
    import psycopg

    from dsec.cluster.local import LocalCluster

    with LocalCluster(subprocess=True, state_dir=str(tmp_path / "up"),
                      store=pg_dsn) as cluster:
        made = httpx.post(f"{cluster.url}/v1/sandboxes", json={}, timeout=30,
                          headers={"authorization": f"Bearer {cluster.api_key}"})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]

        def stored() -> bool:
            with psycopg.connect(pg_dsn) as conn:
                return conn.execute("SELECT 1 FROM sandboxes WHERE id = %s",
                                    (sid,)).fetchone() is not None
        _wait(stored, "the sandbox never reached the PostgreSQL store")
    assert not (tmp_path / "up" / "control.sqlite").exists()
