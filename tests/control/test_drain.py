"""``dsec node drain``: a drained edge gets no new sandboxes while the others take them,
its existing sandboxes keep working, the state shows in node listings at every door and
survives an apiserver restart, and only a superuser may drain (issue 16, Operations)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec.client.sync import Client
from dsec.cluster.local import LocalCluster
from dsec.errors import NotFound, PermissionDenied
from dsec.ids import node_of

_BIG = {"cpu_milli": 10**6, "memory_bytes": 1 << 40}


@pytest.fixture
def cluster(tmp_path: Path, cluster_store: str | None) -> Iterator[LocalCluster]:
    with LocalCluster(edges=2, state_dir=str(tmp_path / "state"), store=cluster_store,
                      **_BIG) as cl:
        yield cl


def _cli(cl: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DSEC_URL": cl.url, "DSEC_API_KEY": cl.api_key}
    return subprocess.run([sys.executable, "-c", "from dsec.cli.main import main; main()",
                           "node", *args], check=False, capture_output=True, text=True,
                          env=env,
                          timeout=60)


def test_drained_node_gets_no_creates_and_keeps_its_sandboxes(cluster: LocalCluster) -> None:
    with cluster.client(protocol="aether", session_lease_s=None) as c:
        # sandboxes on both nodes before the drain
        before = [c.sandboxes.create() for _ in range(12)]
        on = {node_of(sb.id) for sb in before}
        assert on == {"edge-0", "edge-1"}, on
        kept = [sb for sb in before if node_of(sb.id) == "edge-1"]

        done = _cli(cluster, "drain", "edge-1")
        assert done.returncode == 0, done.stderr
        assert "edge-1 drained" in done.stdout
        views = {n.id: n for n in c.nodes()}
        assert views["edge-1"].drained and views["edge-1"].drained_at > 0
        assert not views["edge-0"].drained

        # 0 new creates on the drained node, every door: gateway (create_many and
        # create), REST
        made = c.sandboxes.create_many(40)
        made += [c.sandboxes.create() for _ in range(10)]
        with cluster.client(protocol="http", session_lease_s=None) as h:
            made += [h.sandboxes.create() for _ in range(10)]
        assert len(made) == 60
        assert {node_of(sb.id) for sb in made} == {"edge-0"}

        # the drained node's sandboxes keep working until they end
        for sb in kept:
            assert sb.exec(["echo", "still here"]).stdout == b"still here\n"
            assert sb.refresh().state == "running"
        kept[0].kill()

        # undrain: placement uses it again
        done = _cli(cluster, "undrain", "edge-1")
        assert done.returncode == 0, done.stderr
        assert not {n.id: n for n in c.nodes()}["edge-1"].drained
        again = c.sandboxes.create_many(40)
        assert "edge-1" in {node_of(sb.id) for sb in again}


def test_only_a_superuser_drains_at_every_door(cluster: LocalCluster) -> None:
    admin_key = cluster.create_key("proj-admin", "default", role="admin")
    for protocol in ("http", "aether"):
        with Client(cluster.url, admin_key, gateway=cluster.gateway, protocol=protocol,
                    session_lease_s=None) as c:
            with pytest.raises(PermissionDenied, match="only a superuser"):
                c.drain_node("edge-0")
            with pytest.raises(PermissionDenied, match="only a superuser"):
                c.undrain_node("edge-0")
    r = httpx.post(f"{cluster.url}/v1/nodes/edge-0/drain",
                   headers={"authorization": f"Bearer {admin_key}"})
    assert r.status_code == 403, r.text
    r = httpx.post(f"{cluster.url}/v1/nodes/edge-0/drain")
    assert r.status_code == 401, r.text
    with cluster.client(session_lease_s=None) as c:
        assert not any(n.drained for n in c.nodes())
        with pytest.raises(NotFound, match="no edge node 'edge-9'"):
            c.drain_node("edge-9")
    # --migrate drains and moves what the node holds (nothing here: the moves themselves
    # are tests/control/test_drain_migrate.py's)
    done = _cli(cluster, "drain", "edge-0", "--migrate")
    assert done.returncode == 0 and "0 sandbox(es) moved" in done.stdout, done.stderr


def test_drain_survives_an_apiserver_restart(tmp_path: Path, cluster_store: str | None) -> None:
    state = str(tmp_path / "state")
    with LocalCluster(edges=2, state_dir=state, store=cluster_store, **_BIG) as cl:
        r = httpx.post(f"{cl.url}/v1/nodes/edge-0/drain",
                       headers={"authorization": f"Bearer {cl.api_key}"})
        assert r.status_code == 200 and r.json()["drained"] is True, r.text
        again = httpx.post(f"{cl.url}/v1/nodes/edge-0/drain",
                           headers={"authorization": f"Bearer {cl.api_key}"})
        assert again.json()["drained_at"] == r.json()["drained_at"]   # idempotent
    with LocalCluster(edges=2, state_dir=state, store=cluster_store, **_BIG) as cl:
        with cl.client(session_lease_s=None) as c:
            assert {n.id: n.drained for n in c.nodes()} == {"edge-0": True,
                                                           "edge-1": False}
            made = c.sandboxes.create_many(30)
            assert {node_of(sb.id) for sb in made} == {"edge-1"}
            c.undrain_node("edge-0")
        ls = _cli(cl, "ls", "--json")
        assert ls.returncode == 0, ls.stderr
        assert '"drained": true' not in ls.stdout
