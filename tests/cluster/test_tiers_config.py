"""A node offering several isolation tiers (issue 21): each layered backend (container,
gvisor, vm) gets a root dir of its own and the node's ONE images object, whichever door
starts the node (``dsec edge --backend ...``, ``dsec up --tiers``, an in-process
LocalCluster). The gvisor and vm backends here are fakes registered under those names
that record their options: what is under test is the wiring, not the tiers."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from dsec import LocalCluster
from dsec.cli.edge import _backend_opts
from dsec.cli.up import up
from dsec.cluster.local import _up_flags
from dsec.cluster.runtime import ClusterConfig, ClusterRuntime
from dsec.edge import backends as registry
from dsec.edge.admission import Capacity
from dsec.edge.backends.simulated import NodeLatencyProfile, SimulatedBackend
from dsec.wire.node import Resources


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[dict[str, Any]]]]:
    seen: dict[str, list[dict[str, Any]]] = {"gvisor": [], "vm": []}
    for name, got in seen.items():
        def make(got: list[dict[str, Any]] = got, **opts: Any) -> SimulatedBackend:
            got.append(opts)
            return SimulatedBackend(profile=NodeLatencyProfile.zero())
        monkeypatch.setitem(registry._FACTORIES, name, make)
    yield seen


def test_dsec_edge_gives_each_tier_its_root_and_the_nodes_one_images(tmp_path: Any) -> None:
    state, layers = str(tmp_path / "state"), str(tmp_path / "layers")
    os.makedirs(layers)
    owned: list[Any] = []
    shared: dict[str, Any] = {}
    opts = {name: _backend_opts(name, "zero", 1, state, layers, owned, shared=shared)
            for name in ("container", "gvisor", "vm", "simulated")}
    try:
        for name in ("container", "gvisor", "vm"):
            assert opts[name]["root_dir"] == os.path.join(state, name)
            assert opts[name]["images"] is opts["container"]["images"], name
        assert "images" not in opts["simulated"]
        assert len(owned) == 1             # one MountCache for the node, not one per tier
        # without --layer-store a tier gets only its root (the backend says what it needs)
        assert _backend_opts("vm", "zero", 1, state, None, []) == {
            "root_dir": os.path.join(state, "vm")}
    finally:
        for o in owned:
            o.close()


def test_an_in_process_cluster_offers_its_tiers_on_every_edge(
        fakes: dict[str, list[dict[str, Any]]]) -> None:
    with LocalCluster(edges=1, tiers=("gvisor", "vm")) as cl:
        state = cl.state_dir
        assert [o["root_dir"] for o in fakes["gvisor"]] == [
            os.path.join(state, "gvisor", "edge-0")]
        assert [o["root_dir"] for o in fakes["vm"]] == [os.path.join(state, "vm", "edge-0")]
        assert fakes["gvisor"][0]["images"] is fakes["vm"][0]["images"]
        assert "disk_pool_bytes" in fakes["gvisor"][0]      # a disk pool as container
        assert "disk_pool_bytes" not in fakes["vm"][0]      # a scratch file per sandbox
        with cl.client(protocol="http") as c:
            for _ in range(200):
                if {"gvisor", "vm"} <= {b for n in c.nodes() for b in n.backends}:
                    break
                time.sleep(0.05)
            for tier in ("vm", "gvisor", "container"):
                sb = c.sandboxes.create(isolation=tier, detached=True)
                assert (sb.info.spec.backend, sb.isolation) == (
                    "simulated" if tier == "container" else tier, tier)


def test_edge_processes_get_a_backend_and_a_root_per_tier(tmp_path: Any) -> None:
    rt = ClusterRuntime(ClusterConfig(state_dir=str(tmp_path), tiers=("gvisor", "vm")))
    rt.capacity = Capacity(cpu_milli=1000, memory_bytes=1 << 30, max_sandboxes=10,
                           physical=Resources(cpu_milli=1000, memory_bytes=1 << 30))
    argv = rt._edge_argv("edge-0")
    backends = [argv[i + 1] for i, a in enumerate(argv) if a == "--backend"]
    assert backends == ["gvisor", "simulated", "vm"]
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "--backend-opt"]
    assert opts == [f"{b}.root_dir={tmp_path}/{b}/edge-0" for b in ("gvisor", "vm")]
    assert "--layer-store" in argv


def test_edges_of_one_host_split_its_pid_budget(tmp_path: Any) -> None:
    """Red team 21, A5: each edge's tiers budgeted the whole host's pids."""
    for edges, share in ((1, None), (4, 0.25)):
        rt = ClusterRuntime(ClusterConfig(state_dir=str(tmp_path / str(edges)), edges=edges,
                                          tiers=("gvisor",)))
        rt.capacity = Capacity(cpu_milli=1000, memory_bytes=1 << 30, max_sandboxes=10,
                               physical=Resources(cpu_milli=1000, memory_bytes=1 << 30))
        argv = rt._edge_argv("edge-0")
        got = [float(argv[i + 1]) for i, a in enumerate(argv) if a == "--pids-share"]
        assert got == ([] if share is None else [share])


def test_dsec_up_tiers_are_checked_and_passed_on() -> None:
    r = CliRunner().invoke(up, ["--tiers", "gvisor,kvm"])
    assert r.exit_code == 2 and "'kvm' is no isolation tier" in r.output, r.output
    assert _up_flags({"tiers": ("gvisor", "vm")}) == ["--tiers", "gvisor,vm"]


def test_two_pooled_tiers_split_the_nodes_disk_pool(tmp_path: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """container and gvisor each preallocate a btrfs pool: sized on their own, each took
    the default share of the free space and the second found none left (measured: the
    edge did not start). The node's pool is split between them instead."""
    from dsec.cli.edge import pool_split
    from dsec.edge.backends.container.disk import MIN_POOL_BYTES, POOL_SIZE_ENV, pool_size_for

    monkeypatch.delenv(POOL_SIZE_ENV, raising=False)
    d = str(tmp_path)
    assert pool_split(1, 4 << 30, d) == 4 << 30 and pool_split(1, None, d) is None
    assert pool_split(2, 4 << 30, d) == 2 << 30
    assert pool_split(2, 300 << 20, d) == MIN_POOL_BYTES
    vfs = os.statvfs(d)
    assert pool_split(2, None, d) == max(MIN_POOL_BYTES,
                                         pool_size_for(vfs.f_bavail * vfs.f_frsize) // 2)
    assert pool_split(2, None, None) is None
    monkeypatch.setenv(POOL_SIZE_ENV, str(6 << 30))
    assert pool_split(2, None, d) == 3 << 30
    rt = ClusterRuntime(ClusterConfig(state_dir=d, backend="container", tiers=("gvisor",),
                                      disk_pool_bytes=4 << 30))
    assert rt._backend_opts("gvisor", "edge-0")["disk_pool_bytes"] == 2 << 30
    assert rt._backend_opts("container", "edge-0")["disk_pool_bytes"] == 2 << 30
