"""Build EROFS files with ``mkfs.erofs`` (Debian erofs-utils 1.5) and hash them.

erofs-utils 1.5 has no tar input (``--tar`` came in 1.6), so tar streams are unpacked into
a staging directory first (:mod:`dsec.image.archive`). ``--preserve-mtime`` keeps each
file's mtime (otherwise compact inodes carry the build time only), xattrs are copied,
which is how overlay whiteouts' ``trusted.overlay.opaque`` markers reach the layer.
Measured on the dev machine: a 103 MB tree builds in 0.73 s uncompressed, 0.5 s with lz4
(56 MB image); lz4hc is smaller and several times slower to build.

**Holes.** mkfs.erofs 1.5 knows nothing of SEEK_DATA: a flat (default) build reads a
sparse file's holes as zeros and writes them out, so a 1 GiB sparse file holding 4 KiB
became a 1 GiB layer (6.0 s). Its chunk-based layout (``--chunksize``) deduplicates
identical chunks by sha256, so every all-zero chunk of every file is stored once:
measured for that file, 196 KiB with 64 KiB chunks (4.6 s: it still hashes every byte),
532 KiB with 256 KiB chunks, ~1 MiB with 4 KiB chunks (the index: 4 bytes per chunk);
``-zlz4`` gives 4.6 MiB in 0.5 s. But a chunked layer gives every file at least one
block (no tail packing): 2,000 small files took 8.2 MiB instead of 224 KiB. So
:func:`layout_for` picks chunked only when the tree's holes make it the smaller layer,
and callers bound the apparent bytes a build may read (it costs ~4.6 s/GiB).

**Reproducible.** Identical trees give identical layers (issue 15 §4): a rebuild of an
unchanged 250 MB base used to add another 250 MB layer. mkfs.erofs 1.5 puts two
varying things into a layer: a random filesystem UUID (fixed with ``-U``: the caller
passes one derived from what the layer is, :func:`layer_uuid`) and the build time (the
superblock's ``build_time``, also the mtime of any "compact" inode). ``-T`` would fix
the build time but also stamps it on every file (measured: ``-T0 --preserve-mtime``
mounts with every mtime 0, in either order), which changes what the sandbox sees. So we
set ``SOURCE_DATE_EPOCH`` instead, which 1.5 reads as the build time and as a *clamp* on
newer mtimes: at 2**63-1 (:data:`REPRO_EPOCH`) it clamps nothing, every file keeps its
mtime to the nanosecond (checked by mounting) and the superblock is the same in every
build. Everything else mkfs writes comes from the tree: it sorts directory entries
(creation order does not matter; hardlinks resolve to the first name in that order),
numbers inodes in that order, and copies owners as they are (we keep ownership: layers
hold real uids, e.g. a Debian tree's ``_apt``, so ``--all-root`` is not an option). The
one input it takes in the source filesystem's order is xattrs (``llistxattr``: insertion
order in an ext4 inode), so every staging copy writes them sorted
(:func:`dsec.image.tree.copy_meta`, :func:`dsec.image.archive.extract_tar`). What is
*not* normalized: file mtimes. Two trees whose files differ only in mtime are different
trees (``make``, pip and tar see mtimes), so they get different digests; what the
staging code makes itself (directories a tar implies without a member, the root of an
archive without ``./``, whiteouts) gets a time derived from the content instead of
"now". Cost: none measured beyond noise (bench ``layer_build`` with ``reproducible``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid as _uuid
from collections.abc import Callable, Sequence
from typing import Literal

from dsec.errors import CapacityExceeded, ImageError, InvalidArgument

__all__ = ["CHUNK_BYTES", "MKFS", "REPRO_EPOCH", "Compression", "OutputTooLarge", "ProgressFn",
           "hash_file", "layer_uuid", "layout_for", "mkfs_erofs"]

Compression = Literal["lz4", "lz4hc"]
ProgressFn = Callable[[str, int, int], None]
"""``progress(phase, done, total)``; phases: ``"pack"`` (bytes written), ``"hash"``."""

MKFS = "mkfs.erofs"
_HASH_CHUNK = 1 << 20
CHUNK_BYTES = 64 << 10
"""Chunk size of chunk-based layers: 64 KiB gave the smallest layer for a sparse 1 GiB
file (index 8 bytes per chunk + one stored zero chunk)."""
_BLOCK = 4096
REPRO_EPOCH = (1 << 63) - 1
"""``SOURCE_DATE_EPOCH`` of reproducible builds: mkfs.erofs 1.5 clamps mtimes newer than
it, so the largest value it accepts (2**64-1 is refused as invalid) clamps none."""
_MAX_EXCLUDE_ARGV = 1 << 20   # of ARG_MAX's 2 MiB (a debootstrap /dev: ~40 entries)
_UUID_NS = _uuid.UUID("5d1e6a58-8f0c-4c1e-9a53-64736563e0f5")


def layer_uuid(*identity: str) -> str:
    """The filesystem UUID of a reproducible layer: a name-based UUID (v5) of what the
    layer *is* besides its tree (kind, namespace, parent, stack, labels, layout), so the
    same tree built as the same thing gives the same bytes and digest, and the same tree
    built for two projects (or as a snapshot and a base) gives two layers, each with its
    own manifest (pure). The fields are framed as a JSON list, never joined: a joined
    text lets one field spell another's boundary (red team 15, F8's class)."""
    return str(_uuid.uuid5(_UUID_NS, json.dumps(list(identity))))


def layout_for(*, files: int, apparent_bytes: int, allocated_bytes: int,
               entries: int) -> int | None:
    """The chunk size to build a tree with (``--chunksize``), or None for the default
    flat layout - whichever is estimated smaller (pure). Flat writes every apparent
    byte; chunked writes the allocated bytes (zero chunks deduplicated), a block per
    file at least, and an 8-byte index entry per chunk."""
    flat = apparent_bytes + entries * 64
    chunked = (allocated_bytes + files * _BLOCK + (apparent_bytes // CHUNK_BYTES) * 8
               + CHUNK_BYTES + entries * 64)
    return CHUNK_BYTES if chunked * 2 < flat and flat - chunked > 1 << 20 else None


class OutputTooLarge(ImageError):
    """mkfs.erofs stopped because its output reached ``max_output_bytes`` (no ``code``:
    callers map it to the error of the bound they passed)."""

    def __init__(self, message: str, *, limit: int) -> None:
        super().__init__(message, limit=limit)
        self.limit = limit


def mkfs_erofs(src_dir: str, out_path: str, *, compression: Compression | None = None,
               chunk_bytes: int | None = None, expected_bytes: int = 0,
               progress: ProgressFn | None = None, poll_s: float = 0.05,
               max_output_bytes: int | None = None, uuid: str | None = None,
               reproducible: bool = True, exclude: Sequence[str] = ()) -> None:
    """Pack ``src_dir`` into the EROFS file ``out_path`` (which must not exist).
    ``chunk_bytes``: build chunk-based files (see :func:`layout_for`); it overrides
    ``compression`` (mkfs.erofs 1.5 does not compress chunked files).

    ``max_output_bytes``: mkfs runs under that RLIMIT_FSIZE (util-linux ``prlimit``), so
    the layer cannot grow past it on disk while it is built (``OutputTooLarge``). The
    size of a layer is only known at the end: a sparse file with 4 KiB of distinct data
    every 64 KiB made a 768 MiB chunked layer from 48 MiB of data before the check after
    the build refused it.

    ``reproducible`` (the default): a fixed build time and the UUID ``uuid`` (a fixed
    one when None), see the module doc; False is mkfs.erofs' own random UUID and the
    current time (kept for the ``layer_build`` benchmark's side-by-side figure).

    ``exclude``: paths relative to ``src_dir`` left out (``--exclude-path``, literal: the
    special files :func:`dsec.image.tree.special_skip` skips, so a tree is built in place
    without a copy)."""
    exe = shutil.which(MKFS)
    if exe is None:
        raise ImageError(f"{MKFS} not found on PATH: install the Debian package erofs-utils")
    if compression not in (None, "lz4", "lz4hc"):
        raise InvalidArgument(f"compression={compression!r} is not supported: use lz4, lz4hc "
                              "or none (erofs-utils 1.5)")
    argv = [exe, "--quiet", "--preserve-mtime"]
    if max_output_bytes is not None:
        prlimit = shutil.which("prlimit")
        if prlimit is None:
            raise ImageError("prlimit not found on PATH: install the Debian package "
                             "util-linux (it bounds the layer mkfs.erofs writes)")
        argv = [prlimit, f"--fsize={max(max_output_bytes, 1 << 20)}", "--", *argv]
    excl = [f"--exclude-path={p}" for p in exclude]
    if sum(len(a) + 1 for a in excl) > _MAX_EXCLUDE_ARGV:
        raise ImageError(f"{src_dir} holds {len(excl)} device nodes and sockets to leave "
                         "out, more than mkfs.erofs can be told on one command line; "
                         "remove them from the tree first")
    argv += excl
    if chunk_bytes is not None:
        argv.append(f"--chunksize={chunk_bytes}")
    elif compression:
        argv.append(f"-z{compression}")
    # Never the caller's SOURCE_DATE_EPOCH (build systems export one): mkfs would clamp
    # every newer mtime to it.
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
    if reproducible:
        argv.append(f"-U{uuid or layer_uuid()}")
        env["SOURCE_DATE_EPOCH"] = str(REPRO_EPOCH)
    argv += [out_path, src_dir]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        while True:
            try:
                rc = proc.wait(timeout=poll_s if progress else None)
                break
            except subprocess.TimeoutExpired:
                if progress is not None:
                    try:
                        done = os.stat(out_path).st_size
                    except OSError:
                        done = 0
                    progress("pack", min(done, expected_bytes), expected_bytes)
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()
    if rc != 0 and max_output_bytes is not None and (
            rc == -signal.SIGXFSZ or "File too large" in err):
        raise OutputTooLarge(f"{MKFS} output for {src_dir} reached its limit of "
                             f"{max_output_bytes} bytes", limit=max_output_bytes)
    if rc != 0 and ("No space left on device" in err or "Error 28]" in err
                    or "Disk quota exceeded" in err):
        # The output's filesystem filled (red team 16 F9's class: builds, snapshots and
        # pulls write layers there): a capacity refusal, and without the host paths
        # mkfs.erofs names. The caller removes the partial output.
        raise CapacityExceeded(
            f"{MKFS} could not write the layer: its filesystem is full (no space left "
            "on device); free space in the layer store (dsec image prune) or make a "
            "smaller layer", resource="disk_bytes")
    if rc != 0:
        raise ImageError(f"{MKFS} failed with exit code {rc} packing {src_dir}: {err.strip()}")
    if progress is not None:
        progress("pack", expected_bytes, expected_bytes)


def hash_file(path: str, *, progress: ProgressFn | None = None) -> str:
    """sha256 hex digest of a file, reading it in 1 MiB chunks."""
    h = hashlib.sha256()
    total = os.stat(path).st_size
    done = 0
    last = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            done += len(chunk)
            if progress is not None and time.monotonic() - last > 0.05:
                progress("hash", done, total)
                last = time.monotonic()
    if progress is not None:
        progress("hash", total, total)
    return h.hexdigest()
