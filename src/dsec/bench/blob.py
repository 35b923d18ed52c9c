"""Suite ``blob``: the blob store backends on loopback, as a node's lazy reads and an
operator's pushes use them.

Servers are started here, on 127.0.0.1, and stopped at the end: moto's standalone S3
server (Python: it bounds the S3 figures, a real S3 or MinIO serves faster) and Debian's
nginx serving a directory; ``file://`` is the floor (page cache).

- ``blob_<backend>_range_p50_ms``: one 256 KiB ranged read (a chunk miss), one at a time,
  random offsets in a ``size_mib`` object; ``..._p99_ms`` beside it.
- ``blob_<backend>_range_mb_s``: 256 KiB ranged reads with ``threads`` in flight (a
  node's bounded fetch concurrency), MB/s of payload.
- ``blob_<backend>_upload_mb_s``: ``put_file`` of a ``size_mib`` layer file (S3:
  multipart, 8 MiB parts, 4 at once; HTTP: one WebDAV PUT; file: copy + fsync + rename).

Needs nginx (APT_PACKAGES) and moto[server] (dev extra); a backend whose server is
missing is skipped with a note.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import secrets
import shutil
import statistics
import tempfile
import time

from dsec.bench import BenchContext, suite

CHUNK = 256 * 1024


@suite("blob")
def blob_suite(ctx: BenchContext) -> None:
    """Blob stores on loopback: 256 KiB ranged-read p50 and MB/s, upload MB/s."""
    from dsec.image.blob import BlobStore, open_blobstore
    from dsec.image.blob.localservers import NGINX, MotoServer, Nginx

    size_mib = ctx.scale(128, 8)
    reads = ctx.scale(400, 40)
    threads = 8
    work = tempfile.mkdtemp(prefix="dsec-bench-blob-")
    stops: list[object] = []
    try:
        src = os.path.join(work, "layer")
        with open(src, "wb") as f:
            f.writelines(os.urandom(1 << 20) for _ in range(size_mib))
        stores: dict[str, BlobStore] = {"file": open_blobstore(f"file://{work}/fs")}
        if os.path.exists(NGINX):
            ng = Nginx(os.path.join(work, "nginx"))
            stops.append(ng)
            os.chmod(work, 0o755)
            stores["http"] = open_blobstore(ng.url)
        else:
            ctx.note("blob: http skipped (no nginx: apt-get install nginx-light)")
        try:
            moto = MotoServer()
            stops.append(moto)
            bucket = "bench-" + secrets.token_hex(4)
            moto.create_bucket(bucket)
            os.environ.setdefault("AWS_ACCESS_KEY_ID", MotoServer.ACCESS_KEY)
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", MotoServer.SECRET_KEY)
            stores["s3"] = open_blobstore(
                f"s3://{bucket}/bench?endpoint_url={moto.endpoint}&region=us-east-1")
        except (ImportError, RuntimeError) as exc:
            ctx.note(f"blob: s3 skipped ({exc})")
        rng = random.Random(7)
        n_chunks = size_mib * (1 << 20) // CHUNK
        for name, store in stores.items():
            t0 = time.perf_counter()
            store.put_file("layers/bench", src)
            up = time.perf_counter() - t0
            ctx.record(f"blob_{name}_upload_mb_s", size_mib * (1 << 20) / up / 1e6, "MB/s",
                       size_mib=size_mib)
            offsets = [rng.randrange(n_chunks) * CHUNK for _ in range(reads)]
            store.get_range("layers/bench", 0, CHUNK)          # connection warm
            lat = []
            for off in offsets:
                a = time.perf_counter()
                data = store.get_range("layers/bench", off, CHUNK)
                lat.append(time.perf_counter() - a)
                assert len(data) == CHUNK
            lat.sort()
            ctx.record(f"blob_{name}_range_p50_ms", statistics.median(lat) * 1e3, "ms",
                       chunk=CHUNK, reads=reads, size_mib=size_mib)
            ctx.record(f"blob_{name}_range_p99_ms", lat[int(len(lat) * 0.99) - 1] * 1e3,
                       "ms", chunk=CHUNK, reads=reads)
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                t0 = time.perf_counter()
                total = sum(len(b) for b in pool.map(
                    lambda off, s=store: s.get_range("layers/bench", off, CHUNK),
                    offsets))
                el = time.perf_counter() - t0
            ctx.record(f"blob_{name}_range_mb_s", total / el / 1e6, "MB/s", chunk=CHUNK,
                       threads=threads, reads=reads)
        if "s3" in stores:
            # moto copies the whole object for every ranged GET: a small object shows
            # the client path without that server cost
            small = os.urandom(4 << 20)
            stores["s3"].put_bytes("layers/small", small)
            lat = []
            for off in offsets:
                off %= (4 << 20) - CHUNK
                a = time.perf_counter()
                stores["s3"].get_range("layers/small", off, CHUNK)
                lat.append(time.perf_counter() - a)
            ctx.record("blob_s3_range_small_p50_ms", statistics.median(lat) * 1e3, "ms",
                       chunk=CHUNK, reads=reads, size_mib=4)
        ctx.note("blob: the S3 figures are bounded by moto (a Python server); they show "
                 "the client path works and what it costs, not what S3 or MinIO serve")
    finally:
        for s in stops:
            s.stop()  # type: ignore[attr-defined]
        shutil.rmtree(work, ignore_errors=True)
