"""``dsec node drain ID --migrate`` (issue 16): every sandbox of the drained node is
snapshotted, started from the snapshot on another node with its files, and ended with
reason ``migrated`` and an event naming its new id; a run cut short after it stored a
step (as an apiserver killed -9 right then) is carried on by the next run with no second
sandbox. Real containers on two real edges (both backends' files), over a real state
store of each kind; the CLI, the SDK over the gateway and REST."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec.client.sync import Client
from dsec.cluster.local import LocalCluster
from dsec.errors import DsecError
from dsec.ids import node_of
from tests.conftest import requires_root

pytestmark = requires_root


@pytest.fixture
def cluster(tmp_path: Path, cluster_store: str | None) -> Iterator[LocalCluster]:
    with LocalCluster(edges=2, backend="container", state_dir=str(tmp_path / "state"),
                      store=cluster_store) as cl:
        yield cl


def _cli(cl: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DSEC_URL": cl.url, "DSEC_API_KEY": cl.api_key}
    return subprocess.run([sys.executable, "-c", "from dsec.cli.main import main; main()",
                           "node", *args], check=False, capture_output=True, text=True,
                          env=env, timeout=120)


def test_drain_migrate_moves_every_sandbox_with_its_files_once(
        cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    with Client(cluster.url, cluster.api_key, protocol="aether",
                session_lease_s=None) as c:
        c.drain_node("edge-1")                   # so every sandbox starts on edge-0
        olds = [c.sandboxes.create(image="base") for _ in range(3)]
        assert {node_of(sb.id) for sb in olds} == {"edge-0"}
        for i, sb in enumerate(olds):
            sb.files.write(f"/root/mine-{i}", f"data of {i}".encode())
        c.undrain_node("edge-1")
        c.drain_node("edge-0")

        # the first run dies right after it stored its second create (the apiserver
        # killed -9 there: nothing after that step happened)
        plane = cluster.runtime.plane
        real = plane.store.put_migration
        created: list[str] = []

        def dies_after_second_create(row: Any) -> None:
            real(row)
            if row.state == "created":
                created.append(row.sandbox_id)
                if len(created) == 2:
                    raise RuntimeError("apiserver killed here (injected)")
        monkeypatch.setattr(plane.store, "put_migration", dies_after_second_create)
        with pytest.raises(DsecError):
            c.migrate_node("edge-0")
        monkeypatch.setattr(plane.store, "put_migration", real)

        # the operator runs it again, through the CLI
        done = _cli(cluster, "drain", "edge-0", "--migrate")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "3 sandbox(es) moved" in done.stdout, done.stdout
        moved = {line.split(" -> ")[0]: line.split(" -> ")[1]
                 for line in done.stdout.splitlines() if " -> " in line}
        assert set(moved) == {sb.id for sb in olds}

        # one new sandbox each, no more (the listing follows the edges' feed)
        _until(lambda: sorted(_live(c)) == sorted(moved.values()), lambda: _live(c))
        for i, sb in enumerate(olds):
            new = c.sandboxes.get(moved[sb.id])
            assert node_of(new.id) == "edge-1"
            assert new.files.read(f"/root/mine-{i}") == f"data of {i}".encode()
            assert new.exec(["cat", f"/root/mine-{i}"]).stdout == f"data of {i}".encode()
            # the original ended, its event names the reason and the new id
            ends = [e for e in sb.events() if e.to_state in ("destroying", "destroyed")]
            assert ends and ends[-1].reason == "migrated", ends
            assert moved[sb.id] in ends[-1].detail, ends

        # a third run finds nothing to do; REST answers the same report
        r = httpx.post(f"{cluster.url}/v1/nodes/edge-0/migrate", timeout=60,
                       headers={"authorization": f"Bearer {cluster.api_key}"})
        assert r.status_code == 200, r.text
        again = {m["sandbox_id"]: m.get("new_id") for m in r.json()["items"]}
        assert all(again[old] == new for old, new in moved.items() if old in again)
        assert sorted(_live(c)) == sorted(moved.values())


def _until(ok: Any, show: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, show()
        time.sleep(0.1)


def _live(c: Client) -> list[str]:
    return [sb.id for sb in c.sandboxes.list()
            if sb.state not in ("destroying", "destroyed", "failed")]


def test_migrate_refuses_a_node_not_drained_and_a_tenant(cluster: LocalCluster) -> None:
    with Client(cluster.url, cluster.api_key, protocol="http", session_lease_s=None) as c:
        sb = c.sandboxes.create(image="base")
        with pytest.raises(DsecError, match="not drained"):
            c.migrate_node(node_of(sb.id))
        assert sb.refresh().state == "running"
    r = httpx.post(f"{cluster.url}/v1/keys", json={"name": "t", "project": "default",
                                                    "role": "admin"},
                   headers={"authorization": f"Bearer {cluster.api_key}"}, timeout=30)
    tenant = r.json()["api_key"]
    for protocol in ("http", "aether"):
        with Client(cluster.url, tenant, protocol=protocol, session_lease_s=None) as t, \
                pytest.raises(DsecError, match="superuser"):
            t.migrate_node("edge-0")


def test_a_migrated_sandbox_keeps_its_remaining_ttl(cluster: LocalCluster) -> None:
    """The new sandbox expires when the original would have (the TTL left at its
    snapshot), not a whole TTL after the move."""
    with Client(cluster.url, cluster.api_key, protocol="http", session_lease_s=None) as c:
        c.drain_node("edge-1")
        old = c.sandboxes.create(image="base", ttl=3600)
        c.undrain_node("edge-1")
        time.sleep(2.0)                          # some of its life has passed
        c.drain_node("edge-0")
        report = c.migrate_node("edge-0")
        (item,) = report.items
        assert not item.error and item.new_id is not None, item
        new = c.sandboxes.get(item.new_id)
        assert node_of(new.id) == "edge-1"
        old_deadline = old.info.created_at + 3600
        spec = new.info.spec
        assert spec is not None and spec.ttl_s is not None
        new_deadline = new.info.created_at + spec.ttl_s
        # within the few seconds between the snapshot and the new sandbox's start
        assert old_deadline - 5 <= new_deadline <= old_deadline + 5, (
            f"the moved sandbox expires at {new_deadline:.0f}, the original at "
            f"{old_deadline:.0f} (ttl {spec.ttl_s})")
        assert spec.ttl_s < 3600 - 1


def test_a_migrated_sandbox_keeps_the_deadline_set_timeout_gave_it(
        cluster: LocalCluster) -> None:
    """Issue 19: the deadline is the edge's (set_timeout moved it), not created + ttl."""
    with Client(cluster.url, cluster.api_key, protocol="http", session_lease_s=None) as c:
        c.undrain_node("edge-0")
        c.drain_node("edge-1")
        old = c.sandboxes.create(image="base", ttl=3600)
        c.undrain_node("edge-1")
        deadline = old.set_timeout(600).expires_at
        assert deadline is not None
        c.drain_node("edge-0")
        (item,) = c.migrate_node("edge-0").items
        assert not item.error and item.new_id is not None, item
        new = c.sandboxes.get(item.new_id).info
        assert new.expires_at is not None
        assert deadline - 5 <= new.expires_at <= deadline + 5, (new.expires_at, deadline)
        c.undrain_node("edge-0")
