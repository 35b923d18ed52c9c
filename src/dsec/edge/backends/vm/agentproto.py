"""The microVM guest agent's protocol: method names and msgpack bodies (docs/vm.md).

The agent (``agent.c``, PID 1 in the guest) is an Aether *acceptor* on the virtio-serial
port named ``dsec.agent``: the host dials QEMU's chardev unix socket and calls the methods
below (odd stream ids); the agent never calls the host. Every frame is an ordinary Aether
frame (dsec.aether.frame: 25-byte header, CRC-32) and every body is msgpack, so the host
side is a plain :class:`dsec.aether.Connection` with ``response_type=`` from this module.

The guest is hostile from the host's point of view: everything decoded from the agent is
bounded (``max_frame``) and validated by msgspec against these structs, and the host side
(vm/backend.py) never trusts a size, a path or a count it reports. The host, in turn, is
trusted by the agent (it owns the guest), but the agent still keeps file paths inside the
sandbox root ``/sb`` exactly (no ``..``, no symlink escape) because a path is the
sandbox user's input.

Bodies that the container backend already defines (ExecRequest, ExecResult, ExecChunk,
FileInfo) are reused from :mod:`dsec.wire.spec`, so the vm backend passes them through.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from dsec.wire.spec import ExecChunk, ExecRequest, ExecResult, FileInfo

__all__ = [
    "AGENT_PORT_NAME",
    "CLOCK_MAX_NS",
    "CLOCK_MIN_NS",
    "DEFAULT_MAX_FRAME",
    "ERROR_CODES",
    "MAX_EXEC_OUTPUT",
    "MAX_READ",
    "METHODS",
    "PROTOCOL_VERSION",
    "SANDBOX_ROOT",
    "STREAMING_METHODS",
    "ClockRequest",
    "ClockResult",
    "DiffChunk",
    "DiffResult",
    "ExecChunk",
    "ExecRequest",
    "ExecResult",
    "FileInfo",
    "GuestStats",
    "Hello",
    "ListRequest",
    "ListResult",
    "MkdirRequest",
    "Ok",
    "PathRequest",
    "QuiesceRequest",
    "QuiesceResult",
    "ReadRequest",
    "ReadResult",
    "RemoveRequest",
    "RenameRequest",
    "SetupRequest",
    "SetupResult",
    "SignalRequest",
    "WriteRequest",
    "WriteResult",
]

#: The virtio-serial port name (``-device virtserialport,name=dsec.agent``); the agent
#: finds ``/dev/vportNpM`` through ``/sys/class/virtio-ports/*/name``.
AGENT_PORT_NAME: Final = "dsec.agent"
#: Bumped on any incompatible change; ``hello`` reports it and the host refuses others.
PROTOCOL_VERSION: Final = 1
#: The frame payload limit both ends use (the agent enforces it on what it receives and
#: never sends more). 4 MiB: a ``read`` reply carries at most MAX_READ bytes plus a header.
DEFAULT_MAX_FRAME: Final = 4 * 1024 * 1024
#: Largest ``read`` length the agent serves per call (the host loops for more).
MAX_READ: Final = 2 * 1024 * 1024
#: Output a unary ``exec`` keeps per stream, whatever ``output_cap_bytes`` asks: stdout
#: and stderr must fit one reply frame. Larger caps: use ``exec_stream`` (chunks of at
#: most 64 KiB, the cap applied to the bytes streamed).
MAX_EXEC_OUTPUT: Final = (DEFAULT_MAX_FRAME - 64 * 1024) // 2
#: Where ``setup`` mounts the sandbox's overlay; exec runs chrooted here and file paths
#: are relative to it.
SANDBOX_ROOT: Final = "/sb"


class Hello(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Reply of ``hello`` (request body: nil). Cheap; the host calls it after every
    (re)connect. ``boot_id`` is random per boot, so a host reconnecting after resume can
    tell it talks to the same guest; ``setup_done`` says whether ``setup`` already ran."""

    version: int
    kernel: str = ""                    # uname -r
    mem_total: int = 0                  # bytes, /proc/meminfo MemTotal
    boot_id: str = ""
    uptime_s: float = 0.0
    setup_done: bool = False
    connections: int = 0                # host (re)connections seen, this one included
    #: what the guest has right now (docs/vm.md, "Devices"): its block devices (names in
    #: /sys/block: "vda", "pmem0"), its virtio devices without a driver as
    #: "virtioN:<virtio device id>" (not probed yet, or the probe failed), and whether
    #: boot's module loader still runs. A warm-pool clone is used only when every device
    #: the host attached is here, nothing is unbound and nothing is loading.
    devices: list[str] = []
    unbound: list[str] = []
    probing: bool = False


class SetupRequest(msgspec.Struct, kw_only=True, omit_defaults=True,
                   forbid_unknown_fields=True):
    """Body of ``setup``: mount the sandbox. Once per boot (a second call: ``conflict``).

    ``layers``: block devices holding the image's EROFS layers, **lowest first** (the base
    layer first, the image's top layer last: the order of an OCI manifest), e.g.
    ``["/dev/vda", "/dev/vdb"]`` or ``["/dev/pmem0"]``. Each is mounted read-only at
    ``/layers/<i>`` (``-o dax=always`` when ``dax``); overlay's lowerdir is their reverse.
    ``scratch``: block device with an ext4 filesystem the host already formatted (the
    guest never runs mkfs); mounted at ``/scratch``, overlay upper ``/scratch/upper`` and
    work ``/scratch/work`` (created if missing, kept if present: a resumed or re-setup
    disk keeps its changes). With no layers the upper dir alone is the root.
    ``env``: default environment of every exec (an exec's own env overrides it).
    ``tunables``: writes done before anything else, path -> value, paths only under
    ``/proc/sys/`` or ``/sys/`` (e.g. DAMON_RECLAIM's ``/sys/module/damon_reclaim/
    parameters/enabled``: "Y"); a failed write fails setup naming the path.
    Inside ``/sb`` the agent mounts proc, sysfs (read-only) and a tmpfs /dev holding
    null, zero, full, random, urandom, tty and a devpts at /dev/pts; /tmp is an ordinary
    directory of the overlay (created 1777 if missing), so its files land in snapshots.
    """

    layers: list[str] = []
    scratch: str = ""
    dax: bool = False
    env: dict[str, str] = {}
    hostname: str = "sandbox"
    tunables: dict[str, str] = {}


class SetupResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    duration_s: float = 0.0
    mounts: list[str] = []              # what was mounted, for diagnostics


class SignalRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``signal``: send ``sig`` to the process group of exec ``pid`` (the pid an
    ``exec`` with background=True returned, or a pid seen in the sandbox). ``group``
    False sends to the process alone. pid <= 1 is refused."""

    pid: int
    sig: int = 15
    group: bool = True


class PathRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``stat`` (reply: FileInfo; the final symlink is not followed)."""

    path: str


class ReadRequest(msgspec.Struct, kw_only=True, omit_defaults=True,
                  forbid_unknown_fields=True):
    """Body of ``read``: at most ``min(length, MAX_READ)`` bytes from ``offset``
    (length < 0: up to MAX_READ)."""

    path: str
    offset: int = 0
    length: int = -1


class ReadResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    data: bytes = b""
    size: int = 0                       # the file's size at the time of the read
    eof: bool = False                   # offset + len(data) reached the end


class WriteRequest(msgspec.Struct, kw_only=True, omit_defaults=True,
                   forbid_unknown_fields=True):
    """Body of ``write``: create or truncate ``path`` (or append to it) with ``data``;
    ``mode`` applies to a newly created file. ``parents`` creates missing directories
    (mode 0755). Large files are written as one truncating call then appends."""

    path: str
    data: bytes = b""
    mode: int = 0o644
    append: bool = False
    parents: bool = True


class WriteResult(msgspec.Struct, kw_only=True):
    size: int                           # the file's size after the write


class ListRequest(msgspec.Struct, kw_only=True, omit_defaults=True,
                  forbid_unknown_fields=True):
    """Body of ``list``: the entries of directory ``path`` (not recursive), at most
    ``limit`` of them (the reply says ``truncated``)."""

    path: str
    limit: int = 10000


class ListResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    entries: list[FileInfo] = []
    truncated: bool = False


class MkdirRequest(msgspec.Struct, kw_only=True, omit_defaults=True,
                   forbid_unknown_fields=True):
    path: str
    mode: int = 0o755
    parents: bool = True


class RemoveRequest(msgspec.Struct, kw_only=True, omit_defaults=True,
                    forbid_unknown_fields=True):
    """Body of ``remove``: a file, a symlink, or a directory (``recursive`` for a
    non-empty one). A missing path is ``not_found``."""

    path: str
    recursive: bool = False


class RenameRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    src: str
    dst: str


class Ok(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Reply of mkdir, remove, rename, signal."""

    ok: bool = True


class QuiesceRequest(msgspec.Struct, kw_only=True, omit_defaults=True,
                     forbid_unknown_fields=True):
    """Body of ``quiesce``, before pause/snapshot: first wait, at most ``settle_s``
    seconds (0..120), until boot's module loader has ended, every virtio device has a
    driver and ``/dev/<name>`` exists for each of ``devices`` (block device names,
    ``[a-z0-9]{1,31}``); then sync(2), and optionally drop the page cache
    (``/proc/sys/vm/drop_caches`` = 3) and compact memory (``/proc/sys/vm/compact_memory``)
    so a saved memory file or a reported-free page count is small.

    The wait exists for the warm pool: a guest saved before its devices were probed
    restores into one whose probe fails (docs/vm.md, "Devices"), so a template is saved
    only from a reply with ``settled`` true."""

    drop_caches: bool = True
    compact: bool = True
    devices: list[str] = []
    settle_s: float = 0.0


class QuiesceResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    duration_s: float = 0.0
    mem_available: int = 0              # bytes, after
    settled: bool = False               # everything waited for was there in time
    devices: list[str] = []             # as in Hello, after the wait
    unbound: list[str] = []
    probing: bool = False


#: The guest clock is only ever set to a time in [2024-01-01, 2100-01-01) UTC.
CLOCK_MIN_NS: Final = 1_704_067_200 * 10**9
CLOCK_MAX_NS: Final = 4_102_444_800 * 10**9


class ClockRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``clock``: set the guest's wall clock (CLOCK_REALTIME, clock_settime(2)) to
    ``unix_ns``, the host's time in nanoseconds since 1970 UTC. The host calls it after
    every restore (resume, warm-pool clone): under TCG the guest clock runs on QEMU's
    virtual clock, which the memory file carries, so a restored guest is behind by the
    time it spent saved. A time outside [CLOCK_MIN_NS, CLOCK_MAX_NS] is refused
    (``invalid_argument``) and changes nothing. Needs no ``setup`` and no program in the
    image."""

    unix_ns: int


class ClockResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    set: bool = False                   # False only for an agent in test mode (--fd)
    step_s: float = 0.0                 # new time minus the guest's time before the call


class DiffChunk(msgspec.Struct, kw_only=True):
    """One STREAM item of ``diff``: the next bytes of the tar archive."""

    data: bytes


class DiffResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Final RESPONSE of ``diff`` (request body: nil).

    The STREAM items concatenated are one POSIX ustar archive (tar(5), "ustar\\0" "00"
    magic, 512-byte blocks, ended by two zero blocks) of the overlay upper directory,
    member names relative to it without a leading "./" or "/". Types: regular files (0),
    directories (5), symlinks (2). Hard links are sent as independent regular files.
    Overlay whiteouts (a char device 0:0 in the upper dir) are sent as they are: a
    character-device member (type 3) with devmajor 0, devminor 0, exactly what
    pack_diff expects. Opaque directories (xattr trusted.overlay.opaque = "y") are a
    directory member preceded by a pax extended header (type x) with the record
    ``SCHILY.xattr.trusted.overlay.opaque=y``. Other xattrs, devices, fifos and sockets
    are skipped and counted in ``skipped``. Names of 100 bytes or more get a pax
    ``path`` record (ustar's prefix field is not used), symlink targets of 100 or more a
    ``linkpath`` one, files of 8 GiB or more a ``size`` one. uid/gid/mode/mtime are the
    upper dir's values. docs/vm.md has the table."""

    bytes: int = 0
    entries: int = 0
    skipped: int = 0


class GuestStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Reply of ``stats`` (request body: nil); bytes unless named otherwise."""

    mem_total: int = 0
    mem_available: int = 0
    cpu_ns: int = 0                     # busy CPU time of the whole guest (not idle/iowait)
    pids: int = 0                       # processes in the guest, the agent excluded
    disk_used: int = 0                  # of the scratch filesystem (statfs)
    disk_total: int = 0
    oom_kills: int = 0                  # /proc/vmstat oom_kill


#: method -> (request body type or None for nil, reply type). Order: docs/vm.md's table.
METHODS: Final[dict[str, tuple[type | None, type]]] = {
    "hello": (None, Hello),
    "setup": (SetupRequest, SetupResult),
    "exec": (ExecRequest, ExecResult),
    "exec_stream": (ExecRequest, ExecResult),       # STREAM ExecChunk, then ExecResult
    "signal": (SignalRequest, Ok),
    "read": (ReadRequest, ReadResult),
    "write": (WriteRequest, WriteResult),
    "list": (ListRequest, ListResult),
    "stat": (PathRequest, FileInfo),
    "mkdir": (MkdirRequest, Ok),
    "remove": (RemoveRequest, Ok),
    "rename": (RenameRequest, Ok),
    "quiesce": (QuiesceRequest, QuiesceResult),
    "diff": (None, DiffResult),                     # STREAM DiffChunk, then DiffResult
    "stats": (None, GuestStats),
    "clock": (ClockRequest, ClockResult),
}

#: Methods called with ``Connection.stream`` (REQUEST with the STREAMING flag), and the
#: type of their STREAM items.
STREAMING_METHODS: Final[dict[str, type]] = {
    "exec_stream": ExecChunk,
    "diff": DiffChunk,
}

ErrorCode = Literal["invalid_argument", "not_found", "conflict", "permission_denied",
                    "payload_too_large", "resource_exhausted", "unknown_method",
                    "cannot_run", "remote_protocol_error", "backend_error",
                    "internal_error"]
#: The ``code`` values the agent puts in ERROR bodies (dsec.errors classes): errno
#: ENOENT/ENOTDIR -> not_found, EEXIST/ENOTEMPTY/EBUSY -> conflict, EACCES/EPERM/EROFS ->
#: permission_denied, ENOSPC/EDQUOT/ENOMEM/EMFILE -> resource_exhausted, a bad path or
#: body -> invalid_argument, a command that could not start -> cannot_run (detail
#: exit_code 127 or 126), a REQUEST too short for its method name ->
#: remote_protocol_error, anything else -> backend_error. The host maps them onto its
#: own errors and never lets the guest choose a class freely (vm/link.py).
ERROR_CODES: Final[frozenset[str]] = frozenset(ErrorCode.__args__)  # type: ignore[attr-defined]
