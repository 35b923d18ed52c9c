"""Each crash of a process with a layer mount cache used to leak its mount root under
/run/dsec (a fresh one per process, never reclaimed). A new cache reclaims the roots of
dead processes and leaves those of live ones alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from dsec.image import LayerStore, MountCache
from dsec.image.mount import is_mountpoint

from .conftest import mounts_under

pytestmark = pytest.mark.root

_HOLDER = textwrap.dedent("""
    import sys, time
    from dsec.image import LayerStore, MountCache, ensure_busybox_base
    store = LayerStore(sys.argv[1])
    m = ensure_busybox_base(store)
    c = MountCache()
    print(c.acquire(m, store.layer_path(m)), flush=True)
    time.sleep(1000)
""")


def _holder(store_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, store_dir], stdout=subprocess.PIPE)
    assert p.stdout is not None
    mp = p.stdout.readline().decode().strip()
    assert is_mountpoint(mp), mp
    return p, mp


def test_roots_of_killed_processes_are_reclaimed_live_ones_kept(tmp_path: object) -> None:
    """Crash, restart, crash, ...: each start reclaims the root the previous crash left,
    so repeated crashes leak nothing; a root whose process still runs is never touched."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount (CI runs as root)")
    store_dir = os.path.join(str(tmp_path), "store")
    LayerStore(store_dir)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        bystander, bystander_mp = _holder(store_dir)  # a live process with its own cache
        procs.append(bystander)
        previous = None
        for _ in range(4):
            p, mp = _holder(store_dir)
            procs.append(p)
            if previous is not None:  # this start reclaimed what the last crash left
                assert mounts_under(previous) == [] and not os.path.exists(previous)
                assert not os.path.exists(previous + ".owner")
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
            previous = os.path.dirname(mp)
            assert mounts_under(previous)  # leaked until the next start
        assert previous is not None
        with MountCache() as c:
            assert [os.path.dirname(m) for m in c.reclaimed] == [previous]
            assert not os.path.exists(previous)
            assert is_mountpoint(bystander_mp)  # its owner still runs
        os.kill(bystander.pid, signal.SIGKILL)
        bystander.wait()
        with MountCache() as c2:
            assert [os.path.dirname(m) for m in c2.reclaimed] == [
                os.path.dirname(bystander_mp)]
        assert not is_mountpoint(bystander_mp)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        MountCache().close()  # reclaims whatever a failed run left


def test_a_given_root_is_reclaimed_from_a_dead_owner_refused_from_a_live_one(
        tmp_path: object) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount (CI runs as root)")
    root = os.path.join(str(tmp_path), "mnt")
    c = MountCache(mount_root=root)
    try:
        from dsec.errors import InUse

        with pytest.raises(InUse, match="another live mount cache"):
            MountCache(mount_root=root)
    finally:
        c.close()
    MountCache(mount_root=root).close()  # closed: free again
