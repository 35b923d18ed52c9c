"""Red-team tests of the container backend's disk caps and snapshots: code inside a
sandbox (root with the container's default capabilities, seccomp, no CAP_SYS_ADMIN)
and other tenants trying to make the node pay more than a sandbox's cap.

A static C tool (``disktool.c``, compiled once per session with ``gcc -static``) is
stacked into sandboxes as a toolkit layer at ``/disktool/dt``, for what busybox cannot
do: FICLONE/copy_file_range reflinks, FS_IOC_SETFLAGS, raw btrfs ioctls, many files
with long paths. Full disks are real and small: tmpfs and loop filesystems this module
mounts and unmounts itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.container import ContainerBackend
from dsec.edge.backends.container.images import StoreImages
from dsec.edge.backends.container.linux import MNT_DETACH, umount2
from dsec.edge.backends.container.snapshot import host_room
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.errors import BackendError, CapacityExceeded, DsecError, ImageError, QuotaExceeded
from dsec.image import LayerStore, MountCache, ensure_busybox_base
from dsec.image.packdiff import RACY_WINDOW_NS
from dsec.wire.spec import ExecRequest, SandboxSpec

from .conftest import _cleanup

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def disktool(tmp_path_factory: pytest.TempPathFactory) -> str:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("needs gcc (and glibc's static libc.a) to build the disk tool")
    out = str(tmp_path_factory.mktemp("disktool") / "dt")
    r = subprocess.run([cc, "-static", "-O1", "-o", out, os.path.join(HERE, "disktool.c")],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"disktool.c did not compile: {r.stderr[-2000:]}"
    return out


@dataclass
class Env:
    node: EdgeNode
    backend: ContainerBackend
    store: LayerStore


@contextlib.asynccontextmanager
async def _env(root: str, disktool: str, *, store_dir: str | None = None,
               **kw: object) -> AsyncIterator[Env]:
    """A node with one container backend (root_dir under ``root``) whose images come from
    a layer store (``store_dir``, default under ``root``) holding busybox and disktool."""
    store = LayerStore(store_dir or os.path.join(root, "layers"))
    store.tag(ensure_busybox_base(store).digest, "base")
    tools = os.path.join(root, "tools")
    os.makedirs(os.path.join(tools, "disktool"))
    shutil.copy2(disktool, os.path.join(tools, "disktool", "dt"))
    store.add_tree(tools, kind="toolkit", name="disktool")
    cache = MountCache()
    backend = ContainerBackend(root_dir=os.path.join(root, "c"),
                               images=StoreImages(store, cache), **kw)  # type: ignore[arg-type]
    node = EdgeNode(NodeConfig(node_id="n1", capacity=Capacity(
        cpu_milli=64_000, memory_bytes=64 << 30, max_sandboxes=64)), backend,
        rng=random.Random(5))
    await node.start()
    try:
        yield Env(node, backend, store)
    finally:
        try:
            ids = [i.id for i in node.list()]
            if ids:
                with contextlib.suppress(DsecError):
                    await node.destroy_many(ids)
        finally:
            await _cleanup(backend)
            await node.close()
            cache.close()


def _spec(project: str = "default", **kw: object) -> SandboxSpec:
    kw.setdefault("backend", "container")
    return SandboxSpec(memory_bytes=256 << 20, pids_max=256, toolkits=("disktool",),
                       project=project, **kw)  # type: ignore[arg-type]


async def _sh(node: EdgeNode, sid: str, cmd: str, timeout_s: float = 300) -> str:
    r = await node.exec(sid, ExecRequest(shell=cmd, timeout_s=timeout_s))
    return (r.stdout + r.stderr).decode(errors="replace")


@contextlib.contextmanager
def _small_fs(path: str, size: int) -> Iterator[str]:
    """An ext4 filesystem of ``size`` bytes (on a loop device over a sparse file beside
    it; EROFS layers cannot be mounted from tmpfs files) mounted at ``path``, unmounted
    after, with anything mounted below it (its loop device is freed with the mount)."""
    os.makedirs(path)
    img = path + ".img"
    with open(img, "wb") as f:
        f.truncate(size)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", img], check=True)
    subprocess.run(["mount", "-o", "loop", img, path], check=True)  # autoclear loop
    try:
        yield path
    finally:
        for sub in _mounts_under(path)[::-1]:   # a pool left for adoption, then path
            with contextlib.suppress(OSError):
                umount2(sub, MNT_DETACH)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(img)


def _mounts_under(root: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        points = [ln.split()[4] for ln in f]
    return [p for p in points if p == root or p.startswith(root + "/")]


# ---------------------------------------------------------------- staging amplification
@pytest.mark.parametrize("how", ["reflink", "compress"])
async def test_snapshot_staging_is_bounded_by_the_cap_not_by_shared_extents(
        tmp_path: object, disktool: str, how: str) -> None:
    """A 16 MiB cap counts a reflinked extent once (and a compressed one at its
    compressed size), but a snapshot copies every file's data in full. Before the fix,
    200 reflinks of an 8 MiB file (1.6 GiB of file data in 8 MiB of the cap) were
    copied to the layer store's filesystem before the layer was refused for its size:
    here that store is a 128 MiB filesystem, which filled (ENOSPC for all its users).
    The snapshot must be refused for its size before it writes more than its bound."""
    root = str(tmp_path)
    with _small_fs(os.path.join(root, "store"), 128 * MiB) as store_dir:
        async with _env(root, disktool, store_dir=store_dir,
                        disk_pool_bytes=512 * MiB) as env:
            sid = (await env.node.create(_spec(disk_bytes=16 * MiB))).id
            if how == "reflink":
                out = await _sh(env.node, sid, "cd /root && /disktool/dt rand r 8388608 && "
                                "/disktool/dt clonen r c 100 && /disktool/dt cfrn r f 100")
                assert "clonen=ok 100" in out and "cfrn=ok 100" in out, out
            else:    # FS_COMPR_FL passes through overlayfs to btrfs: 32x on repetitive data
                out = await _sh(env.node, sid, "cd /root && touch z && /disktool/dt setflags "
                                "z 4 && yes dsec | head -c 209715200 > z; ls -l z")
                assert "setflags=ok" in out and "209715200" in out, out
            st = await env.node.stats(sid)
            assert st.disk_bytes <= 16 * MiB          # the cap holds: shared/compressed
            vfs = os.statvfs(store_dir)
            free_before = vfs.f_bavail * vfs.f_frsize
            with pytest.raises(QuotaExceeded, match="over the limit of 19922944 bytes"):
                await env.node.snapshot(sid)
            vfs = os.statvfs(store_dir)
            assert vfs.f_bavail * vfs.f_frsize >= free_before - MiB    # nothing left over
            assert [s for s in await env.node.snapshots()] == []
            # the sandbox goes on (thawed), and a snapshot within the bound still works
            out = await _sh(env.node, sid, "rm -f /root/*; echo ok > /root/small; cat /root/small")
            assert out == "ok\n"
            assert (await env.node.snapshot(sid)).size_bytes < 16 * MiB


async def test_a_chunked_layer_cannot_outgrow_the_data_it_holds(tmp_path: object,
                                                                 disktool: str) -> None:
    """A chunk-based layer (chosen for sparse files) stores every 64 KiB chunk that holds
    any data whole. A file with 4 KiB of distinct data every 64 KiB (48 MiB in a 64 MiB
    cap) was estimated at its allocation, built chunked, and mkfs.erofs wrote a 768 MiB
    layer to the store's filesystem before the size check refused it - here a 256 MiB
    filesystem, which it filled."""
    root = str(tmp_path)
    with _small_fs(os.path.join(root, "store"), 256 * MiB) as store_dir:
        async with _env(root, disktool, store_dir=store_dir,
                        disk_pool_bytes=512 * MiB) as env:
            sid = (await env.node.create(_spec(disk_bytes=64 * MiB))).id
            out = await _sh(env.node, sid, f"/disktool/dt sparsechop /root/s {768 * MiB} 65536")
            assert "sparsechop=ok 12288" in out, out
            with pytest.raises(QuotaExceeded, match="over the limit of 76546048 bytes"):
                await env.node.snapshot(sid)
            assert await env.node.snapshots() == []


# ------------------------------------------------------------------ scan and index size
async def test_many_long_paths_are_refused_before_they_cost_the_edge_its_memory(
        tmp_path: object, disktool: str) -> None:
    """Paths cost the edge memory (the scan holds every entry) and the index file a copy,
    but cost the sandbox's cap only their last component. Before the fix, 92,080 empty
    files under 35 nested 100-character directories (a 64 MiB cap) made one snapshot
    take the edge from 37 MiB to 720 MiB resident and write a 323 MiB index beside a 16
    MiB layer; a 10 GiB cap is 160 times that. The scan must stop at its path budget."""
    root = str(tmp_path)
    async with _env(root, disktool, disk_pool_bytes=512 * MiB) as env:
        sid = (await env.node.create(_spec(disk_bytes=64 * MiB))).id
        out = await _sh(env.node, sid, "/disktool/dt deep /root/x 35 100 1000000")
        made = int(out.split()[-1])
        assert made > 40_000, out               # the cap stopped it (E122: EDQUOT)
        index = os.path.join(env.store.root, "index")
        before = os.listdir(index) if os.path.isdir(index) else []
        with pytest.raises(QuotaExceeded, match="bytes of paths, over the limit of "
                                                "134217728"):
            await env.node.snapshot(sid)
        assert (os.listdir(index) if os.path.isdir(index) else []) == before
        assert await env.node.snapshots() == []


async def test_a_snapshots_size_counts_its_index(tmp_path: object, disktool: str) -> None:
    """Every snapshot stores an index of *every* upper entry next to its layer (how the
    next one finds what changed). It was not part of the snapshot's size, so the
    project's snapshot_bytes quota never saw it: a sandbox with many long paths could
    store ~130 MB per snapshot while being charged the few KiB of a one-file layer."""
    async with _env(str(tmp_path), disktool, disk_pool_bytes=512 * MiB) as env:
        sid = (await env.node.create(_spec(disk_bytes=64 * MiB))).id
        await _sh(env.node, sid, "/disktool/dt deep /root/x 9 100 3000")
        # Entries changed within RACY_WINDOW_NS of a scan are captured again by the next
        # snapshot (coarse timestamps); on a quiet machine the tree is made inside that
        # window and the second layer re-carried most of it. Age it past the window.
        await asyncio.sleep(2 * RACY_WINDOW_NS / 1e9)
        first = await env.node.snapshot(sid)
        await _sh(env.node, sid, "echo one > /root/one")
        info = await env.node.snapshot(sid)          # a one-file layer, a full index
        layer = os.path.getsize(env.store.layer_path(info.id))
        index = os.path.getsize(env.store.index_path(info.id))
        assert index > 2 * MiB > 8 * layer
        assert info.size_bytes == layer + index
        listed = {s.id: s.size_bytes for s in await env.node.snapshots()}
        assert listed[info.id] == info.size_bytes and listed[first.id] == first.size_bytes


async def test_entry_count_of_one_snapshot_is_bounded(tmp_path: object, disktool: str) -> None:
    """Empty files cost btrfs ~350 bytes of the cap each (a 10 GiB cap holds ~30 million)
    and the snapshot's scan, stage (host inodes) and index one entry each."""
    async with _env(str(tmp_path), disktool, disk_pool_bytes=512 * MiB,
                    snapshot_max_entries=2_000) as env:
        sid = (await env.node.create(_spec(disk_bytes=64 * MiB))).id
        await _sh(env.node, sid, "/disktool/dt mkfiles /root/few 1500")
        assert (await env.node.snapshot(sid)).size_bytes > 0
        await _sh(env.node, sid, "/disktool/dt mkfiles /root/many 1000")
        with pytest.raises(QuotaExceeded, match="more than 2001 entries, over the limit "
                                                "of 2000"):
            await env.node.snapshot(sid)


# --------------------------------------------------------------------- fairness
def _evil_builds() -> list[int]:
    """Pids of this process's mkfs.erofs children (only ours) building a stage that holds
    the attackers' ``root/sparse`` (argv ends with the stage dir)."""
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        head, _, rest = stat.rpartition(")")
        if head.split("(", 1)[1] != "mkfs.erofs" or int(rest.split()[1]) != me:
            continue
        args = [a for a in argv if a]
        if args and os.path.exists(os.path.join(args[-1].decode(), "root", "sparse")):
            out.append(int(name))
    return out


async def test_one_tenants_slow_snapshots_do_not_stall_the_node(
        tmp_path: object, disktool: str) -> None:
    """mkfs.erofs 1.5 reads sparse files whole (~5-13 s per GiB here), so a sandbox with
    a tiny cap and a 4 GiB sparse file makes a minutes-long build. Six at once took
    every thread of asyncio's default executor, and every pause (its memory reclaim
    runs there) and every other tenant's snapshot on the node waited behind them. The
    attacker's builds are held here with SIGSTOP (deterministic: they never finish
    until let go); another project's snapshot, pause and resume must still complete."""
    async with _env(str(tmp_path), disktool, disk_pool_bytes=512 * MiB) as env:
        node = env.node
        evil = [(await node.create(_spec("evil", disk_bytes=8 * MiB))).id for _ in range(6)]
        good = (await node.create(_spec("good", disk_bytes=8 * MiB))).id
        for sid in evil:
            await _sh(node, sid, "truncate -s 4G /root/sparse")
        await _sh(node, good, "echo mine > /root/f")
        stopped: set[int] = set()
        ending = False

        async def hold() -> None:   # stop each attacker build; at the end, kill them all
            while True:
                for pid in _evil_builds():
                    with contextlib.suppress(ProcessLookupError):
                        if ending:
                            os.kill(pid, signal.SIGKILL)
                            os.kill(pid, signal.SIGCONT)
                        elif pid not in stopped:
                            os.kill(pid, signal.SIGSTOP)
                            stopped.add(pid)
                await asyncio.sleep(0.02)

        holder = asyncio.ensure_future(hold())
        attack = [asyncio.ensure_future(node.snapshot(sid)) for sid in evil]
        try:
            for _ in range(500):
                if stopped:
                    break
                await asyncio.sleep(0.02)
            assert stopped, "no snapshot build of the attacker started"
            await asyncio.sleep(2)              # the attacker's other builds queue up
            info = await asyncio.wait_for(node.snapshot(good), 60)
            assert info.project == "good" and info.size_bytes > 0
            await asyncio.wait_for(node.pause(good), 60)
            await asyncio.wait_for(node.resume(good), 60)
            assert await _sh(node, good, "cat /root/f") == "mine\n"
        finally:
            ending = True
            await asyncio.gather(*attack, return_exceptions=True)
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)


# ------------------------------------------------------------------ the host under the pool
def _host(env: Env) -> tuple[int, int]:
    vfs = os.statvfs(env.backend.root_dir)
    return vfs.f_bavail * vfs.f_frsize, env.backend.disk.unbacked_bytes()


async def test_snapshots_cannot_eat_the_host_space_the_disk_pool_was_promised(
        tmp_path: object, disktool: str) -> None:
    """Snapshots (stage and layer) are written to the state dir's filesystem, where the
    pool's image lives. When the image was sparse, a tenant taking snapshots of a
    sandbox full of data used up the host space the image still had to grow into; the
    next write into *any* sandbox then failed in the loop device, btrfs aborted its
    transaction and the whole pool went read-only: every sandbox on the node lost its
    disk, and destroy could not delete subvolumes. (The image is preallocated now; the
    snapshots' own host-room check stays for pools that could not be.)"""
    root = os.path.join(str(tmp_path), "host")
    with _small_fs(root, 900 * MiB) as host:
        async with _env(host, disktool, disk_pool_bytes=600 * MiB) as env:
            node = env.node
            a = (await node.create(_spec("evil", disk_bytes=200 * MiB))).id
            b = (await node.create(_spec("good", disk_bytes=300 * MiB))).id
            refused = 0
            for i in range(4):      # fresh data each round: each snapshot is a new layer
                out = await _sh(node, a, f"rm -f /root/d*; /disktool/dt rand /root/d{i} "
                                f"{150 * MiB}")
                assert "rand=ok" in out, out
                try:
                    await node.snapshot(a)
                except (CapacityExceeded, BackendError) as exc:
                    assert host not in str(exc), exc     # a clear refusal, no host path
                    refused += 1
            free, unbacked = _host(env)
            assert refused and free >= unbacked      # the host filled; the pool is backed
            out = await _sh(node, b, f"/disktool/dt rand /root/big {290 * MiB}; "
                            "echo still > /root/f && cat /root/f")
            assert "rand=ok" in out and out.endswith("still\n"), out
            out = await _sh(node, a, "echo alive > /root/g && cat /root/g")
            assert out == "alive\n", out
            for sid in (a, b):
                await node.destroy(sid)
            assert env.backend.disk.sandboxes() == []


async def test_the_pool_survives_the_host_filesystem_filling_up(
        tmp_path: object, disktool: str) -> None:
    """With a sparse pool image, something outside dsec filling the host filesystem
    made the loop device unable to back the pool's next write: btrfs aborted its
    transaction and the whole pool went read-only for every sandbox. The image is
    preallocated now (and mounted nodiscard), so the host filling up is the filler's
    ENOSPC, not the pool's."""
    root = os.path.join(str(tmp_path), "host")
    with _small_fs(root, 900 * MiB) as host:
        async with _env(host, disktool, disk_pool_bytes=600 * MiB) as env:
            node = env.node
            one = (await node.create(_spec(disk_bytes=300 * MiB))).id
            two = (await node.create(_spec(disk_bytes=300 * MiB))).id
            free, _ = _host(env)
            # another host user (logs, another service) takes all but 64 MiB
            fd = os.open(os.path.join(host, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, free - 64 * MiB)
            finally:
                os.close(fd)
            await _sh(node, one, f"/disktool/dt rand /root/a {250 * MiB}; sync")
            # one may get ENOSPC for its own write - but two must keep a working disk
            out = await _sh(node, two, "echo ok > /root/f && sync && cat /root/f")
            assert out == "ok\n", out


# ------------------------------------------------------------------ attacks that failed
@pytest.mark.parametrize("runtime", ["native", "runc", "runsc"])
async def test_btrfs_ioctls_and_privileged_flags_do_not_pass_through_overlayfs(
        tmp_path: object, disktool: str, runtime: str) -> None:
    """What stays shut (regression guard): btrfs ioctls (subvolume/snapshot create,
    quota control, sync, ino lookup, tree search) do not reach the pool through the
    sandbox's overlay (ENOTTY), immutable/append-only need CAP_LINUX_IMMUTABLE, and
    reflinks or deleting and rewriting never take a sandbox past its cap (a reflinked
    extent is counted once; freed space is only reusable by the sandbox itself)."""
    if runtime != "native" and shutil.which(runtime) is None:
        pytest.skip(f"needs {runtime}")
    async with _env(str(tmp_path), disktool, disk_pool_bytes=512 * MiB,
                    runtime=runtime) as env:
        node = env.node
        sid = (await node.create(_spec(disk_bytes=16 * MiB, backend=env.backend.name))).id
        out = await _sh(node, sid, "for nr in 1 8 14 15 18 23 24 40 42 44 63; do "
                        "/disktool/dt ioctl /root $nr 4096 1; /disktool/dt ioctl / $nr "
                        "4096 3; done")
        assert out.count("ioctl=E25") == 22, out          # ENOTTY, every one of them
        out = await _sh(node, sid, "touch /root/z; /disktool/dt setflags /root/z 10; "
                        "/disktool/dt setflags /root/z 20")
        # EPERM: immutable, append; gVisor does not pass the ioctl on at all (ENOTTY)
        flag_err = "E25" if runtime == "runsc" else "E1"
        assert out == f"setflags={flag_err}\nsetflags={flag_err}\n", out
        out = await _sh(node, sid, "cd /root && /disktool/dt rand r 12582912 && "
                        "/disktool/dt clonen r c 50 && /disktool/dt rand s 8388608; "
                        "rm -f r s c*; sync; /disktool/dt rand t 15000000")
        assert "rand=E122" in out.split("\n")[2], out     # EDQUOT: 12 + 8 > 16 MiB
        assert "rand=ok" in out.split("\n")[-2], out      # freed space is its own again
        st = await node.stats(sid)
        assert st.disk_bytes <= 16 * MiB


async def test_xattrs_the_store_cannot_hold_are_a_clear_error_without_host_paths(
        tmp_path: object, disktool: str) -> None:
    """btrfs holds ~16 KiB of xattrs per file, ext4 (the layer store here) one block per
    inode: such a file failed the snapshot with a raw "OSError: [Errno 28] No space left
    on device: '<host path of the stage>'" - a host path, and a full disk that was not."""
    async with _env(str(tmp_path), disktool, disk_pool_bytes=512 * MiB) as env:
        sid = (await env.node.create(_spec(disk_bytes=16 * MiB))).id
        v = "v" * 3900
        out = await _sh(env.node, sid, f"touch /root/x && /disktool/dt setxattr /root/x "
                        f"user.a {v} && /disktool/dt setxattr /root/x user.b {v}")
        assert out == "setxattr=ok\nsetxattr=ok\n", out
        with pytest.raises(ImageError, match="snapshot cannot hold 'root/x': its 2 extended "
                                             "attributes") as err:
            await env.node.snapshot(sid)
        assert str(tmp_path) not in str(err.value)
        await _sh(env.node, sid, "rm /root/x")
        assert (await env.node.snapshot(sid)).size_bytes > 0


async def test_a_tree_deeper_than_path_max_is_a_clear_error_without_host_paths(
        tmp_path: object, disktool: str) -> None:
    """mkdirat/openat make a tree deeper than PATH_MAX; the scan failed with a raw
    ENAMETOOLONG naming the upper's host path (state dir, pool, sandbox id)."""
    async with _env(str(tmp_path), disktool, disk_pool_bytes=512 * MiB) as env:
        sid = (await env.node.create(_spec(disk_bytes=16 * MiB))).id
        assert await _sh(env.node, sid, "/disktool/dt deep /root/x 45 100 1") == "deep=ok 1\n"
        with pytest.raises(ImageError, match="more than the host can name") as err:
            await env.node.snapshot(sid)
        assert str(tmp_path) not in str(err.value) and "/pool" not in str(err.value)


# ------------------------------------------------------------------------ the file API
async def test_a_file_write_past_the_cap_changes_nothing(tmp_path: object,
                                                         disktool: str) -> None:
    """write_file truncated the file first and then hit EDQUOT mid-write: the caller got
    QuotaExceeded, but the file's old content was gone and half of the new one was
    there (space a truncate frees returns only at the next btrfs commit, so even an
    overwrite with less data than the file held failed that way). A write that cannot
    fit the cap is refused before the file is touched; /tmp (tmpfs, memory) is not the
    disk and keeps taking writes bigger than the cap."""
    async with _env(str(tmp_path), disktool, disk_pool_bytes=512 * MiB) as env:
        node = env.node
        sid = (await node.create(_spec(disk_bytes=8 * MiB))).id
        await node.write_file(sid, "/root/keep", b"precious\n" * 100_000)   # ~0.9 MiB
        await _sh(node, sid, "dd if=/dev/zero of=/root/fill bs=1M count=5 2>/dev/null; sync")
        for append in (False, True):
            with pytest.raises(QuotaExceeded, match="disk cap of 8388608 bytes"):
                await node.write_file(sid, "/root/keep", b"y" * (3 * MiB), append=append)
            assert await node.read_file(sid, "/root/keep") == b"precious\n" * 100_000
        with pytest.raises(QuotaExceeded, match="disk cap"):
            await node.write_file(sid, "/root/new", b"z" * (3 * MiB))
        assert "No such file" in await _sh(node, sid, "ls /root/new")
        await node.write_file(sid, "/tmp/scratch", b"t" * (12 * MiB))      # not the disk
        assert (await node.stat(sid, "/tmp/scratch")).size == 12 * MiB


def test_host_room_leaves_the_pools_promise_and_a_reserve() -> None:
    GiB = 1 << 30
    assert host_room(10 * GiB, 100 * GiB, 7 * GiB) == GiB            # (10 - 7 - 1) / 2
    assert host_room(400 * MiB, 800 * MiB, 100 * MiB) == 130 * MiB    # 5% reserve: 40 MiB
    assert host_room(5 * GiB, 100 * GiB, 7 * GiB) == 0                # the pool needs it all


async def test_destroyed_sandboxes_give_their_disk_back_at_once(tmp_path: object,
                                                                disktool: str) -> None:
    """A deleted subvolume kept its space until btrfs' next commit (~30 s): one sandbox
    at a time, created with a 150 MiB cap, filled and destroyed three times in 10 s held
    420 MiB of a 499 MiB pool, and every create on the node was refused until then."""
    async with _env(str(tmp_path), disktool, disk_pool_bytes=512 * MiB) as env:
        node = env.node
        for _ in range(6):
            sid = (await node.create(_spec(disk_bytes=150 * MiB))).id
            out = await _sh(node, sid, f"/disktool/dt rand /root/a {140 * MiB}; sync")
            assert "rand=ok" in out, out
            await node.destroy(sid)
        bystander = (await node.create(_spec(disk_bytes=300 * MiB))).id
        out = await _sh(node, bystander, f"/disktool/dt rand /root/b {280 * MiB}")
        assert "rand=ok" in out, out
