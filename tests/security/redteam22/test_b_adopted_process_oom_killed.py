"""Red team 22 B9: a background process taken back after an edge restart never says
``oom_killed`` (commit c41e37a) when the OOM killer ends it.

``ProcessTable.start`` samples the sandbox's OOM counter into ``proc.oom_before``;
``_watch`` reports ``oom_killed`` only when ``oom_before is not None``. An adopted entry
(``_insert``/``_adopt`` after a restart) never gets one and ``DurableProcess`` does not
journal it, so a process that outlived an edge restart and is then OOM-killed ends with
137 and ``oom_killed`` False - the caller reads it as an ordinary kill and retries with
the same memory instead of asking for more (the point of the flag).

Fix direction: journal ``oom_before`` in DurableProcess (or sample the counter at
adoption: an OOM kill during the downtime is then missed, but later ones are seen).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dsec.bench.faults._edge import EdgeProcess
from tests.edge.container.conftest import images_dir  # noqa: F401  (fixture)
from tests.edge.container.test_process_durability import (  # noqa: F401  (fixture)
    SPEC,
    _alive,
    _host_pid,
    _list,
    _read,
    _start,
    edge,
)

pytestmark = pytest.mark.root

HOG = ("while [ ! -e /tmp/go ]; do sleep 0.05; done; "
       "head -c 400m /dev/zero | tail > /dev/null")


async def test_an_adopted_background_process_says_it_was_oom_killed(
        edge: EdgeProcess) -> None:  # noqa: F811
    await edge.start()
    async with await edge.client() as c:
        sid = (await c.create(SPEC)).id            # 64 MiB
        hog = await _start(c, sid, HOG)
        host = _host_pid(sid, hog.pid)
    edge.kill9()
    await asyncio.sleep(0.3)
    assert _alive(host)
    await edge.start()
    async with await edge.client() as c:
        assert (await _list(c, sid))[hog.pid].running
        Path(f"/proc/{host}/root/tmp/go").touch()    # the hog starts, with the edge up
        out, res = await _read(c, sid, hog.pid, until=b"\xff")
        assert res is not None, out
        assert res.exit_code == 137, (res, out)
        assert res.oom_killed, (f"process {hog.pid}, taken back after the restart, was "
                                f"OOM-killed (137) but its result says oom_killed="
                                f"{res.oom_killed}: {res}")
