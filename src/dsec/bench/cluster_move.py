"""Figures of layers moving between nodes (issue 16, docs/layers.md), for suite ``cluster``.

``run(quick)`` returns :class:`~dsec.bench.Result` figures (``bench/cluster.py`` calls it
and records them):

- ``layer_fetch_mb_s``: one layer copied between two ``dsec edge`` processes with their
  own stores through the relay (the bench process plays the apiserver: ``layer_chain``,
  then ``layer_get`` into ``layer_put``; the receiver hashes, fsyncs and publishes),
  beside ``layer_copy_local_mb_s``: the same file copied on the same disk by
  ``shutil.copyfile`` plus fsync in the same run (the floor the relay is measured
  against);
- ``create_nonholder_first_ms`` vs ``create_holder_ms`` (p50): creates through the
  apiserver on a container edge that lacks a fresh toolkit layer (it fetches it from the
  other edge first) and then, once it holds it, the same create again (the layer
  mounted afresh both times). Needs root (the container backend); skipped otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from dsec.bench import Result

__all__ = ["run"]

SUITE = "cluster"
DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


def run(quick: bool) -> list[Result]:
    out = _relay_figures(quick)
    if os.geteuid() == 0:
        out += _create_figures(quick)
    return out


# ------------------------------------------------------------------ the relay alone
def _relay_figures(quick: bool) -> list[Result]:
    from dsec.image import LayerStore

    size = (64 if quick else 512) << 20
    rounds = 2 if quick else 5
    with tempfile.TemporaryDirectory(prefix="dsec-bench-move-") as tmp:
        stores = {n: os.path.join(tmp, f"{n}-layers") for n in ("a", "b")}
        a = LayerStore(stores["a"])
        src = os.path.join(tmp, "src")
        os.makedirs(src)
        with open(os.path.join(src, "blob"), "wb") as f:
            f.writelines(os.urandom(1 << 20) for _ in range(size >> 20))
        layer = a.add_tree(src, kind="toolkit", name="blob")
        shutil.rmtree(src)
        b = LayerStore(stores["b"])
        with _edges(tmp, stores, backend="simulated") as socks:
            relay_s = asyncio.run(_relay_rounds(socks, layer.digest, b, rounds))
        copy_s = []
        for _ in range(rounds):
            dst = os.path.join(stores["b"], "tmp", "bench-copy")
            t0 = time.perf_counter()
            shutil.copyfile(a.layer_path(layer), dst)
            fd = os.open(dst, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            copy_s.append(time.perf_counter() - t0)
            os.unlink(dst)
    mb = layer.size_bytes / 1e6
    params = {"layer_mb": round(mb, 1), "rounds": rounds, "edges": 2,
              "transport": "unix", "chunk_kib": 1024}
    return [Result(SUITE, "layer_fetch_mb_s", mb / statistics.median(relay_s), "MB/s",
                   params),
            Result(SUITE, "layer_copy_local_mb_s", mb / statistics.median(copy_s), "MB/s",
                   params)]


async def _relay_rounds(socks: dict[str, str], digest: str, b: Any,
                        rounds: int) -> list[float]:
    from dsec.control.layers import relay
    from dsec.edge.client import EdgeClient
    from dsec.wire import ops
    from dsec.wire.layers import LayerRef

    src = await EdgeClient.connect(f"unix:{socks['a']}")
    dst = await EdgeClient.connect(f"unix:{socks['b']}")
    try:
        chain = await src.call(ops.LAYER_CHAIN, LayerRef(digest=digest))
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            stored = await relay(src, dst, chain.manifests[-1], digest)
            times.append(time.perf_counter() - t0)
            assert not stored.already
            b.remove(digest)
        return times
    finally:
        await src.close()
        await dst.close()


@contextlib.contextmanager
def _edges(tmp: str, stores: dict[str, str], *, backend: str) -> Iterator[dict[str, str]]:
    """``dsec edge`` processes on Unix sockets, one per store."""
    procs = []
    socks = {n: os.path.join(tmp, f"{n}.sock") for n in stores}
    try:
        for n, store in stores.items():
            procs.append(subprocess.Popen(
                [*DSEC, "edge", "--listen", f"unix:{socks[n]}", "--node-id", n,
                 "--backend", backend, "--layer-store", store,
                 "--state-dir", os.path.join(tmp, n), "--log-level", "warning"],
                stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        while not all(os.path.exists(s) for s in socks.values()):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("bench edges did not start")
            time.sleep(0.05)
        yield socks
    finally:
        for p in procs:
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(60)
            if p.poll() is None:
                p.kill()
                p.wait()


# --------------------------------------------------------- creates on (non-)holders
def _create_figures(quick: bool) -> list[Result]:
    from dsec.client.sync import Client
    from dsec.cluster.local import LocalCluster
    from dsec.edge.backends.container.linux import MNT_DETACH, umount2
    from dsec.image import LayerStore, ensure_busybox_base

    rounds = 3 if quick else 10
    tool_mb = 8 if quick else 32
    with tempfile.TemporaryDirectory(prefix="dsec-bench-move-") as tmp:
        state = os.path.join(tmp, "api")
        layers = os.path.join(state, "layers")
        os.makedirs(layers, mode=0o700)
        api_store = LayerStore(layers)
        base = ensure_busybox_base(api_store)
        api_store.tag(base.digest, "base")
        token = secrets.token_hex(16)
        token_file = os.path.join(tmp, "token")
        with open(token_file, "w") as f:
            f.write(token)
        addrs, procs = {}, []
        # a: the apiserver's store (where images are built), one slot, kept full; b: its
        # own store, as on another host
        for node, store, cap in (("a", layers, "1"), ("b", os.path.join(tmp, "b-layers"), "4")):
            addrs[node] = f"tcp:127.0.0.1:{_free_port()}"
            procs.append(subprocess.Popen(
                [*DSEC, "edge", "--listen", addrs[node], "--node-id", node,
                 "--backend", "container", "--state-dir", os.path.join(tmp, node),
                 "--layer-store", store, "--token-file", token_file,
                 "--max-sandboxes", cap, "--log-level", "warning"],
                stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        try:
            with LocalCluster(edges=0, backend="container", state_dir=state,
                              remote_edges=addrs, edge_token=token.encode()) as cl, \
                    Client(cl.url, cl.api_key, protocol="http") as c:
                _healthy(c)
                keep = c.sandboxes.create()      # a's one slot (the holder of everything)
                nonholder: list[float] = []
                holder: list[float] = []
                try:
                    for i in range(rounds):
                        name = _toolkit(cl.url, cl.api_key, i, tool_mb << 20)
                        for bucket in (nonholder, holder):
                            t0 = time.perf_counter()
                            sb = c.sandboxes.create(toolkits=[name])
                            bucket.append((time.perf_counter() - t0) * 1e3)
                            node = sb.info.node
                            sb.kill()
                            if node != "b":
                                raise RuntimeError(f"bench create landed on {node}, not b")
                finally:
                    keep.kill()
        finally:
            for p in procs:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(60)
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for node in addrs:
                for sub in ("pool", "scratch"):   # (+ the shared scratch, issue 22)
                    pool = os.path.join(tmp, node, "container", sub)
                    if os.path.ismount(pool):
                        umount2(pool, MNT_DETACH)
    params = {"toolkit_mb": tool_mb, "rounds": rounds, "backend": "container",
              "transport": "tcp-loopback"}
    return [Result(SUITE, "create_nonholder_first_ms", statistics.median(nonholder), "ms",
                   params),
            Result(SUITE, "create_holder_ms", statistics.median(holder), "ms", params)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(c: Any) -> None:
    deadline = time.monotonic() + 60
    while True:
        nodes = c.nodes()
        if len(nodes) == 2 and all(n.healthy for n in nodes):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench edges not healthy: {nodes}")
        time.sleep(0.2)


def _toolkit(url: str, key: str, i: int, size: int) -> str:
    """A fresh toolkit layer, built into the apiserver's store: on a only (full, so the
    create goes to b whatever a's heartbeat says)."""
    import httpx

    name = f"bench-move-{i}-{secrets.token_hex(3)}"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = os.urandom(size)
        info = tarfile.TarInfo(f"opt/{name}/blob")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    r = httpx.post(f"{url}/v1/images", params={"name": name, "kind": "toolkit"},
                   content=buf.getvalue(), timeout=120,
                   headers={"authorization": f"Bearer {key}"})
    r.raise_for_status()
    return name
