"""A2 (red21a): the vm tier's snapshot unpacks the guest's ``diff`` tar with the stdlib
tarfile (vm/upper.py, in a worker thread of the edge). The guest is hostile and writes
the tar's headers:

- a pax extended header of ASCII digits makes Python 3.11.7's tarfile (before the
  CVE-2024-6232 fix, 3.11.10) search ``\\d+ hdrcharset=`` quadratically, inside ``re``,
  holding the GIL: the edge's event loop (every sandbox of the node) stops. 48 KiB of
  digits: ~4 s; the diff may be as large as the sandbox's disk cap (1 GiB by default),
  i.e. the node never comes back;
- a GNU long-name (or pax) header of any size is read whole into memory (twice) before
  any of extract_upper's bounds (path bytes, entries) is looked at: the edge allocates
  ~2x the guest's disk cap.

Both run before ``extract_upper`` sees a member, so its bounds do not apply. The repro
feeds extract_upper directly (what VmBackend._pull_upper does with the agent's bytes).
"""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
import time
import tracemalloc

import pytest

from dsec.edge.backends.vm.upper import Bounds, extract_upper
from dsec.errors import DsecError

BOUNDS = Bounds(data_bytes=1 << 20, entries=100, path_bytes=64 << 10)


def _pax_digits(n: int) -> bytes:
    ti = tarfile.TarInfo("././@PaxHeader")
    ti.type, ti.size = tarfile.XHDTYPE, n
    return (ti.tobuf(format=tarfile.USTAR_FORMAT) + b"1" * n + b"\0" * (-n % 512)
            + b"\0" * 1024)


def _gnu_longname(n: int) -> bytes:
    ti = tarfile.TarInfo("x")
    ti.type, ti.size = tarfile.GNUTYPE_LONGNAME, n
    f = tarfile.TarInfo("f")
    return (ti.tobuf(format=tarfile.GNU_FORMAT) + (b"ab/" * (n // 3 + 1))[:n]
            + b"\0" * (-n % 512) + f.tobuf(format=tarfile.GNU_FORMAT) + b"\0" * 1024)


async def test_a_hostile_pax_header_does_not_stall_the_edge_loop(tmp_path: object) -> None:
    dest = os.path.join(str(tmp_path), "upper")
    os.mkdir(dest)
    tar = _pax_digits(48 << 10)

    def unpack() -> None:
        try:
            extract_upper(io.BytesIO(tar), dest, BOUNDS)
        except DsecError:
            pass          # refused: fine, what matters is how long the loop stood still

    job = asyncio.ensure_future(asyncio.to_thread(unpack))
    worst = 0.0
    while not job.done():
        t = time.monotonic()
        await asyncio.sleep(0.01)
        worst = max(worst, time.monotonic() - t)
    await job
    assert worst < 1.0, (f"a 48 KiB pax header from the guest stopped the edge's event loop "
                         f"for {worst:.1f} s (quadratic regex under the GIL)")


def test_a_hostile_long_name_is_bounded_before_it_is_read(tmp_path: object) -> None:
    dest = os.path.join(str(tmp_path), "upper")
    os.mkdir(dest)
    tar = _gnu_longname(48 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(DsecError):
            extract_upper(io.BytesIO(tar), dest, BOUNDS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, (f"one 48 MiB long-name header made the edge allocate "
                             f"{peak >> 20} MiB though path_bytes is {BOUNDS.path_bytes}")
