"""The qos bench's memory half reads PSI from a cgroup v2 directory holding only its own
processes (hybrid hosts: the v2 mount has no controller, PSI is still accounted per v2
cgroup); entering it and leaving it restore the process's cgroup and leave no directory."""

from __future__ import annotations

import os

import pytest

from dsec.bench.qos import _leave_psi_cgroup, _own_psi_cgroup
from dsec.edge.qos import parse_psi

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]


def _v2_path() -> str | None:
    with open("/proc/self/cgroup") as f:
        return next((line.strip().split(":", 2)[2] for line in f
                     if line.startswith("0::")), None)


def test_psi_cgroup_of_its_own_then_back(tmp_path: object) -> None:
    before = _v2_path()
    path = _own_psi_cgroup(str(tmp_path))
    if path is None:
        pytest.skip("no cgroup v2 mount without controllers here (a v2 host: the governor "
                    "owns the tree)")
    try:
        assert _v2_path() == os.path.join(before or "/", os.path.basename(
            os.path.dirname(path)))
        with open(path) as f:
            psi = parse_psi(f.read())
        assert psi.some_avg10 >= 0.0
    finally:
        _leave_psi_cgroup(path)
    assert _v2_path() == before
    assert not os.path.exists(os.path.dirname(path))
