"""Issue 22, descriptors: a real ``dsec edge --backend container`` started under a
deliberately low RLIMIT_NOFILE (soft = hard = 192) creates more sandboxes than that limit,
every one answers an exec, and all are destroyed with 0 errors; while they live the edge
holds far fewer descriptors than sandboxes (none per idle sandbox) and the zygote stays
within its budget. Before: three descriptors per sandbox in the edge (the init's pidfd,
the v1 OOM eventfd, ...) plus two per exec helper in the zygote - the 10,000-sandbox run
failed with EMFILE in destroy and left 9,997 sandboxes running."""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess

import pytest

from dsec.bench.faults._edge import EdgeProcess
from dsec.errors import DsecError
from dsec.wire.spec import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.serial]

LIMIT = 192
COUNT = LIMIT + 48
SPEC = SandboxSpec(backend="container", memory_bytes=32 << 20, pids_max=32)


class LowFdEdge(EdgeProcess):
    """The edge process, born with RLIMIT_NOFILE soft = hard = LIMIT."""

    def _spawn(self) -> subprocess.Popen[bytes]:
        def low() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))
        with open(self.log, "ab") as log:
            return subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL, stderr=log,
                                    preexec_fn=low)  # noqa: PLW1509 - only setrlimit


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _nofile(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard)
    raise AssertionError("no 'Max open files' line")


def _zygotes(edge_pid: int) -> list[int]:
    out = []
    with open(f"/proc/{edge_pid}/task/{edge_pid}/children") as f:
        for p in f.read().split():
            try:
                with open(f"/proc/{p}/comm") as c:
                    if c.read().strip() == "dsec-nsexec":
                        out.append(int(p))
            except OSError:
                pass
    return out


async def test_more_sandboxes_than_descriptors(tmp_path: object, images_dir: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    edge = LowFdEdge(os.path.join(str(tmp_path), "edge"), images_dir, node_id="fds",
                     max_sandboxes=COUNT + 10)
    try:
        await edge.start()
        assert _nofile(edge.pid) == (LIMIT, LIMIT)
        async with await edge.client() as c:
            sem = asyncio.Semaphore(8)
            errors: list[str] = []

            async def one() -> str | None:
                async with sem:
                    try:
                        sid = (await c.create(SPEC)).id
                        r = await c.exec(sid, ExecRequest(argv=("true",)))
                        if r.exit_code != 0:
                            errors.append(f"{sid}: exit {r.exit_code} {r.stderr!r}")
                        return sid
                    except Exception as exc:  # noqa: BLE001 - counted, asserted below
                        errors.append(repr(exc))
                        return None
            ids = [s for s in await asyncio.gather(*(one() for _ in range(COUNT))) if s]
            assert errors == [], errors[:5]
            assert len(ids) == COUNT
            held = _fds(edge.pid)
            # nothing per idle sandbox: the edge's own sockets, journal, pools, listeners
            assert held < LIMIT // 2, f"the edge holds {held} fds for {COUNT} sandboxes"
            for z in _zygotes(edge.pid):
                assert _fds(z) < LIMIT // 2, f"the zygote holds {_fds(z)} fds"
            # every one still answers (a second exec: most go through an exec helper)
            for sid in ids[:40]:
                assert (await c.exec(sid, ExecRequest(argv=("true",)))).exit_code == 0
            failed = []
            for k in range(0, len(ids), 60):
                res = await c.destroy_many(ids[k:k + 60])
                failed += [r for r in res if isinstance(r, DsecError)]
            assert failed == []
            assert [i.id for i in await c.list()] == []
        left = edge.census()
        assert left.sandboxes() == set(), left.counts()
    finally:
        await edge.wipe()
        left = edge.census()
        assert left.sandboxes() == set(), f"host still holds {left.counts()}"
