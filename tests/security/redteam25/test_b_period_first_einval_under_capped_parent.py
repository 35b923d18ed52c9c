"""Red team 25 B1: ``Governor.set_cpu_quota`` writes the period before the quota, so a
suppressed BE cap cannot be written at all when the edge runs in a cgroup that has a CFS
quota of its own (a systemd unit with ``CPUQuota=``, a Kubernetes pod with a CPU limit
- the deployment the Koordinator-style threshold is modelled on).

v1 checks every write of ``cpu.cfs_period_us``/``cpu.cfs_quota_us`` against the
parents' bandwidth (``tg_cfs_schedulable_down``: a child's quota/period must not exceed
the nearest capped ancestor's). Going from the sandbox's own cap (100 ms / 100 ms = 1
core) to a suppressed 0.3 core in 10 ms periods, the first write (period 10 ms, quota
still 100 ms) asks for 10 cores: EINVAL under any ancestor capped below 10 cores.
``_set_be_cap`` logs it at *debug* and goes on, every tick, so the BE sandbox keeps its
whole cap - suppression is silently off for every BE sandbox on such a node.

The comment says as much ("with a parent uncapped, any (quota, period) pair is valid").

Fix: order the two writes so the intermediate pair never exceeds max(old, new): write
the quota first when the period shrinks (new_quota/old_period), the period first when
it grows (old_quota/new_period) - the smaller of the two intermediates is always
<= sqrt(old x new); and log a failed suppression write at warning, once per sandbox.
"""

from __future__ import annotations

import os

import pytest

from dsec.edge.governor import Governor, SandboxCgroup

pytestmark = pytest.mark.root

CPU = "/sys/fs/cgroup/cpu"


def _w(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _r(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def test_suppressed_cap_written_under_a_capped_ancestor() -> None:
    if not os.path.isfile(os.path.join(CPU, "cpu.cfs_quota_us")):
        pytest.skip("needs the v1 cpu hierarchy at /sys/fs/cgroup/cpu")
    top = os.path.join(CPU, f"rt25-capped-{os.getpid()}")
    be = os.path.join(top, "dsec-x+be")
    box = os.path.join(be, "sb")
    try:
        os.makedirs(box)
        # the edge's own cgroup: capped at 1.5 cores (e.g. systemd CPUQuota=150%)
        _w(os.path.join(top, "cpu.cfs_quota_us"), "150000")
        # the BE sandbox as created: its own 1-core cap in 100 ms periods
        _w(os.path.join(box, "cpu.cfs_quota_us"), "100000")
        gov = Governor.__new__(Governor)
        cg = SandboxCgroup(1, {"cpu": box})
        # what _set_be_cap asks when the suppressor scales it to 0.3 core
        try:
            gov.set_cpu_quota(cg, 0.3, period_us=10_000)
        except OSError as exc:
            pytest.fail(f"suppressed cap refused by the kernel: {exc!r} "
                        "(period written before quota: 100 ms / 10 ms = 10 cores "
                        "> the ancestor's 1.5)")
        assert (_r(os.path.join(box, "cpu.cfs_quota_us")),
                _r(os.path.join(box, "cpu.cfs_period_us"))) == (3000, 10_000)
        # and back to its own cap (release / close)
        gov.set_cpu_quota(cg, 1.0)
        assert (_r(os.path.join(box, "cpu.cfs_quota_us")),
                _r(os.path.join(box, "cpu.cfs_period_us"))) == (100_000, 100_000)
    finally:
        for d in (box, be, top):
            try:
                os.rmdir(d)
            except OSError:
                pass
