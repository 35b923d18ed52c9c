"""A node with an empty layer store starts from layers that exist only in the blob store,
reading through the FUSE daemon only the chunks it touches (issue 17)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from dsec.edge.backends.container.images import PinChange
from dsec.edge.layers import held_layers
from dsec.image import mount_overlay
from dsec.image.mount import sys_umount
from dsec.wire.spec import SandboxSpec
from tests.conftest import requires_root
from tests.edge.lazy.conftest import Node, Remote, fuse_mounts

pytestmark = requires_root


def test_stack_from_blob_store_reads_only_touched_chunks(node: Node, remote: Remote,
                                                         tmp_path: object) -> None:
    assert not os.path.exists(node.store.layer_path(remote.workspace))
    spec = SandboxSpec(image=remote.base.digest, workspace=remote.workspace.digest,
                       toolkits=(remote.toolkit.digest,))
    layers = node.images.acquire(spec)
    try:
        # no layer file was downloaded: manifests only, the files are the daemon's; the
        # node does not offer them to other nodes (it could not hand them out)
        for m in (remote.base, remote.workspace, remote.toolkit):
            assert node.store.has(m.digest) and not os.path.exists(node.store.layer_path(m))
            assert m.digest not in held_layers(node.store)
        sb = os.path.join(str(tmp_path), "sb")
        upper, work, root = (os.path.join(sb, d) for d in ("upper", "work", "root"))
        for d in (upper, work, root):
            os.makedirs(d)
        mount_overlay(layers.lowerdirs, upper, work, root)
        try:
            assert Path(root, "opt/tool").read_text() == "toolkit layer\n"
            assert Path(root, "work/readme").read_text() == "workspace layer\n"
            assert os.path.islink(os.path.join(root, "bin/sh"))
            st = node.lazy.stats(fresh=True)
            total = sum(m.size_bytes for m in (remote.base, remote.workspace, remote.toolkit))
            # the 2 MiB file was not read: far less than the layers were fetched
            assert 0 < st["bytes_fetched"] < total - (1 << 20)
            assert Path(root, "work/big").read_bytes() == remote.big
            assert node.lazy.stats(fresh=True)["verify_failures"] == 0
        finally:
            sys_umount(root)
    finally:
        node.images.release(layers)
    assert node.cache.mounted() == {}


def test_close_leaves_no_fuse_mount_or_daemon(remote: Remote, tmp_path: object) -> None:
    from dsec.edge.lazy.layers import LazyConfig, LazyLayers
    from dsec.image import MountCache

    lazy = LazyLayers(LazyConfig(blob_url=remote.url,
                                 cache_dir=os.path.join(str(tmp_path), "c")))
    pid, mount = lazy.pid, lazy.mount
    assert mount in fuse_mounts()
    cache = MountCache(lazy=lazy)
    lazy.register(remote.toolkit)
    cache.acquire(remote.toolkit, "/nonexistent/layer")
    cache.close()
    lazy.close()
    assert mount not in fuse_mounts()
    assert pid is not None and not os.path.exists(f"/proc/{pid}")   # exited and reaped
    assert not os.path.exists(lazy.root)


def test_prometheus_metrics_of_the_chunk_path(node: Node, remote: Remote) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from dsec.edge.metrics import EdgeMetrics

    def samples() -> dict[str, float]:
        node.lazy.stats(fresh=True)
        text = EdgeMetrics(lazy=node.lazy).render().decode()
        return {s.name + str(sorted(s.labels.items())): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    node.lazy.register(remote.workspace)
    path = node.lazy.path(remote.workspace) or ""
    with open(path, "rb", buffering=0) as f:
        data = f.read()
    m = samples()
    assert m["dsec_lazy_bytes_fetched_total[]"] == len(data) == remote.workspace.size_bytes
    assert m["dsec_lazy_chunk_misses_total[]"] > 0
    assert m["dsec_lazy_fetch_seconds_count[]"] > 0
    assert m["dsec_lazy_fetch_seconds_bucket[('le', '+Inf')]"] == \
        m["dsec_lazy_fetch_seconds_count[]"]
    ratio = m["dsec_lazy_chunk_hit_ratio[]"]
    with open(path, "rb", buffering=0) as f:   # page cache: the daemon sees nothing
        f.read()
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    with open(path, "rb", buffering=0) as f:   # dropped: every chunk a cache hit
        f.read()
    m2 = samples()
    assert m2["dsec_lazy_chunk_hit_ratio[]"] > ratio
    assert m2["dsec_lazy_bytes_fetched_total[]"] == m["dsec_lazy_bytes_fetched_total[]"]
    # a daemon restart does not reset the node's counters
    os.kill(node.lazy.pid or 0, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while not (node.lazy.restarts == 1 and node.lazy.alive()) and time.monotonic() < deadline:
        time.sleep(0.05)
    m3 = samples()
    assert m3["dsec_lazy_daemon_restarts_total[]"] == 1
    assert m3["dsec_lazy_bytes_fetched_total[]"] == m2["dsec_lazy_bytes_fetched_total[]"]


def test_access_trace_is_stored_with_the_image_and_prefetched_on_a_cold_node(
        node: Node, remote: Remote, tmp_path: object) -> None:
    from dsec.edge.backends.container.images import StoreImages
    from dsec.edge.lazy.layers import LazyConfig, LazyLayers
    from dsec.image import LayerStore, MountCache
    from dsec.image.blob import open_blobstore, trace_prefix
    from dsec.image.blob.traces import load_trace

    spec = SandboxSpec(image=remote.base.digest, workspace=remote.workspace.digest)
    layers = node.images.acquire(spec)
    try:
        with open(os.path.join(layers.lowerdirs[0], "work/readme"), "rb") as f:
            f.read()
    finally:
        node.images.release(layers)
    blob = open_blobstore(remote.url)
    deadline = time.monotonic() + 30
    while load_trace(blob, remote.base.digest) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    trace = load_trace(blob, remote.base.digest)
    assert trace is not None and blob.head(trace_prefix(remote.base.digest) + "latest")
    assert trace.layers.get(remote.workspace.digest), trace   # it read the workspace
    # a second, cold node: the trace's chunks arrive before anything reads them
    tmp = str(tmp_path)
    store2 = LayerStore(os.path.join(tmp, "store2"))
    lazy2 = LazyLayers(LazyConfig(blob_url=remote.url, cache_dir=os.path.join(tmp, "c2")))
    cache2 = MountCache(lazy=lazy2)
    try:
        images2 = StoreImages(store2, cache2, lazy2)
        images2.grant(remote.manifests)
        got = images2.acquire(spec)
        want = sum(len(c) for c in trace.layers.values())
        while time.monotonic() < deadline:
            if lazy2.stats(fresh=True).get("prefetched_chunks", 0) >= 1:
                break
            time.sleep(0.1)
        st = lazy2.stats(fresh=True)
        assert st["prefetched_chunks"] >= 1 and want >= 1
        images2.release(got)
    finally:
        cache2.close()
        lazy2.close()


def test_pin_an_image_fetches_every_layer_whole_and_survives_a_restart(
        node: Node, remote: Remote) -> None:
    pinned = node.images.pin(remote.workspace.digest)
    assert pinned == [remote.workspace.digest]
    n = -(-remote.workspace.size_bytes // (256 * 1024))

    def present() -> int:
        st = node.lazy.stats(fresh=True)
        return int(st.get("layers", {}).get(remote.workspace.hex, {}).get("present", 0))

    deadline = time.monotonic() + 30
    while present() < n and time.monotonic() < deadline:
        time.sleep(0.1)
    assert present() == n
    os.kill(node.lazy.pid or 0, signal.SIGKILL)            # the pin is re-sent
    while not (node.lazy.restarts == 1 and node.lazy.alive()) and time.monotonic() < deadline:
        time.sleep(0.05)
    node.lazy.stats(fresh=True)
    with open(node.lazy.path(remote.workspace) or "", "rb") as f:   # adopt the cache
        f.read(1)
    while present() < n and time.monotonic() < deadline:
        time.sleep(0.1)
    assert present() == n and node.lazy.pinned == {remote.workspace.digest}
    assert node.lazy.stats(fresh=True)["bytes_fetched"] == remote.workspace.size_bytes
    assert node.images.unpin(remote.workspace.digest) == [remote.workspace.digest]
    assert node.lazy.pinned == frozenset()


def test_two_nodes_sharing_one_store_each_serve_a_layer_the_other_recorded_remote(
        node: Node, remote: Remote, tmp_path: object) -> None:
    from dsec.edge.backends.container.images import StoreImages
    from dsec.edge.lazy.layers import LazyConfig, LazyLayers
    from dsec.image import MountCache

    spec = SandboxSpec(image=remote.base.digest, toolkits=(remote.toolkit.digest,))
    first = node.images.acquire(spec)          # records the manifests in the shared store
    lazy2 = LazyLayers(LazyConfig(blob_url=remote.url,
                                  cache_dir=os.path.join(str(tmp_path), "c2")))
    cache2 = MountCache(lazy=lazy2)
    try:
        second = StoreImages(node.store, cache2, lazy2).acquire(spec)
        assert Path(second.lowerdirs[0], "opt/tool").read_text() == "toolkit layer\n"
        StoreImages(node.store, cache2, lazy2).release(second)
    finally:
        cache2.close()
        lazy2.close()
        node.images.release(first)


def test_apply_pins_reconciles_the_nodes_pin_set(node: Node, remote: Remote) -> None:
    ws, tk = remote.workspace.digest, remote.toolkit.digest
    assert node.images.apply_pins([ws, tk]) == PinChange(tuple(sorted([ws, tk])))
    assert node.images.apply_pins([ws, tk]) == PinChange()            # idempotent
    assert node.images.apply_pins([tk]) == PinChange(unpinned=(ws,))
    # an image the store cannot resolve right now unpins nothing, and is named
    gone = "sha256:" + "0" * 64
    assert node.images.apply_pins([gone]) == PinChange(unresolved=(gone,))
    assert node.lazy.pinned == {tk}
    assert node.images.apply_pins([]) == PinChange(unpinned=(tk,))
