"""The edge's end of lazy layers: a node starts sandboxes from layers it has never
stored, reading 256 KiB chunks from the blob store as the sandbox touches them.

:class:`LazyLayers` runs the FUSE daemon (:mod:`dsec.edge.lazy.daemon`) as a child
process and hands :class:`~dsec.image.mount.MountCache` the path of a remote layer's file
in its mount (:meth:`LazyLayers.path`); the mount cache mounts that file as EROFS exactly
like a local layer file. A layer becomes remote-known when the control plane grants it
(``layer_grant``, :meth:`dsec.edge.backends.container.images.StoreImages.grant`): the
control plane's manifest goes into the node's layer store (no layer file:
``LayerStore.add_remote``) and its chunk table, checked against the sha256 that manifest
records (:meth:`LazyLayers.register`), into the chunk cache directory, where the daemon
finds it. A node never reads a layer's ``.manifest`` from the blob store.

The daemon is watched. When it dies (a crash, kill -9), the kernel has already aborted its
FUSE connection (its /dev/fuse fd closed; we also write the connection's ``abort`` file in
case anything else held that fd), so reads of chunks that were not yet in a sandbox's
page cache fail with EIO at once and nothing waits in D state. :class:`LazyLayers` then
detaches the dead mount, starts a new daemon on a fresh mount point and tells its
listeners (the mount cache rebinds every lazy layer it holds to the new file,
:meth:`MountCache.rebind`): new sandboxes work at once, and the chunk cache on disk is
adopted by the new daemon (re-verified chunk by chunk on first read). Sandboxes that were
running keep their overlay over the *old* EROFS superblock (overlayfs holds its own
reference), whose backing file is on the aborted connection: pages they had read stay
readable, anything else fails with EIO until they are recreated; each gets a
``layer_unavailable`` event that says so. (Keeping them alive across a daemon restart
would need the edge to hold the /dev/fuse fd and the new daemon to resend the lost
requests, FUSE_NOTIFY_RESEND: not done.)

Measured here (2 shared vCPUs under heavy load; ``dsec bench lazy``, 1 GiB image): a
sequential read through the EROFS mount with the EROFS and FUSE page caches dropped, so
every byte comes from the pyfuse3 daemon's chunk cache, ran at 0.34x (486 vs 1,420 MB/s)
of the same read from EROFS on the local layer file; with the FUSE file's pages kept
(keep_cache: the steady state, the daemon is not asked again) 0.78x; a 4 KiB O_DIRECT read
of a cached chunk (one daemon round trip) 49 us p50. First exec on a cold node was 23x
faster than pull-then-mount, fetching 1.12x the bytes the task read. A minimal C libfuse3
daemon (``bench/lazy_cfuse.c``: pread, no fetch path) served the same sequential reads
1.9-2.8x faster (``lazy_warm_read_ratio_c_reference``, three runs): Python per request
(~100-150 us per 128 KiB here) is the cost. A C daemon would have to carry its own
S3/HTTP clients, retries and chunk verification, which are dsec's Python, so pyfuse3 it
is while cold starts are bound by the blob store and warm reads by the page cache; the way
to the warm target is a C front end for cached chunks handing misses to this fetcher.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import IO, Any, Self

import msgspec

from dsec.errors import (
    BlobNotFound,
    CorruptLayer,
    DsecError,
    ImageError,
    ImageNotFound,
    InUse,
    InvalidArgument,
    PermissionDenied,
)
from dsec.image.blob import BlobStore, layer_chunks_key, open_blobstore
from dsec.image.blob.traces import load_trace, new_trace, record_trace
from dsec.image.chunks import MIN_CHUNK_SIZE, check_table, table_bytes_bound
from dsec.image.manifest import DIGEST_PREFIX, LayerManifest
from dsec.image.mount import RUN_ROOT, is_mountpoint, sys_mount, sys_umount
from dsec.ownership import claim, disown

__all__ = ["LazyConfig", "LazyLayers", "TraceWrites"]

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 20.0
#: The lazy FUSE connection's ``max_background`` (kernel default from libfuse: 12).
FUSE_MAX_BACKGROUND = 512
#: The largest chunk a node reads lazily: one fetch holds a run of chunks in memory, so
#: the push's chunk size (the control plane's record) is bounded here, not only by the
#: 64 MiB any table may have (red team 17 F2).
MAX_LAZY_CHUNK_SIZE = 4 << 20


class LazyConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of a node's lazy layers (``dsec edge --blob-store URL``)."""

    blob_url: str
    cache_dir: str
    """Chunk tables, the chunk cache (one sparse file per layer) and access traces."""
    cache_bytes: int | None = None
    """LRU budget of the chunk cache in bytes (``--lazy-cache-bytes``; None: no limit)."""
    retry_budget_s: float = 10.0
    """How long a fetch retries an unreachable blob store before reads fail with EIO."""
    max_inflight: int = 8
    """Ranged requests to the blob store at once."""
    breaker_failures: int = 3
    """Fetches in a row that ran out ``retry_budget_s`` on an unreachable store before
    its circuit breaker opens: then misses fail with EIO at once, not after the budget,
    until a probe request answers (``dsec.edge.lazy.plan.Breaker``)."""
    breaker_open_s: float = 2.0
    """Time between probes of a store found down (doubling up to ``breaker_max_open_s``)."""
    breaker_max_open_s: float = 10.0
    trace_window_s: float = 5.0
    """A layer's access trace: chunks first read within this long of its first read."""
    restart: bool = True
    """Restart the daemon when it dies."""
    traces: bool = True
    """Record access traces and prefetch the stored ones (False: neither)."""
    node: str = "node"
    """This node's name, in the access traces it records."""
    read_ahead_kb: int | None = None
    """Readahead window of the FUSE file in KiB (its connection's ``read_ahead_kb``;
    None: the kernel's 128). Measured, and left alone: :data:`READ_AHEAD_TRADE_OFF`."""


class LazyLayers:
    """See the module docstring. Thread-safe; ``close()`` stops the daemon and unmounts
    (close the mount cache first: EROFS mounts hold the daemon's files open)."""

    def __init__(self, config: LazyConfig, *, blob: BlobStore | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.config = config
        self.blob = blob if blob is not None else open_blobstore(config.blob_url)
        # The one thing a node writes to the blob store is an access trace: everything
        # else it reads is what a pusher wrote. Writes go through this guard, so no code
        # path of the edge ever writes a layer key, and an operator can give nodes a
        # credential that may write ``traces/`` only (docs/blobs.md, red team 17 F1).
        self.trace_store = TraceWrites(self.blob)
        self.on_event = on_event
        self._listeners: list[Callable[[], object]] = []
        os.makedirs(config.cache_dir, mode=0o700, exist_ok=True)
        # One daemon per chunk cache: two would punch out each other's chunks.
        self._lock_fd = os.open(os.path.join(config.cache_dir, "lock"),
                                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise InUse(f"the chunk cache {config.cache_dir} is in use by another edge; "
                        "give each node its own (--state-dir)",
                        cache_dir=config.cache_dir) from None
        os.makedirs(RUN_ROOT, mode=0o700, exist_ok=True)
        # "m" prefix + owner file: a root a killed edge left is reclaimed (detached) by
        # the next MountCache made on this host (dsec.image.mount.reclaim_dead_roots).
        self.root = tempfile.mkdtemp(prefix="m", dir=RUN_ROOT)
        claim(self.root)
        # beside the chunk cache, not in the mount root: a root holds nothing but the
        # mount point, so the reclaim of a killed edge's root can remove it
        self.stats_path = os.path.join(config.cache_dir, "stats.json")
        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: int | None = None
        self.mount = ""
        self.generation = 0
        self.restarts = 0
        self._closing = False
        self._stats_seq = 0
        self._stats_cv = threading.Condition()
        self._stats_ack = 0
        # counters of daemons that died, so the node's totals never go backwards
        self._carried: dict[str, Any] = {}
        self._images: set[str] = set()          # images whose trace was used or recorded
        self._pinned: set[str] = set()
        self._timers: list[threading.Timer] = []
        try:
            self._start()
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(self.root)
            disown(self.root)
            os.close(self._lock_fd)
            raise

    # ------------------------------------------------------------------ daemon
    def _start(self) -> None:
        self.generation += 1
        self.mount = os.path.join(self.root, f"f{self.generation}")
        os.mkdir(self.mount, 0o700)
        c = self.config
        argv = [sys.executable, "-m", "dsec.edge.lazy.daemon", "--mount", self.mount,
                "--cache-dir", c.cache_dir, "--blob-store", c.blob_url,
                "--retry-budget-s", str(c.retry_budget_s),
                "--max-inflight", str(c.max_inflight),
                "--trace-window-s", str(c.trace_window_s), "--stats", self.stats_path,
                "--breaker-failures", str(c.breaker_failures),
                "--breaker-open-s", str(c.breaker_open_s),
                "--breaker-max-open-s", str(c.breaker_max_open_s)]
        if c.cache_bytes is not None:
            argv += ["--cache-bytes", str(c.cache_bytes)]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                close_fds=True)
        assert proc.stdout is not None
        line = _readline_timeout(proc.stdout, READY_TIMEOUT_S)
        if not line.startswith(b'{"ev": "ready"}'):
            proc.kill()
            proc.wait()
            self._drop_mount(self.mount)
            raise ImageError(f"the lazy layer daemon did not start (said {line[:300]!r}); "
                             "is /dev/fuse there and pyfuse3 installed?")
        dev = os.stat(self.mount).st_dev                      # answered: INIT is done
        self._conn = os.minor(dev)
        self._tune(self._conn)
        if c.read_ahead_kb is not None:
            # before any EROFS mount opens the FUSE file: a file's readahead window is
            # taken from its device when it is opened
            _set_read_ahead(dev, c.read_ahead_kb)
        self._proc = proc
        threading.Thread(target=self._watch, args=(proc, self.mount, self._conn),
                         name=f"lazy-daemon-{proc.pid}", daemon=True).start()

    def _watch(self, proc: subprocess.Popen[bytes], mount: str, conn: int) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            try:
                ev = json.loads(raw)
            except ValueError:
                continue
            if ev.get("ev") == "stats":
                with self._stats_cv:
                    self._stats_ack = max(self._stats_ack, int(ev.get("seq") or 0))
                    self._stats_cv.notify_all()
                continue
            if ev.get("ev") == "store_down":
                log.warning("blob store %s is down, lazy reads of uncached chunks fail "
                            "at once for %ss (then one probe): %s", ev.get("store"),
                            ev.get("open_s"), ev.get("cause"))
            elif ev.get("ev") == "store_up":
                log.warning("blob store %s answers again", ev.get("store"))
            elif ev.get("ev") == "layer_refused":
                log.warning("blob store %s refuses reads of layer sha256:%s: its uncached "
                            "chunks fail at once for %ss (then one probe); other layers "
                            "unaffected: %s", ev.get("store"), ev.get("layer"),
                            ev.get("open_s"), ev.get("cause"))
            if self.on_event is not None:
                try:
                    self.on_event(ev)
                except Exception:
                    log.exception("lazy layer event handler failed on %s", ev)
        rc = proc.wait()
        with self._lock:
            if self._closing or proc is not self._proc:
                return
            log.warning("lazy layer daemon %d died (exit %s); restarting it", proc.pid, rc)
            self._carried = _add_counters(self._carried, self._read_stats())
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.stats_path)
            self._abort(conn)
            self._drop_mount(mount)
            if not self.config.restart:
                self._proc = None
                return
            self.restarts += 1
            try:
                self._start()
            except DsecError:
                log.exception("restarting the lazy layer daemon failed")
                self._proc = None
                return
            listeners = list(self._listeners)
            for d in self._pinned:
                self._send({"cmd": "pin", "layer": d.removeprefix(DIGEST_PREFIX)})
        if self.on_event is not None:
            with contextlib.suppress(Exception):
                self.on_event({"ev": "daemon_restarted", "exit": rc, "pid": proc.pid})
        for fn in listeners:
            try:
                fn()
            except Exception:
                log.exception("re-binding lazy layers after a daemon restart failed")

    @staticmethod
    def _tune(conn: int) -> None:
        _ensure_fusectl()
        """Raise the connection's background request limit from libfuse's 12: readahead
        and async direct I/O of every sandbox share it, so a few misses waiting on a slow
        store held every slot and reads of cached chunks queued in the kernel behind
        them (red team 17 F11). The daemon sheds misses past ``max_waiting_reads``
        (below this), so a cached read always finds a slot."""
        for name, value in (("max_background", FUSE_MAX_BACKGROUND),
                            ("congestion_threshold", FUSE_MAX_BACKGROUND * 3 // 4)):
            try:
                with open(f"/sys/fs/fuse/connections/{conn}/{name}", "w") as f:
                    f.write(str(value))
            except OSError as exc:
                log.warning("cannot set %s of FUSE connection %d: %s", name, conn, exc)

    @staticmethod
    def _abort(conn: int) -> None:
        """Abort the FUSE connection (pending and future requests fail at once): the
        kernel already did when the daemon's /dev/fuse fd closed, unless a copy of that
        fd lives on somewhere; this makes sure."""
        with contextlib.suppress(OSError), \
                open(f"/sys/fs/fuse/connections/{conn}/abort", "w") as f:
            f.write("1")

    @staticmethod
    def _drop_mount(mount: str) -> None:
        with contextlib.suppress(OSError):
            sys_umount(mount, detach=True)
        with contextlib.suppress(OSError):
            os.rmdir(mount)

    def on_restart(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` (from the watcher thread) after the daemon was restarted."""
        self._listeners.append(fn)

    @property
    def pid(self) -> int | None:
        p = self._proc
        return p.pid if p is not None else None

    def alive(self) -> bool:
        p = self._proc
        return p is not None and p.poll() is None

    def _send(self, cmd: dict[str, Any]) -> None:
        with self._lock:
            p = self._proc
            if p is None or p.stdin is None:
                return
            with contextlib.suppress(BrokenPipeError, ValueError, OSError):
                p.stdin.write(json.dumps(cmd).encode() + b"\n")
                p.stdin.flush()

    # ------------------------------------------------------------------ layers
    def table_path(self, digest: str) -> str:
        return os.path.join(self.config.cache_dir,
                            digest.removeprefix(DIGEST_PREFIX) + ".chunks")

    def knows(self, digest: str) -> bool:
        return os.path.exists(self.table_path(digest))

    def path(self, manifest: LayerManifest) -> str | None:
        """The file to mount for ``manifest`` when this node serves it lazily, else None."""
        if not self.knows(manifest.digest):
            return None
        return os.path.join(self.mount, manifest.hex)

    def register(self, manifest: LayerManifest) -> None:
        """Fetch the layer's chunk table into the cache dir (once), so the daemon serves
        it. The table must be exactly the one ``manifest.chunk_table`` records (its
        sha256, written by the push that hashed the whole file): the hashes each chunk
        is checked against never come from the blob store alone (red team 17 F1), and
        the store is asked for that many bytes, never for what its HEAD announces (F2)."""
        ref = manifest.chunk_table
        if ref is None:
            raise CorruptLayer(
                f"layer {manifest.digest} has no recorded chunk table (pushed by an older "
                "dsec, or its manifest did not come from its pusher): its chunks cannot be "
                "verified; push it again (dsec image push)", digest=manifest.digest)
        if not MIN_CHUNK_SIZE <= ref.chunk_size <= MAX_LAZY_CHUNK_SIZE \
                or ref.size > table_bytes_bound(manifest.size_bytes, ref.chunk_size):
            raise CorruptLayer(
                f"layer {manifest.digest}: a {ref.size}-byte chunk table in "
                f"{ref.chunk_size}-byte chunks is not one a node reads lazily (chunks "
                f"{MIN_CHUNK_SIZE}..{MAX_LAZY_CHUNK_SIZE} bytes, table at most "
                f"{table_bytes_bound(manifest.size_bytes, ref.chunk_size)} bytes for "
                f"{manifest.size_bytes}); push it with --chunk-size 262144",
                digest=manifest.digest)
        path = self.table_path(manifest.digest)
        try:
            with open(path, "rb") as f:
                check_table(f.read(ref.size + 1), ref, digest=manifest.digest,
                            size=manifest.size_bytes)
            return                      # registered before, and still the recorded one
        except FileNotFoundError:
            pass
        except CorruptLayer:
            log.warning("cached chunk table of %s is not the recorded one; fetching it "
                        "again", manifest.digest)
        key = layer_chunks_key(manifest.digest)
        try:
            raw = self.blob.get_range(key, 0, ref.size)
        except BlobNotFound:
            raise ImageNotFound(f"layer {manifest.digest} has no chunk table in the blob "
                                f"store {self.blob.url}; push it again (dsec image push)",
                                ref=manifest.digest) from None
        except InvalidArgument as exc:     # shorter than recorded
            raise CorruptLayer(f"the blob store's chunk table of {manifest.digest} is not "
                               f"the {ref.size} bytes its push recorded: {exc}",
                               digest=manifest.digest) from exc
        check_table(raw, ref, digest=manifest.digest, size=manifest.size_bytes)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)

    # ---------------------------------------------------------- access traces
    def image_started(self, image: str, layers: Sequence[str]) -> int:
        """A sandbox of ``image`` (its top layer's digest) starts on the lazily read
        ``layers``. The first time on this node: prefetch, in the background, the chunks
        the image's stored access trace names (recorded by whichever node started it
        first); when there is none, record one: the chunks first read in each layer's
        first ``trace_window_s``, stored with the image in the blob store. Returns the
        chunks asked to prefetch. A trace is a hint: any problem with it is logged."""
        lazy = [d for d in layers if self.knows(d)]
        if not self.config.traces:
            return 0
        with self._lock:
            if image in self._images or not lazy:
                return 0
            self._images.add(image)
        trace = load_trace(self.blob, image)
        if trace is not None:
            n = 0
            for d, chunks in trace.layers.items():
                if d in lazy and chunks:
                    self.prefetch(d, chunks)
                    n += len(chunks)
            return n
        # each layer's trace closes trace_window_s after its first read, which comes
        # after the mount: wait twice that before collecting
        t = threading.Timer(2 * self.config.trace_window_s + 1.0, self._save_trace,
                            (image, tuple(lazy)))
        t.daemon = True
        self._timers.append(t)
        t.start()
        return 0

    def _save_trace(self, image: str, layers: tuple[str, ...]) -> None:
        per = {d: chunks for d in layers if (chunks := self.trace(d))}
        if not per or self._closing:
            return
        try:
            record_trace(self.trace_store, new_trace(image, self.config.node, per,
                                              window_s=self.config.trace_window_s))
        except DsecError as exc:
            log.warning("access trace of image %s not stored in %s: %s", image,
                        self.blob.url, exc)

    # ------------------------------------------------------------ prefetch/pin
    def prefetch(self, digest: str, chunks: list[int]) -> None:
        self._send({"cmd": "prefetch", "layer": digest.removeprefix(DIGEST_PREFIX),
                    "chunks": chunks})

    def pin(self, digest: str) -> None:
        """Fetch the whole layer into the chunk cache and never evict it (also after a
        daemon restart: pins are re-sent to the new daemon)."""
        with self._lock:
            self._pinned.add(digest)
        self._send({"cmd": "pin", "layer": digest.removeprefix(DIGEST_PREFIX)})

    def unpin(self, digest: str) -> None:
        """The layer's chunks may be evicted again (least recently used first)."""
        with self._lock:
            self._pinned.discard(digest)
        self._send({"cmd": "unpin", "layer": digest.removeprefix(DIGEST_PREFIX)})

    @property
    def pinned(self) -> frozenset[str]:
        return frozenset(self._pinned)

    def trace(self, digest: str) -> list[int] | None:
        """The chunks the layer's first reads touched on this node (None: not recorded)."""
        try:
            with open(os.path.join(self.config.cache_dir, "traces",
                                   digest.removeprefix(DIGEST_PREFIX) + ".json"), "rb") as f:
                return [int(i) for i in json.loads(f.read())["chunks"]]
        except (FileNotFoundError, ValueError, KeyError):
            return None

    # ------------------------------------------------------------------- stats
    def stats(self, *, fresh: bool = False, timeout_s: float = 5.0) -> dict[str, Any]:
        """The daemon's counters (its stats file; ``fresh``: ask it to write one now)."""
        if fresh and self.alive():
            with self._stats_cv:
                self._stats_seq += 1
                seq = self._stats_seq
            self._send({"cmd": "stats", "seq": seq})
            with self._stats_cv:
                self._stats_cv.wait_for(lambda: self._stats_ack >= seq, timeout_s)
        return _add_counters(self._carried, self._read_stats())

    def _read_stats(self) -> dict[str, Any]:
        try:
            with open(self.stats_path, "rb") as f:
                doc: dict[str, Any] = json.loads(f.read())
                return doc
        except (FileNotFoundError, ValueError):
            return {}

    def close(self) -> None:
        for t in self._timers:
            t.cancel()
        with self._lock:
            self._closing = True
            p = self._proc
            self._proc = None
        if p is not None:
            with contextlib.suppress(OSError):
                if p.stdin is not None:
                    p.stdin.close()      # EOF: the daemon unmounts and exits
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._drop_mount(self.mount)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.stats_path)
        try:
            os.rmdir(self.root)
        except OSError as exc:
            # keep the owner record: once this process is gone the next mount cache on
            # the host reclaims the root (dsec.image.mount.reclaim_dead_roots)
            log.warning("lazy layer root %s not removed: %s", self.root, exc)
        else:
            disown(self.root)
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_COUNTERS = ("reads", "bytes_read", "chunk_hits", "chunk_misses", "waits", "requests",
             "chunk_fetches", "bytes_fetched", "retries", "verify_failures", "failed_reads",
             "evictions", "prefetched_chunks", "fetch_seconds_sum", "shed_reads",
             "abandoned_fetches", "late_chunks", "fast_failed_runs", "breaker_opens",
             "late_sent")


def _add_counters(carried: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """``now`` (a live daemon's stats) plus the counters of daemons that died before it
    (pure)."""
    if not carried:
        return dict(now)
    out = dict(now)
    for k in _COUNTERS:
        out[k] = carried.get(k, 0) + now.get(k, 0)
    cb, nb = carried.get("fetch_buckets"), now.get("fetch_buckets")
    if cb and nb and len(cb) == len(nb):
        out["fetch_buckets"] = [a + b for a, b in zip(cb, nb, strict=True)]
    elif cb and not nb:
        out["fetch_buckets"] = cb
        out["fetch_bounds"] = carried.get("fetch_bounds")
    return out


class TraceWrites:
    """A blob store seen through a node's rights: reads of anything, writes of access
    traces (``traces/...``) only; a write of any other key is ``PermissionDenied``."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.url = inner.url

    def _check(self, key: str) -> None:
        if not key.startswith(TRACES_PREFIX):
            raise PermissionDenied(f"a node writes only access traces ({TRACES_PREFIX}...) "
                                   f"to the blob store {self.url}, not {key[:200]!r}",
                                   key=key)

    def head(self, key: str) -> int | None:
        return self.inner.head(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self.inner.get_range(key, offset, length)

    def put_file(self, key: str, path: str) -> None:
        self._check(key)
        self.inner.put_file(key, path)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._check(key)
        self.inner.put_bytes(key, data)

    def delete(self, key: str) -> None:
        self._check(key)
        self.inner.delete(key)


READ_AHEAD_TRADE_OFF = """
Measured 2026-12-02 (2 shared vCPUs, load 4-8; side by side in one process, one daemon
per setting over the same cached chunks, EROFS and FUSE pages dropped before each read,
96 MiB of 4 MiB files): with the kernel's 128 KiB readahead on the FUSE file every
FUSE_READ is <= 128 KiB (528 requests for 64 MiB); py-spy of the daemon then shows ~50%
in pyfuse3's request wrapper (/dev/fuse read, dispatch, reply copy), ~15% in the pread
of the chunk cache file, ~25% waiting - little Python of dsec's own. Raising
``read_ahead_kb`` (set before EROFS opens the FUSE file: a file takes its window from
its device at open) makes requests of up to 1 MiB (~520 KiB on average) but bought only
1.04x (256 KiB), 1.06x (512 KiB), 1.11x (1 MiB) on those warm reads (one quick bench run
even 0.74x: noise at 2 MiB of reads), while cold reads fetched more ahead from the blob
store: fetch amplification 1.06 (128 KiB), 1.10, 1.21, 1.50 (1 MiB); the quick bench's
small task went from ~1.1 to 4.2. Not worth it: the default stays the kernel's. The
rest of the gap to a local layer file is FUSE's own (two copies and a context switch
per request): the minimal C libfuse3 daemon is 1.2-2.8x (lazy_warm_read_ratio_c_reference)
- the measured bound of a C front end for cached chunks, which would also have to hand
misses, verification and stats across a process boundary: not built.
"""


def _set_read_ahead(dev: int, kb: int) -> None:
    """Set the readahead window of the FUSE connection's backing device (its bdi,
    ``/sys/class/bdi/MAJOR:MINOR/read_ahead_kb``): trade-off in
    :data:`READ_AHEAD_TRADE_OFF`."""
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kb))
    except OSError as exc:
        log.warning("cannot set the lazy FUSE file's readahead (%s): %s", path, exc)


TRACES_PREFIX = "traces/"
FUSECTL = "/sys/fs/fuse/connections"
_fusectl_lock = threading.Lock()


def _ensure_fusectl() -> None:
    """Mount the FUSE control filesystem where the kernel expects it when the host has
    not (systemd mounts it at boot; minimal hosts and VMs may not): the edge needs it to
    raise a connection's request limits (:meth:`LazyLayers._tune`) and to abort the
    connection of a dead daemon (:meth:`LazyLayers._abort`). Host-wide, idempotent and
    what every systemd host already has; nothing else changes."""
    with _fusectl_lock:
        if is_mountpoint(FUSECTL) or not os.path.isdir(FUSECTL):
            return
        try:
            sys_mount("fusectl", FUSECTL, "fusectl")
        except OSError as exc:
            log.warning("cannot mount fusectl on %s: %s", FUSECTL, exc)


def _readline_timeout(stream: IO[bytes], timeout_s: float) -> bytes:
    """One line from a child's stdout, or b"" after ``timeout_s``."""
    out: list[bytes] = []
    t = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    t.start()
    t.join(timeout_s)
    return out[0] if out else b""

