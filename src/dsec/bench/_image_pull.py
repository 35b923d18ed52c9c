"""Suite ``image``, registry part (issue 15): ``image_pull`` (MB/s) from a local registry
into dsec layers vs ``skopeo copy`` + ``umoci unpack`` of the same image in the same run,
and ``image_first_exec_s``: a cold ``create(image=<registry ref>)`` on a cluster whose
store lacks the image, to its first exec answering. Called from
:func:`dsec.bench.image.image_suite` (one suite, one run)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time

from dsec.bench import BenchContext
from dsec.image.busybox import stage_busybox_root
from dsec.image.localregistry import LocalRegistry, push, tar_dir, write_image
from dsec.image.pull import PullOptions, pull_image
from dsec.image.store import LayerStore

__all__ = ["pull_bench"]


def _data_layer(root: str, total: int, rng: random.Random, tag: str) -> bytes:
    """A layer tree of ``total`` bytes: half random (incompressible), half text."""
    d = os.path.join(root, tag)
    os.makedirs(os.path.join(d, "opt", tag))
    written, i = 0, 0
    text = b"import os\nprint('hello from a layer')\n" * 128
    while written < total:
        size = rng.choice([4_000, 32_000, 256_000, 1_000_000])
        data = rng.randbytes(size) if i % 2 else (text * (size // len(text) + 1))[:size]
        with open(os.path.join(d, "opt", tag, f"f{i}"), "wb") as f:
            f.write(data)
        written += size
        i += 1
    return tar_dir(d)


def pull_bench(ctx: BenchContext, work: str) -> None:
    image_mb = ctx.scale(96, 16)
    rng = random.Random(15)
    src = os.path.join(work, "pull-src")
    bb = os.path.join(src, "bb")
    os.makedirs(bb)
    stage_busybox_root(bb)
    layers = [tar_dir(bb), _data_layer(src, image_mb * 10**6 // 2, rng, "a"),
              _data_layer(src, image_mb * 10**6 // 2, rng, "b")]
    tar_bytes = sum(len(x) for x in layers)
    layout = os.path.join(work, "pull-layout")
    write_image(layout, "img", layers, {"Env": ["FOO=bench"], "WorkingDir": "/opt"})
    shutil.rmtree(src)
    with LocalRegistry(os.path.join(work, "registry")) as reg:
        ref = f"{reg.host}/bench/img:1"
        push(layout, "img", ref)
        p = {"image_mb": round(tar_bytes / 1e6), "layers": len(layers),
             "registry": "docker-registry on loopback"}

        # -- dsec: its registry client + one EROFS layer per OCI layer ----------------------
        store = LayerStore(os.path.join(work, "pull-store"))
        t0 = time.perf_counter()
        pull_image(store, ref, options=PullOptions(insecure=True))
        dt = time.perf_counter() - t0
        ctx.record("image_pull", tar_bytes / dt / 1e6, "MB/s", path="dsec", seconds=round(dt, 3),
                   **p)

        # -- the usual path to a runnable rootfs: skopeo copy + umoci unpack -----------------
        oci = os.path.join(work, "pull-oci")
        bundle = os.path.join(work, "pull-bundle")
        t0 = time.perf_counter()
        subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false",
                        f"docker://{ref}", f"oci:{oci}:img"], check=True, capture_output=True)
        subprocess.run(["umoci", "unpack", "--image", f"{oci}:img", bundle], check=True,
                       capture_output=True)
        dt = time.perf_counter() - t0
        ctx.record("image_pull", tar_bytes / dt / 1e6, "MB/s", path="skopeo+umoci",
                   seconds=round(dt, 3), **p)
        shutil.rmtree(bundle, ignore_errors=True)
        shutil.rmtree(oci, ignore_errors=True)
        ctx.note("image_pull: MB/s of uncompressed layer tar bytes, from a docker-registry "
                 "on loopback into a cold store; dsec = dsec.image.distribution's fetch "
                 "(4 blobs at once, every hop under the egress policy, resumable) + per "
                 "layer gunzip, diff_id check, safe unpack and mkfs.erofs; "
                 "skopeo+umoci = skopeo copy + umoci unpack of the same image (a rootfs "
                 "directory, not a shareable layer stack).")
        _first_exec(ctx, ref, p)


def _first_exec(ctx: BenchContext, ref: str, p: dict[str, object]) -> None:
    """A fresh cluster (its store lacks the image): create(image=ref) -> first exec."""
    from dsec.cluster.local import LocalCluster

    with LocalCluster(edges=1, backend="container", registries=("127.0.0.1",)) as cl:
        from dsec.client.sync import Client
        with Client(cl.url, cl.api_key, gateway=cl.gateway, session_lease_s=None) as c:
            t0 = time.perf_counter()
            sb = c.sandboxes.create(image=ref, project="default")
            try:
                r = sb.exec("true")
                dt = time.perf_counter() - t0
            finally:
                sb.kill()
            assert r.exit_code == 0, r
            t0 = time.perf_counter()
            with c.sandboxes.create(image=ref, project="default") as sb2:
                sb2.exec("true")
            warm = time.perf_counter() - t0
            cached = _cached_build_from_registry(c, ref, ctx.scale(10, 4))
    ctx.record("image_first_exec_s", dt, "s", warm_s=round(warm, 3), **p)
    ctx.record("image_build_cached_ms", cached, "ms", base="registry ref", steps=2,
               note="Image.from_registry(ref) + 2 steps, every step cached: the base's "
                    "pull (manifest + config, no blob) + one snapshot listing")


def _cached_build_from_registry(c: object, ref: str, n: int) -> float:
    """Median ms of an all-cached rebuild of a 2-step recipe on a registry image."""
    import statistics

    from dsec.client.build import Image
    from dsec.client.sync import Client

    assert isinstance(c, Client)
    image = Image.from_registry(ref).run("echo 1 > /opt/one").run("echo 2 > /opt/two")
    image.build(c, project="default")
    times = []
    for _ in range(n):
        again = image.build(c, project="default")
        assert again.ran == 0 and again.cached == 2, again
        times.append(again.seconds * 1e3)
    return statistics.median(times)
