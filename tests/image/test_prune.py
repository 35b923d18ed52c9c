"""dsec image prune: unreferenced layers go, a layer in use never does - also against
real concurrent processes (a pruner in a loop while this process builds, tags and
mounts) and when the pruner is killed -9 midway.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from dsec.errors import ImageNotFound
from dsec.image import LayerStore, MountCache
from dsec.image.compose import acquire_stack, compose
from dsec.image.manifest import LayerManifest
from dsec.image.store import BUDGET_GRACE_S

_PRUNER = """
import os, sys, json
from dsec.image import LayerStore
store = LayerStore(sys.argv[1])
stop = sys.argv[2]
removed = runs = 0
while not os.path.exists(stop):
    removed += len(store.prune().removed)
    runs += 1
print(json.dumps({"removed": removed, "runs": runs}))
"""

_ONE_PRUNE = """
import sys
from dsec.image import LayerStore
store = LayerStore(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
store.prune()
"""


def _tree(root: str, i: int, size: int = 100) -> str:
    d = os.path.join(root, f"t{i}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "f"), "wb") as f:
        f.write(bytes([i % 256]) * size + str(i).encode())
    os.utime(os.path.join(d, "f"), (1, 1))
    os.utime(d, (1, 1))
    return d


def _consistent(store: LayerStore) -> None:
    """Every manifest has its whole layer file, every name its manifest (read under
    the store's shared lock: a concurrent prune is between layers, never inside one)."""
    with store.using():
        for m in store.manifests():
            assert os.path.getsize(store.layer_path(m)) == m.size_bytes, m.digest
        for key, digest in store.refs().items():
            assert store.has(digest), f"{key} -> {digest} points at nothing"


def test_prune_removes_only_unreferenced(store: LayerStore, cache: MountCache,
                                         tmp_path: object) -> None:
    src = str(tmp_path)
    named = store.add_tree(_tree(src, 1), kind="base", name="base")
    old = store.add_tree(_tree(src, 2), kind="base", name="tools", tag="v1")
    store.add_tree(_tree(src, 3), kind="base", name="tools", tag="v1")  # moves the name
    under_snap = store.add_tree(_tree(src, 4), kind="base")
    snap = store.add_tree(_tree(src, 5), kind="snapshot", stack=(under_snap.digest,),
                          labels={"dsec.io/project": "teama"})
    mounted = store.add_tree(_tree(src, 6), kind="toolkit")
    pinned_layer: list[str] = []
    garbage = store.add_tree(_tree(src, 7), kind="workspace")
    path = cache.acquire(mounted, store.layer_path(mounted))
    assert os.path.ismount(path)
    # a pin held by a process killed -9 pins nothing
    dead = subprocess.Popen(
        [sys.executable, "-c", ("import sys,time\nfrom dsec.image import LayerStore\n"
         "s=LayerStore(sys.argv[1])\np=s.pinned().__enter__()\np.add(sys.argv[2])\n"
         "print('pinned',flush=True)\ntime.sleep(60)"), store.root, garbage.digest],
        stdout=subprocess.PIPE, text=True)
    assert dead.stdout is not None and dead.stdout.readline().strip() == "pinned"
    dead.kill()
    dead.wait()
    dead.stdout.close()
    try:
        with store.pinned() as pin:
            held = store.add_tree(_tree(src, 8), kind="base", pin=pin)
            pinned_layer.append(held.digest)
            dry = store.prune(dry_run=True)
            assert {m.digest for m in dry.removed} == {old.digest, garbage.digest}
            assert store.has(old.digest) and dry.dry_run
            res = store.prune()
            assert {m.digest for m in res.removed} == {old.digest, garbage.digest}
            assert res.freed_bytes == old.size_bytes + garbage.size_bytes
            for keep in (named, under_snap, snap, mounted, held):
                assert store.has(keep.digest) and os.path.exists(store.layer_path(keep))
            assert not os.path.exists(store.layer_path(old))
            assert os.listdir(os.path.join(store.root, "pins")) == [os.path.basename(pin.path)]
            _consistent(store)
        # the pin is gone, the mount released: both go now
        cache.release(mounted.digest)
        res = store.prune()
        assert {m.digest for m in res.removed} == {held.digest, mounted.digest}
    finally:
        if os.path.ismount(path):
            cache.release(mounted.digest)
    assert {m.digest for m in store.manifests()} == {
        named.digest, store.get("tools:v1").digest, under_snap.digest, snap.digest}
    assert sorted(os.listdir(os.path.join(store.root, "layers"))) == sorted(
        m.hex + ".erofs" for m in store.manifests())


def test_budget_prunes_lru_unreferenced_on_build(tmp_path: object) -> None:
    src = str(tmp_path)
    probe = LayerStore(os.path.join(src, "probe")).add_tree(_tree(src, 0, 50_000),
                                                            kind="base")
    size = probe.size_bytes
    # recorded in the store (dsec up/edge --image-store-budget): another process's
    # LayerStore on the same root keeps to it
    store = LayerStore(os.path.join(src, "store"))
    assert store.budget_bytes is None
    LayerStore(store.root).set_budget(3 * size + size // 2)
    assert store.budget_bytes == 3 * size + size // 2
    named = store.add_tree(_tree(src, 1, 50_000), kind="base", name="keep")
    a = store.add_tree(_tree(src, 2, 50_000), kind="base")
    b = store.add_tree(_tree(src, 3, 50_000), kind="base")
    # Fresh garbage is left alone (a multi-step build may name its layers only at the
    # end): a layer over the budget that nothing has used for BUDGET_GRACE_S goes.
    c = store.add_tree(_tree(src, 4, 50_000), kind="base")   # 4 layers > 3.5
    assert all(store.has(m.digest) for m in (named, a, b, c))

    def age(m: LayerManifest, seconds: float) -> None:
        t = time.time() - seconds
        os.utime(os.path.join(store.root, "manifests", m.hex + ".json"), (t, t))

    age(named, 9000)
    age(b, BUDGET_GRACE_S + 200)             # b: the least recently used garbage
    age(a, BUDGET_GRACE_S + 100)
    age(c, BUDGET_GRACE_S + 300)
    store.touch(c.digest)                    # ... but c was just mounted
    d = store.add_tree(_tree(src, 5, 50_000), kind="base")   # 5 > 3.5: two go
    assert {m.digest for m in store.manifests()} == {named.digest, c.digest, d.digest}
    age(c, BUDGET_GRACE_S + 1)
    e = store.add_tree(_tree(src, 6, 50_000), kind="base")   # the new one is never it
    assert {m.digest for m in store.manifests()} == {named.digest, d.digest, e.digest}
    store.set_budget(None)
    store.add_tree(_tree(src, 7, 50_000), kind="base")
    assert len(store.manifests()) == 4


@pytest.fixture
def pruner(store: LayerStore, tmp_path: object) -> Iterator[tuple[subprocess.Popen[str], str]]:
    stop = os.path.join(str(tmp_path), "stop")
    proc = subprocess.Popen([sys.executable, "-c", _PRUNER, store.root, stop],
                            stdout=subprocess.PIPE, text=True)
    try:
        yield proc, stop
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout:
            proc.stdout.close()


def _stop(proc: subprocess.Popen[str], stop: str) -> dict[str, int]:
    with open(stop, "w"):
        pass
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    result: dict[str, int] = json.loads(out)
    return result


def test_race_prune_vs_mount_tag_and_pinned_build(store: LayerStore, cache: MountCache,
                                                  tmp_path: object,
                                                  pruner: tuple[subprocess.Popen[str],
                                                                str]) -> None:
    """A pruner process loops while this one (1) builds an unnamed layer and mounts it,
    (2) builds one and tags it, (3) builds one under a pin and tags it after a pause.
    (1) and (2) may lose the layer before they get to it (ImageNotFound: it was
    garbage then), but a mounted layer and a named one always exist; (3) never loses."""
    src = str(tmp_path)
    proc, stop = pruner
    outcomes = {"mounted": 0, "mount_lost": 0, "tagged": 0, "tag_lost": 0, "pinned": 0}
    trees = [_tree(src, i) for i in range(3)]
    deadline = time.monotonic() + 6
    i = 0
    while time.monotonic() < deadline or i < 30:
        i += 1
        m = store.add_tree(trees[0], kind="base")
        try:
            lowers = acquire_stack(store, cache, compose(m))
        except ImageNotFound:
            outcomes["mount_lost"] += 1
        else:
            try:
                for _ in range(3):
                    time.sleep(0.002)
                    assert store.has(m.digest) and os.path.exists(store.layer_path(m))
                    assert os.listdir(lowers[0]) == ["f"]
                outcomes["mounted"] += 1
            finally:
                cache.release(m.digest)
        t = store.add_tree(trees[1], kind="base")
        try:
            store.tag(t.digest, "racy", str(i))
        except ImageNotFound:
            outcomes["tag_lost"] += 1
            assert f"racy:{i}" not in store.refs()
        else:
            assert store.has(store.refs()[f"racy:{i}"])
            outcomes["tagged"] += 1
            store.untag(f"racy:{i}")
        with store.pinned() as pin:
            p = store.add_tree(trees[2], kind="base", pin=pin)
            time.sleep(0.003)
            store.tag(p.digest, "pinned", str(i))
            outcomes["pinned"] += 1
        store.untag(f"pinned:{i}")
        _consistent(store)
    stats = _stop(proc, stop)
    print(outcomes, stats)
    assert stats["removed"] > 0 and stats["runs"] > 10, stats
    assert outcomes["mounted"] > 0 and outcomes["tagged"] > 0 and outcomes["pinned"] == i
    _consistent(store)


def test_kill9_mid_prune_leaves_a_consistent_store(store: LayerStore,
                                                   tmp_path: object) -> None:
    src = str(tmp_path)
    named = [store.add_tree(_tree(src, 1000 + i), kind="base", name=f"n{i}")
             for i in range(3)]
    garbage = {store.add_tree(_tree(src, i), kind="base").digest for i in range(150)}
    rng = random.Random(15)
    partial = kills = 0
    for round_ in range(40):
        left = {m.digest for m in store.manifests()} & garbage
        if not left:
            if partial:
                break
            # every prune so far finished before its kill landed (a fast machine, or a
            # slow one that started the kill late): more garbage, and kill sooner
            garbage |= {store.add_tree(_tree(src, 10_000 * (round_ + 1) + i),
                                       kind="base").digest for i in range(150)}
            continue
        proc = subprocess.Popen([sys.executable, "-c", _ONE_PRUNE, store.root],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(rng.uniform(0, 0.02 if not kills or partial else 0.004))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
        kills += proc.returncode == -signal.SIGKILL
        now = {m.digest for m in store.manifests()} & garbage
        partial += 0 < len(now) < len(left)
        _consistent(store)
        assert all(store.has(m.digest) for m in named)
    assert kills > 0 and partial > 0, (kills, partial)
    res = store.prune()
    _consistent(store)
    assert {m.digest for m in store.manifests()} == {m.digest for m in named}
    assert sorted(os.listdir(os.path.join(store.root, "layers"))) == sorted(
        m.hex + ".erofs" for m in named)
    assert res.kept_layers == 3


def test_image_store_budget_flag_is_recorded_for_every_process() -> None:
    """`dsec up --image-store-budget` (ClusterConfig.image_store_budget) and `dsec edge
    --image-store-budget` record the budget in the store; 'off' clears it."""
    from click.testing import CliRunner

    from dsec import LocalCluster
    from dsec.cli.edge import BUDGET
    from dsec.cli.main import cli

    with LocalCluster(image_store_budget=64 << 20) as cl:
        assert LayerStore(os.path.join(cl.state_dir, "layers")).budget_bytes == 64 << 20
    assert BUDGET.convert("1GiB", None, None) == 1 << 30
    assert BUDGET.convert("off", None, None) == "off"
    r = CliRunner().invoke(cli, ["up", "--image-store-budget", "lots", "--quiet"])
    assert r.exit_code != 0 and "not a size" in r.output


def test_discard_keeps_what_another_build_holds(store: LayerStore, tmp_path: object) -> None:
    """Two requests build the same tree (reproducible: one layer); the first rolls back
    (its charge or tag failed): the layer stays while the second holds it."""
    src = _tree(str(tmp_path), 1)
    with store.pinned() as mine, store.pinned() as theirs:
        m = store.add_tree(src, kind="base", pin=mine)
        assert store.add_tree(src, kind="base", pin=theirs).digest == m.digest
        assert not store.discard(m.digest, pin=mine)
        assert store.has(m.digest)
    with store.pinned() as mine:
        assert store.add_tree(src, kind="base", pin=mine).digest == m.digest
        assert store.discard(m.digest, pin=mine)
    assert not store.has(m.digest)


def test_unsquashed_import_keeps_its_lower_layers(store: LayerStore, cache: MountCache,
                                                  tmp_path: object) -> None:
    from dsec.image import import_oci
    from tests.image.test_oci import L1, L2, check, write_layout

    layout = os.path.join(str(tmp_path), "oci")
    write_layout(layout, [L1, L2])
    layers = import_oci(store, layout, name="layered", squash=False)
    assert layers[0].stack == (layers[1].digest,)
    assert store.prune().removed == ()
    check(store, cache, layers, str(tmp_path))
