"""The pieces of the rl_agent figures that can be wrong without a benchmark run: reading
a process's scheduler stamp and CPU, and the per-CPU clock calibration."""

from __future__ import annotations

import os
import time

from dsec.bench.rl_agent import _cpu_of, _exec_start, _sched_offsets


def test_reads_stamp_and_cpu_of_a_real_process() -> None:
    with open("/proc/self/sched") as f:
        sched = f.read()
    with open("/proc/self/stat") as f:
        stat = f.read()
    ex = _exec_start(sched)
    assert ex is not None and ex > 0
    cpu = _cpu_of(sched + stat)
    assert cpu in os.sched_getaffinity(0)
    assert _exec_start("no such line") is None and _cpu_of("x") is None


def test_offsets_put_a_fresh_stamp_at_now() -> None:
    before = os.sched_getaffinity(0)
    offs = _sched_offsets()
    assert os.sched_getaffinity(0) == before                # affinity restored
    assert set(offs) == before
    with open("/proc/self/sched") as f, open("/proc/self/stat") as g:
        text = f.read() + g.read()
    stamp, cpu = _exec_start(text), _cpu_of(text)
    assert stamp is not None and cpu is not None
    assert abs(stamp + offs[cpu] - time.time()) < 1.0        # seconds apart at worst
