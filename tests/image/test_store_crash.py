"""kill -9 in the middle of a layer build (a snapshot, an image build, an OCI import)
used to leave its staging tree and half-written EROFS file in ``<store>/tmp`` forever -
about the size of the snapshot, once per crash. Scratch entries are named by their process
now and the next store opened removes a dead process's; a live one's is never touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from dsec.image import LayerStore

_BUILDER = textwrap.dedent("""
    import os, sys, time
    from dsec.image import LayerStore
    store = LayerStore(sys.argv[1])
    with store.staging("snap-") as stage:
        with open(os.path.join(stage, "big"), "wb") as f:
            f.write(os.urandom(1 << 20))
        print(stage, flush=True)
        time.sleep(1000)   # mid-build (mkfs.erofs would run now)
""")


def _builder(store_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    p = subprocess.Popen([sys.executable, "-c", _BUILDER, store_dir], stdout=subprocess.PIPE)
    assert p.stdout is not None
    stage = p.stdout.readline().decode().strip()
    assert os.path.isdir(stage), stage
    return p, stage


def test_a_build_killed_mid_way_leaves_nothing_in_the_store(tmp_path: object) -> None:
    store_dir = os.path.join(str(tmp_path), "store")
    LayerStore(store_dir)
    live = dead = None
    try:
        live, live_stage = _builder(store_dir)   # another process, still building
        dead, dead_stage = _builder(store_dir)
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait()
        LayerStore(store_dir)                    # the next process to open the store
        assert not os.path.exists(dead_stage)
        assert os.path.isdir(live_stage)
        left = os.listdir(os.path.join(store_dir, "tmp"))
        assert left == [os.path.basename(live_stage)], left
    finally:
        for p in (live, dead):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
