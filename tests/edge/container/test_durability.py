"""Durable before acknowledged, and nothing left behind: a real ``dsec edge --backend
container`` process is killed with SIGKILL right after it answers and in the middle of
creates, then started again on the same state dir. Every acknowledged create must come
back; everything on the host must be either a sandbox the edge knows or gone."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.bench.faults._edge import EdgeProcess
from dsec.edge.service import EdgeClient
from dsec.errors import DsecError, InvalidTransition, SandboxNotFound
from dsec.wire.spec import SandboxSpec

pytestmark = pytest.mark.root

SPEC = SandboxSpec(backend="container", memory_bytes=64 << 20, pids_max=64)


@pytest.fixture
async def edge(tmp_path: object, images_dir: str) -> AsyncIterator[EdgeProcess]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    e = EdgeProcess(os.path.join(str(tmp_path), "edge"), images_dir)
    try:
        yield e
    finally:
        await e.wipe()
        left = e.census()
        assert left.sandboxes() == set(), f"host still holds {left.counts()}: {sorted(left.sandboxes())[:5]}"


def _running(pid: int) -> bool:
    """True if ``pid`` is a process that is not a zombie (killed orphans are reaped by
    PID 1 whenever it gets to it; a zombie holds nothing but its pid)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return False
    return raw[raw.rfind(b")") + 2:].split()[0] != b"Z"


def _sid(rnd: random.Random, node: str) -> str:
    return f"sb-{rnd.getrandbits(48):012x}-{node}"


async def _assert_host_matches(edge: EdgeProcess, c: EdgeClient) -> list[str]:
    """Everything the host holds belongs to a sandbox the edge lists, and vice versa."""
    live = {i.id for i in await c.list()}
    census = edge.census()
    assert census.sandboxes() == live, (census, live)
    assert set(census.tasks) == live  # each live sandbox has its init; no stray processes
    return sorted(live)


async def test_acknowledged_creates_survive_kill_9(edge: EdgeProcess) -> None:
    """The issue's repro: kill -9 the moment a create is answered (and with more creates
    in flight), restart, get(id). Before: SandboxNotFound in ~7 of 10 tries, and the
    sandboxes' inits, cgroups and dirs lived on forever."""
    rnd = random.Random(12)
    acked: list[str] = []
    unacked: list[str] = []
    for _ in range(8):
        await edge.start()
        async with await edge.client() as c:
            for _ in range(2):  # answered, then the next one is killed right after its answer
                acked.append((await c.create(SPEC, sandbox_id=_sid(rnd, edge.node_id))).id)
            ids = [_sid(rnd, edge.node_id) for _ in range(4)]
            tasks = [asyncio.ensure_future(c.create(SPEC, sandbox_id=i)) for i in ids]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            edge.kill9()  # the moment one of them is acknowledged; the others are mid-create
            for sid, t in zip(ids, tasks, strict=True):
                try:
                    acked.append((await t).id)
                except DsecError:
                    unacked.append(sid)
    assert len(acked) >= 20
    await edge.start()
    async with await edge.client() as c:
        lost = []
        for sid in acked:
            try:
                info = await c.get(sid)
            except SandboxNotFound:
                lost.append(sid)
                continue
            if info.state != "running":
                lost.append(sid)
        assert lost == [], f"{len(lost)} of {len(acked)} acknowledged creates lost"
        for sid in unacked:  # never answered: running (made durable first) or ended with a reason
            try:
                info = await c.get(sid)
            except SandboxNotFound:
                continue  # killed before its intent was recorded: the backend never started
            assert info.state == "running" or info.reason == "create_failed", info
        live = await _assert_host_matches(edge, c)
        r = await c.exec(live[0], "echo alive")
        assert r.stdout == b"alive\n"


@pytest.mark.serial  # needs 20 creates acknowledged within its window before the kill (0 beside 6 workers)
async def test_kill_9_under_load_keeps_every_answer_and_leaks_nothing(
        edge: EdgeProcess) -> None:
    """Concurrent create/pause/destroy (some with a small disk cap), kill -9 at a random
    moment, three times. After the last restart: every acknowledged create is there unless
    its destroy was acknowledged too, every acknowledged pause comes back paused, every
    acknowledged destroy stays destroyed, and the host holds exactly the live sandboxes."""
    rnd = random.Random(5)
    created: set[str] = set()
    destroyed: set[str] = set()
    paused: set[str] = set()
    tried: set[str] = set()  # a destroy or pause was sent but not answered: either outcome
    disk_spec = SandboxSpec(backend="container", memory_bytes=64 << 20, pids_max=64,
                            disk_bytes=4 << 20)
    for _ in range(3):
        await edge.start()
        c = await edge.client()

        async def worker(c: EdgeClient = c) -> None:
            while True:
                sid = _sid(rnd, edge.node_id)
                await c.create(disk_spec if rnd.random() < 0.3 else SPEC, sandbox_id=sid)
                created.add(sid)
                op = rnd.random()
                if op < 0.7:
                    tried.add(sid)
                if op < 0.5:
                    await c.destroy(sid)
                    destroyed.add(sid)
                elif op < 0.7:
                    await c.pause(sid)
                    paused.add(sid)
                tried.discard(sid)

        tasks = [asyncio.ensure_future(worker()) for _ in range(12)]
        await asyncio.sleep(rnd.uniform(0.4, 1.2))
        edge.kill9()
        res = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, DsecError) for r in res), res
        await c.close()
    assert len(created) >= 20 and destroyed and paused
    await edge.start()
    async with await edge.client() as c:
        lost = []
        for sid in sorted(created):
            try:
                info = await c.get(sid)
            except SandboxNotFound:
                lost.append((sid, "not found"))
                continue
            want = ("destroyed" if sid in destroyed else
                    "paused" if sid in paused else "running")
            if info.state != want and not (sid in tried and info.state in (
                    "running", "paused", "destroyed")):
                lost.append((sid, f"{info.state} ({info.reason}), want {want}"))
        assert lost == [], f"{len(lost)} of {len(created)} acknowledged answers lost: {lost[:5]}"
        live = await _assert_host_matches(edge, c)
        assert edge.census().disk  # disk subvolumes came back with their sandboxes
        p = min(paused - destroyed)
        assert (await c.exec(p, "echo thawed")).stdout == b"thawed\n"  # auto-resume
        assert p in live


async def test_leftovers_the_journal_does_not_know_are_destroyed_with_a_reason(
        edge: EdgeProcess, images_dir: str) -> None:
    """A sandbox on the host that no journal record names (made by a backend the edge
    never heard of) is destroyed when the edge starts, and get(id) says why."""
    from dsec.edge.backends.container import ContainerBackend, DirectoryImages
    from dsec.ids import SandboxId

    stray = SandboxId(_sid(random.Random(3), edge.node_id))
    b = ContainerBackend(root_dir=edge.root, images=DirectoryImages(images_dir))
    await b.create(stray, SandboxSpec(backend="container", disk_bytes=2 << 20))
    await b.close()  # leaves it running, as a crashed edge would
    assert edge.census().tasks.get(stray)
    await edge.start()
    async with await edge.client() as c:
        info = await c.get(stray)
        assert (info.state, info.reason) == ("destroyed", "node_lost")
        ev = (await c.events(stray))[-1]
        assert "found on the host at edge start with no journal record" in ev.detail
        assert "1 process(es)" in ev.detail and "disk subvolume" in ev.detail
        assert edge.census().sandboxes() == set()
        with pytest.raises(InvalidTransition, match="node_lost"):
            await c.exec(stray, "true")
    edge.stop()
    await edge.start()  # the tombstone itself is in the journal
    async with await edge.client() as c:
        assert (await c.get(stray)).reason == "node_lost"


_LAYERED_EDGE = """
import asyncio, sys
from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import SandboxSpec
from dsec.image import LayerStore, MountCache, ensure_busybox_base
from dsec.edge.backends.container.images import StoreImages
async def main():
    store = LayerStore(sys.argv[1])
    store.tag(ensure_busybox_base(store).digest, "base")
    cache = MountCache()
    b = ContainerBackend(root_dir=sys.argv[2], images=StoreImages(store, cache),
                         runtime=sys.argv[4])
    await b.create(sys.argv[3], SandboxSpec(backend="container", image="base"))
    print(cache.root, flush=True)
    await asyncio.sleep(1000)
asyncio.run(main())
"""


@pytest.mark.parametrize("runtime", ["native", "runc", "runsc"])
async def test_adopted_sandbox_reads_its_layers_after_the_dead_root_is_reclaimed(
        tmp_path: object, runtime: str) -> None:
    """kill -9 leaves the EROFS layer mounts of the dead process's cache; the next cache
    detaches them (lazily) and an adopted sandbox still reads its image files: overlayfs
    holds its own clones of the lower layers (runc's overlay is a host mount, too)."""
    import shutil
    import subprocess
    import sys

    from dsec.edge.backends.container import ContainerBackend
    from dsec.edge.backends.container.images import StoreImages
    from dsec.ids import SandboxId
    from dsec.image import LayerStore, MountCache
    from dsec.wire.spec import ExecRequest

    if os.geteuid() != 0 or (runtime != "native" and shutil.which(runtime) is None):
        pytest.skip(f"needs root (and {runtime})")
    store_dir, root = os.path.join(str(tmp_path), "store"), os.path.join(str(tmp_path), "r")
    sid = SandboxId(_sid(random.Random(9), "t1"))
    spec = SandboxSpec(backend="container", image="base")
    edge = subprocess.Popen([sys.executable, "-c", _LAYERED_EDGE, store_dir, root, sid,  # noqa: ASYNC220
                             runtime], stdout=subprocess.PIPE)
    b = cache = None
    try:
        assert edge.stdout is not None
        old_root = edge.stdout.readline().decode().strip()
        assert old_root.startswith("/run/dsec/m")
        edge.kill()
        edge.wait()
        cache = MountCache()
        # Every cache start reclaims the host's dead roots, so another cache starting
        # beside this test (another test, another edge) may have reclaimed it first:
        # what holds is that none of its mounts is left and the root itself is gone.
        mounts = await asyncio.to_thread(Path("/proc/self/mountinfo").read_text)
        assert not [ln for ln in mounts.splitlines() if ln.split()[4].startswith(old_root + "/")]
        assert not os.path.exists(old_root)
        b = ContainerBackend(root_dir=root, images=StoreImages(LayerStore(store_dir), cache),
                             runtime=runtime)  # type: ignore[arg-type]
        assert await b.adopt(sid, spec)
        r = await b.exec(sid, ExecRequest(shell="head -c 5 /bin/busybox | od -c | head -1; "
                                                "ls /bin | wc -l"))
        assert r.exit_code == 0 and b"E   L   F" in r.stdout and int(r.stdout.split()[-1]) > 50
        other = SandboxId(_sid(random.Random(10), "t1"))
        await b.create(other, spec)  # new sandboxes use the layers re-mounted by this cache
        assert (await b.exec(other, ExecRequest(argv=("true",)))).exit_code == 0
        await b.destroy(other)
        await b.destroy(sid)
        assert b.census().sandboxes() == set()
    finally:
        if edge.poll() is None:
            edge.kill()
            edge.wait()
        if b is None and cache is not None:
            # failed before adopting: the killed edge's sandbox (its process, overlay and
            # disk pool under root) is still there; a backend over root destroys it
            b = ContainerBackend(root_dir=root, images=StoreImages(LayerStore(store_dir), cache),
                                 runtime=runtime)  # type: ignore[arg-type]
            for s in b.census().sandboxes():
                await b.destroy(SandboxId(s))
        if b is not None:
            for s in b.sandbox_ids():
                await b.destroy(SandboxId(s))
            await b.close()
            b.governor.remove_base()
        if cache is not None:
            cache.close()


async def test_destroy_removes_what_the_host_holds_for_an_id_the_node_forgot(
        tmp_path: object, images_dir: str) -> None:
    """DELETE of an id the node has no record of, whose traces are still on the host (a
    directory, cgroups with a process inside), removes them and answers with a tombstone
    instead of SandboxNotFound; an id with no traces is still SandboxNotFound."""
    import subprocess

    from dsec.edge.admission import Capacity
    from dsec.edge.backends.container import ContainerBackend, DirectoryImages
    from dsec.edge.governor import Limits
    from dsec.edge.node import EdgeNode, NodeConfig

    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    root = os.path.join(str(tmp_path), "root")
    backend = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir))
    cfg = NodeConfig(node_id="t1", capacity=Capacity(cpu_milli=10_000, memory_bytes=1 << 34,
                                                     max_sandboxes=10),
                     state_dir=os.path.join(str(tmp_path), "state"))
    rnd = random.Random(4)
    sleeper = None
    async with EdgeNode(cfg, backend) as node:
        sid = _sid(rnd, "t1")
        cg = backend.governor.create(sid, Limits(100, 64 << 20, 16))
        os.makedirs(os.path.join(root, "sb", sid, "upper"))
        sleeper = subprocess.Popen(["sleep", "1000"])  # noqa: ASYNC220 - a host process to find
        for procs in cg.procs_files:
            Path(procs).write_text(str(sleeper.pid))
        try:
            found = backend.census(sid).describe(sid)
            assert found.startswith("directory, ") and "1 process(es)" in found
            info = await node.destroy(sid, reason="evicted")
            assert (info.state, info.reason) == ("destroyed", "evicted")
            assert "the node had no record of it" in node.events(sid)[-1].detail
            assert sleeper.wait(10) == -9
            assert backend.census().sandboxes() == set()
            with pytest.raises(SandboxNotFound):
                await node.destroy(_sid(rnd, "t1"))
        finally:
            if sleeper.poll() is None:
                sleeper.kill()
                sleeper.wait()
    backend.governor.remove_base()


_BARE_EDGE = """
import asyncio, sys
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.wire.spec import ExecRequest, SandboxSpec
async def main():
    b = ContainerBackend(root_dir=sys.argv[1], images=DirectoryImages(sys.argv[2]),
                         runtime=sys.argv[3])
    for i, sid in enumerate(sys.argv[4:]):
        await b.create(sid, SandboxSpec(backend="container", disk_bytes=(4 << 20) if i else None))
        await b.exec(sid, ExecRequest(shell="sleep 1000", background=True))
    print("ready", flush=True)
    await asyncio.sleep(1000)
asyncio.run(main())
"""


@pytest.mark.parametrize("runtime", ["native", "runc", "runsc"])
async def test_reconcile_removes_every_trace_of_what_is_not_kept(
        tmp_path: object, images_dir: str, runtime: str) -> None:
    """After kill -9: keep one sandbox, reconcile away the other (processes, cgroups in
    every hierarchy - runc makes them in blkio, cpuset, devices, ... too -, its disk
    subvolume, runc's rootfs mount and state dir, its directory)."""
    import shutil
    import subprocess
    import sys

    from dsec.edge.backends.container import ContainerBackend, DirectoryImages
    from dsec.ids import SandboxId
    from dsec.wire.spec import ExecRequest

    if os.geteuid() != 0 or (runtime != "native" and shutil.which(runtime) is None):
        pytest.skip(f"needs root (and {runtime})")
    root = os.path.join(str(tmp_path), "root")
    rnd = random.Random(21)
    keep, drop = SandboxId(_sid(rnd, "t1")), SandboxId(_sid(rnd, "t1"))
    edge = subprocess.Popen([sys.executable, "-c", _BARE_EDGE, root, images_dir, runtime,  # noqa: ASYNC220
                             keep, drop], stdout=subprocess.PIPE)
    b = None
    try:
        assert edge.stdout is not None and edge.stdout.readline() == b"ready\n"
        edge.kill()
        edge.wait()
        b = ContainerBackend(root_dir=root, images=DirectoryImages(images_dir),
                             runtime=runtime)  # type: ignore[arg-type]
        before = b.census()
        assert before.sandboxes() == {keep, drop}
        assert len(before.tasks[drop]) >= 2 and drop in before.disk
        if runtime != "native":  # its rootfs overlay is a host mount; cgroups everywhere
            # (runsc keeps its state as files: not a directory the census lists)
            assert (drop in before.runc) == (runtime == "runc") and before.mounts[drop]
            assert len(before.cgroups[drop]) > 5
        assert await b.adopt(keep, SandboxSpec(backend="container"))
        left = await b.reconcile({keep})
        assert [x.sandbox_id for x in left] == [drop]
        assert "could not" not in left[0].what and left[0].spec is not None
        after = b.census()
        assert after.sandboxes() == {keep} and after.counts() == {
            "dirs": 1, "cgroups": len(before.cgroups[keep]), "tasks": len(before.tasks[keep]),
            "mounts": len(before.mounts.get(keep, ())), "runc": int(runtime == "runc"),
            "disk": 1, "pool_mounts": 1, "memory_groups": 0,
            "scratch": int(runtime == "native")}   # its /dev and /tmp dir (shared scratch)
        for _ in range(500):  # SIGKILLed: out of its cgroup at once, gone a moment later
            if not [p for p in before.tasks[drop] if _running(p)]:
                break
            await asyncio.sleep(0.01)
        assert not [p for p in before.tasks[drop] if _running(p)]
        r = await b.exec(keep, ExecRequest(shell="echo kept"))
        assert r.stdout == b"kept\n"
        await b.destroy(keep)
        assert b.census().sandboxes() == set()
    finally:
        if edge.poll() is None:
            edge.kill()
            edge.wait()
        if b is not None:
            for s in b.sandbox_ids():
                await b.destroy(SandboxId(s))
            await b.reconcile(set())
            await b.close()
            b.governor.remove_base()
