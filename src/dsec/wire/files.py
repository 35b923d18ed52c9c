"""Wire types of streamed file transfer, rename and watch (issue 19, "Files").

``read_file``/``write_file`` carry a whole file in one frame (at most Aether's 16 MiB
frame, and ``MAX_FILE_READ_BYTES``). The stream rows carry any size in pieces:

- ``file_read_stream`` (:class:`ReadStream` -> :class:`~dsec.wire.spec.FileInfo`) and
  ``file_write_stream`` (:class:`WriteStream` -> ``FileInfo``) are **duplex** rows
  (Aether DUPLEX, docs/aether.md "Duplex streams"): the file's raw bytes ride STREAM
  frames under per-stream credit, so on every hop (SDK, gateway, edge) at most one window
  (256 KiB) per stream is held, whatever the file's size and however slow the reader.
  (Server-push streams, ``StreamOp``, are credited per stream too since redteam-19, with
  a 4 MiB window, one way only.)
- A write lands in a temporary file next to its target, renamed over it only once the
  writer half-closed and every byte (``size``, when given) arrived: no half-written file
  is ever visible, and a dropped connection leaves nothing behind.
- ``file_rename`` (:class:`Rename` -> ``FileInfo`` of the destination).
- ``file_watch`` (:class:`Watch` -> :class:`FileEvent` items, then :class:`WatchEnd`):
  inotify on the sandbox's own files below ``path``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from dsec.errors import InvalidArgument
from dsec.wire.calls import _Call
from dsec.wire.spec import check_file_user, check_id, check_mode, check_path

__all__ = [
    "FILE_EVENT_TYPES",
    "MAX_WATCHES_PER_SANDBOX",
    "MAX_WATCH_S",
    "MAX_WRITE_STREAM_BYTES",
    "FileEvent",
    "FileEventType",
    "ReadStream",
    "Rename",
    "Watch",
    "WatchEnd",
    "WriteStream",
]

# A declared upload size: a wire sanity bound (1 TiB); the sandbox's disk cap is the
# real one, checked by the edge before anything is written.
MAX_WRITE_STREAM_BYTES = 1 << 40
# Watches open at once on one sandbox (each holds kernel inotify watches, a task and an
# event queue of the edge); the edge refuses one more with ResourceExhausted.
MAX_WATCHES_PER_SANDBOX = 8

# A watch's own deadline, when it asks for one (a day).
MAX_WATCH_S = 86_400.0

FileEventType = Literal["create", "write", "remove", "rename", "chmod", "overflow",
                        "incomplete"]
FILE_EVENT_TYPES: tuple[str, ...] = ("create", "write", "remove", "rename", "chmod",
                                     "overflow", "incomplete")


class ReadStream(_Call, kw_only=True):
    """``file_read_stream``: the bytes of ``path`` from ``offset`` (``length`` bytes, None:
    to the end, any size). The reply is the file's :class:`FileInfo` as it was opened."""

    id: str
    path: str
    offset: int = 0
    length: int | None = None
    # the sandbox user the call runs as (its rights, checked by the kernel); None: root
    user: str | None = None

    def __post_init__(self) -> None:
        check_file_user(self.user)
        check_id(self.id)
        check_path(self.path)
        if self.offset < 0 or (self.length is not None and self.length < 0):
            raise InvalidArgument(
                f"file_read_stream offset={self.offset} length={self.length} must be >= 0",
                field="offset" if self.offset < 0 else "length")


class WriteStream(_Call, kw_only=True):
    """``file_write_stream``: replace ``path`` atomically with the bytes that follow the
    request (the caller half-closes after the last). ``size``, when given, is checked
    against the sandbox's disk room before anything is written, and the write fails
    (leaving the old file) unless exactly that many bytes arrive."""

    id: str
    path: str
    mode: int = 0o644
    size: int | None = None
    # the sandbox user the call runs as (its rights, checked by the kernel); None: root
    user: str | None = None

    def __post_init__(self) -> None:
        check_file_user(self.user)
        check_id(self.id)
        check_path(self.path)
        check_mode(self.mode)
        if self.size is not None and not 0 <= self.size <= MAX_WRITE_STREAM_BYTES:
            raise InvalidArgument(
                f"file_write_stream size={self.size} must be within 0..{MAX_WRITE_STREAM_BYTES}",
                field="size", limit=MAX_WRITE_STREAM_BYTES)


class Rename(_Call, kw_only=True):
    """``file_rename``: move ``src`` to ``dst`` inside the sandbox (``overwrite``: replace
    an existing ``dst``, else it is refused)."""

    id: str
    src: str
    dst: str
    overwrite: bool = False
    # the sandbox user the call runs as (its rights, checked by the kernel); None: root
    user: str | None = None

    def __post_init__(self) -> None:
        check_file_user(self.user)
        check_id(self.id)
        check_path(self.src, field="src")
        check_path(self.dst, field="dst")


class Watch(_Call, kw_only=True):
    """``file_watch``: events below directory ``path`` (``recursive``: its subdirectories
    too, including those created later)."""

    id: str
    path: str
    recursive: bool = False
    timeout_s: float | None = None      # end the watch after this long (None: never)

    def __post_init__(self) -> None:
        check_id(self.id)
        check_path(self.path)
        if self.timeout_s is not None and not 0 < self.timeout_s <= MAX_WATCH_S:
            raise InvalidArgument(f"file_watch timeout_s={self.timeout_s!r} must be within "
                                  f"(0, {MAX_WATCH_S:g}] seconds (or null: no timeout)",
                                  field="timeout_s", limit=MAX_WATCH_S)


class FileEvent(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One change below a watched directory: ``path`` is the sandbox path of the entry,
    ``name`` its last component. ``overflow``: the kernel dropped events (the watcher
    read too slowly); list the directory again. ``incomplete``: the watch no longer
    follows directory ``path`` (nor what is below it): its project holds more than its
    share of the node's watched directories while another project needs room (red team
    22, C1); the rest of the watch goes on. Watch a smaller tree, or close other watches
    of the project and watch again."""

    type: FileEventType
    path: str
    name: str = ""


class WatchEnd(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The end of a watch: the watched directory went away (``removed``) or the watch's
    ``timeout_s`` passed (``timeout``). (A sandbox that ends ends its watches with an
    error, StreamReset; a caller leaving ends it with nothing to say.)"""

    reason: str = ""
