"""Fixtures of the multi-host tests: a cluster of test hosts (network namespaces, each with
a real ``dsec edge``), checked for leftovers after each use."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dsec.cluster.hosts import HostCluster, HostsConfig
from dsec.ownership import start_time


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _mounts_under(path: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [ln.split()[4] for ln in f if ln.split()[4].startswith(path)]


@pytest.fixture
def host_cluster(tmp_path: Path) -> Iterator[Callable[..., HostCluster]]:
    """``host_cluster(hosts=3, ...)`` -> a started :class:`HostCluster` (HostsConfig
    fields as keywords); stopped after the test, which then checks that it left no
    namespace, process or mount behind."""
    made: list[HostCluster] = []

    def make(**kw: object) -> HostCluster:
        hc = HostCluster(HostsConfig(state_dir=str(tmp_path / f"hc{len(made)}"), **kw))  # type: ignore[arg-type]
        made.append(hc)
        hc.start()
        return hc

    try:
        yield make
    finally:
        pids: list[int] = []
        for hc in made:
            pids += [p for p in hc.processes().values() if p is not None]
            hc.stop()
        for hc in made:
            left = {n for n in _netns() if n.startswith(hc.id)}
            assert not left, f"netns left behind: {left}"
            assert not _mounts_under(hc.state_dir), _mounts_under(hc.state_dir)
        left = [p for p in pids if start_time(p, running=True) is not None]
        assert not left, f"processes left behind: {left}"
