"""Sandbox cgroups nest under the edge's *own* cgroup; an edge restarted in another
cgroup (another login session's scope, another service manager) finds the earlier
ones through the recorded parents (census.recorded_parents) and adopts each sandbox
by the dirs in its record. Memory groups do not: ``_group_dir``, ``remove_group`` and
``list_groups`` take the *current* process's memory base. So after such a restart:

* ``adopt`` of a grouped sandbox calls ``_set_group_limit`` on ``<new base>/+mg-...``,
  which does not exist: the OSError escapes ``adopt`` (after the sandbox was put in
  the group table, before it is watched) - a live sandbox the edge cannot adopt;
* its group's limit is never set again, and when the members go, the group's cgroup
  under the old parent is not removed (``remove_group`` answers "gone" for the path
  under the new base).

Repro: two members made by an edge in the test's memory cgroup; a second edge process
in a child memory cgroup adopts, destroys both and reconciles.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from tests.edge.container.conftest import _cleanup, new_sid

from .conftest import MIB, spec

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

_EDGE = textwrap.dedent("""
    import asyncio, json, os, sys
    import msgspec
    from dsec.edge.backends.container import ContainerBackend, DirectoryImages
    from dsec.wire.spec import SandboxSpec
    root, images, gdir, sids, specs = sys.argv[1], sys.argv[2], sys.argv[3], \\
        json.loads(sys.argv[4]), json.loads(sys.argv[5])
    def limit():
        try:
            with open(os.path.join(gdir, "memory.limit_in_bytes")) as f:
                return int(f.read())
        except OSError as exc:
            return repr(exc)
    async def main():
        out = {"adopt": {}}
        b = ContainerBackend(root_dir=root, images=DirectoryImages(images),
                             memory_group_size=2)
        try:
            for sid, raw in zip(sids, specs):
                try:
                    out["adopt"][sid] = await b.adopt(sid, msgspec.json.decode(
                        raw.encode(), type=SandboxSpec))
                except Exception as exc:
                    out["adopt"][sid] = f"{type(exc).__name__}: {exc}"
            out["limit_after_adopt"] = limit()
            for sid in sids:
                try:
                    await b.destroy(sid)
                except Exception as exc:
                    out.setdefault("destroy", {})[sid] = repr(exc)
            await b.reconcile(set())
            out["group_dir_left"] = os.path.isdir(gdir)
        finally:
            await b.close()
            b.governor.remove_base()
        print(json.dumps(out), flush=True)
    asyncio.run(main())
""")


def _own_memory_cgroup() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            return "/sys/fs/cgroup/memory" + path
    raise AssertionError("no v1 memory cgroup")


def _as_if_dead(name: str, root: str) -> None:
    """The test process stands in for an edge killed -9: its claim of the cgroup name
    is made a dead process's (a live claimer on the same root is refused: one backend
    per root)."""
    from dsec.edge.backends.container.census import NAMES_DIR
    with open(os.path.join(NAMES_DIR, name), "w") as f:
        f.write(f"{root}\n999999 1\n")


def _rmdir_tree(top: str) -> None:
    """rmdir (empty) cgroup dirs at and below ``top``, deepest first."""
    for sub in sorted((w[0] for w in os.walk(top)), key=len, reverse=True):
        with contextlib.suppress(OSError):
            os.rmdir(sub)


async def test_an_edge_restarted_in_another_cgroup_adopts_and_removes_its_groups(
        tmp_path: object, images_dir: str) -> None:
    if not os.path.isdir("/sys/fs/cgroup/memory"):
        pytest.skip("by design: memory groups are v1 only")
    root = os.path.join(str(tmp_path), "r")
    b1 = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir),
                          memory_group_size=2)
    other = os.path.join(_own_memory_cgroup(), f"rt26c-{os.getpid()}")
    os.mkdir(other)
    a, a2 = new_sid(), new_sid()
    out: dict[str, object] = {}
    try:
        await b1.create(a, spec("p", 64))
        await b1.create(a2, spec("p", 64))
        gdir = b1.box(a).cg.dirs["memory"]
        specs = [msgspec.json.encode(b1.box(s).spec).decode() for s in (a, a2)]
        await b1.close()                 # the sandboxes run on, as after a kill -9
        _as_if_dead(b1.cgroup_name, root)   # ... of the process that claimed the name
        enter = f"echo $$ > {os.path.join(other, 'cgroup.procs')}; "
        r = subprocess.run(  # noqa: ASYNC221 - a whole edge process, run to its end
            ["/bin/sh", "-c", enter + 'exec "$@"', "sh", sys.executable, "-c", _EDGE,
             root, images_dir, gdir, json.dumps([a, a2]), json.dumps(specs)],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, check=False)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert (out["adopt"], out["limit_after_adopt"], out["group_dir_left"]) == (
            {a: True, a2: True}, 128 * MIB, False), out
    finally:
        # whatever is left under either parent (the edge in `other` may have failed)
        b0 = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir),
                              memory_group_size=2)
        for s in (a, a2):
            with contextlib.suppress(Exception):
                await b0.destroy(s)
        await b0.reconcile(set())
        await _cleanup(b0)
        _rmdir_tree(os.path.join(_own_memory_cgroup(), f"dsec-{b0.cgroup_name}"))
        _rmdir_tree(other)


async def test_an_edge_restarted_in_another_cgroup_keeps_its_grouped_sandboxes(
        tmp_path: object, images_dir: str) -> None:
    """The same at the node: ``_adopt_all`` takes the raising adopt for a dead sandbox
    ("adopt failed", buried ``node_lost``) and the reconciliation that follows kills
    it. Every grouped sandbox of an edge restarted in another cgroup is destroyed -
    running, answered, with its processes and files - where ungrouped ones are adopted
    (test_crash_points: test_restart_in_another_cgroup_still_finds_what_the_host_holds)."""
    from dsec.bench.faults._edge import EdgeProcess
    from dsec.wire.spec import SandboxSpec

    class _EdgeIn(EdgeProcess):
        cgroup: str | None = None

        def _spawn(self):  # type: ignore[no-untyped-def]
            if self.cgroup is None:
                return super()._spawn()
            enter = f"echo $$ > {os.path.join(self.cgroup, 'cgroup.procs')}; "
            with open(self.log, "ab") as log:
                return subprocess.Popen(["/bin/sh", "-c", enter + 'exec "$@"', "sh",
                                         *self.argv()], stdout=subprocess.DEVNULL, stderr=log)

    if not os.path.isdir("/sys/fs/cgroup/memory"):
        pytest.skip("by design: memory groups are v1 only")
    e = _EdgeIn(os.path.join(str(tmp_path), "edge"), images_dir, node_id="rtc",
                extra=("--backend-opt", "container.memory_group_size=2"))
    other = os.path.join(_own_memory_cgroup(), f"rt26c2-{os.getpid()}")
    os.mkdir(other)
    s = SandboxSpec(backend="container", memory_bytes=64 * MIB, pids_max=64)
    try:
        await e.start()
        async with await e.client() as c:
            ids = [(await c.create(s)).id for _ in range(2)]
            for sid in ids:
                await c.exec(sid, "echo keep > /root/state")
        e.kill9()
        e.cgroup = other                      # restarted in another cgroup
        await e.start()
        async with await e.client() as c:
            got = {sid: ((i := await c.get(sid)).state, i.reason) for sid in ids}
        assert {sid: st for sid, (st, _) in got.items()} == {sid: "running" for sid in ids}, (
            f"grouped sandboxes after an edge restart in another cgroup: {got}")
    finally:
        await e.wipe()
        left = e.census()
        from dsec.edge.backends.container.census import cgroup_name_of
        # the first start's memory parent (and the group leaked there: the finding)
        _rmdir_tree(os.path.join(_own_memory_cgroup(), f"dsec-{cgroup_name_of(e.root)}"))
        _rmdir_tree(other)
        assert left.sandboxes() == set(), f"host still holds {left.counts()}"
