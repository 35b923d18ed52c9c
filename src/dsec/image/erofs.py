"""Build EROFS files with ``mkfs.erofs`` (Debian erofs-utils 1.5) and hash them.

erofs-utils 1.5 has no tar input (``--tar`` came in 1.6), so tar streams are unpacked into
a staging directory first (:mod:`dsec.image.archive`). ``--preserve-mtime`` keeps each
file's mtime (otherwise compact inodes carry the build time only), xattrs are copied,
which is how overlay whiteouts' ``trusted.overlay.opaque`` markers reach the layer.
Measured on the dev machine: a 103 MB tree builds in 0.73 s uncompressed, 0.5 s with lz4
(56 MB image); lz4hc is smaller and several times slower to build.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Literal

from dsec.errors import ImageError, InvalidArgument

__all__ = ["MKFS", "Compression", "ProgressFn", "hash_file", "mkfs_erofs"]

Compression = Literal["lz4", "lz4hc"]
ProgressFn = Callable[[str, int, int], None]
"""``progress(phase, done, total)``; phases: ``"pack"`` (bytes written), ``"hash"``."""

MKFS = "mkfs.erofs"
_HASH_CHUNK = 1 << 20


def mkfs_erofs(src_dir: str, out_path: str, *, compression: Compression | None = None,
               expected_bytes: int = 0, progress: ProgressFn | None = None,
               poll_s: float = 0.05) -> None:
    """Pack ``src_dir`` into the EROFS file ``out_path`` (which must not exist)."""
    exe = shutil.which(MKFS)
    if exe is None:
        raise ImageError(f"{MKFS} not found on PATH: install the Debian package erofs-utils")
    if compression not in (None, "lz4", "lz4hc"):
        raise InvalidArgument(f"compression={compression!r} is not supported: use lz4, lz4hc "
                              "or none (erofs-utils 1.5)")
    argv = [exe, "--quiet", "--preserve-mtime"]
    if compression:
        argv.append(f"-z{compression}")
    argv += [out_path, src_dir]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
