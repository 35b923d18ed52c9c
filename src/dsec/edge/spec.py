"""Records that describe a sandbox and the operations on it.

These are msgspec structs so the same type travels over Aether (msgpack), over REST
(JSON) and is persisted in the edge state dir, without a second schema to keep in sync.
Units are in the field names; ``None`` means "none/unlimited", never 0 or -1.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from dsec.errors import InvalidArgument

__all__ = [
    "MAX_CPU_MILLI",
    "MAX_MEMORY_BYTES",
    "BackendName",
    "ExecChunk",
    "ExecRequest",
    "ExecResult",
    "FileInfo",
    "FileType",
    "IdleAction",
    "NetworkPolicy",
    "PauseStats",
    "SandboxEvent",
    "SandboxInfo",
    "SandboxSpec",
    "SandboxState",
    "SandboxStats",
    "SnapshotInfo",
]

SandboxState = Literal[
    "creating", "running", "pausing", "paused", "resuming", "destroying", "destroyed", "failed"
]
BackendName = Literal["simulated", "fncall", "container", "runc", "vm"]
IdleAction = Literal["destroy", "pause"]

# Sanity ceilings: a spec above these is a typo (e.g. bytes given as KiB), not a request.
MAX_CPU_MILLI = 1024 * 1000          # 1024 cores
MAX_MEMORY_BYTES = 16 * 2**40         # 16 TiB
MAX_DISK_BYTES = 1024 * 2**40         # 1 PiB
MAX_TTL_S = 30 * 24 * 3600.0          # 30 days


class NetworkPolicy(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Egress policy. Default: loopback only. ``allow`` lists ``host:port`` entries."""

    mode: Literal["none", "loopback", "allowlist"] = "loopback"
    allow: tuple[str, ...] = ()


class SandboxSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a caller asks for. Validated by :meth:`validate` at every trust boundary."""

    image: str = "base"                     # image ref: name[:tag] or sha256:<digest>
    workspace: str | None = None            # optional workspace layer ref
    toolkits: tuple[str, ...] = ()          # toolkit layer refs, later ones win
    snapshot: str | None = None             # start from a pack_diff snapshot instead
    backend: BackendName = "simulated"
    cpu_milli: int = 1000                   # millicores (1000 = one core)
    memory_bytes: int = 512 * 2**20
    disk_bytes: int | None = None           # upper-layer size cap; None = the node's default
    pids_max: int | None = 1024             # fork-bomb guard; None = no cap
    priority: int = 0                       # higher wins preemption
    labels: dict[str, str] = {}
    project: str = "default"
    ttl_s: float | None = None              # lifetime from creation; None = forever
    idle_timeout_s: float | None = None     # no operation for this long -> idle_action
    idle_action: IdleAction = "destroy"
    env: dict[str, str] = {}
    network: NetworkPolicy = NetworkPolicy()
    allow_nested: bool = False              # permit unshare/clone namespace flags inside
    user_namespace: bool = False            # root inside = unprivileged uid on the host

    def validate(self) -> SandboxSpec:
        """Raise :class:`InvalidArgument` naming the field and the fix; return self."""
        def bad(field: str, value: object, why: str) -> InvalidArgument:
            return InvalidArgument(f"sandbox spec field {field}={value!r} is invalid: {why}",
                                   field=field)
        if not (1 <= self.cpu_milli <= MAX_CPU_MILLI):
            raise bad("cpu_milli", self.cpu_milli, f"use 1..{MAX_CPU_MILLI} millicores")
        if not (1 << 20 <= self.memory_bytes <= MAX_MEMORY_BYTES):
            raise bad("memory_bytes", self.memory_bytes, "use 1 MiB..16 TiB (bytes)")
        if self.disk_bytes is not None and not (1 << 20 <= self.disk_bytes <= MAX_DISK_BYTES):
            raise bad("disk_bytes", self.disk_bytes, "use 1 MiB..1 PiB (bytes) or null")
        if self.pids_max is not None and not (1 <= self.pids_max <= 4_194_304):
            raise bad("pids_max", self.pids_max, "use 1..4194304 or null")
        for name in ("ttl_s", "idle_timeout_s"):
            v = getattr(self, name)
            if v is not None and not (0 < v <= MAX_TTL_S):
                raise bad(name, v, "use a positive number of seconds up to 30 days, or null")
        if not self.image:
            raise bad("image", self.image, "name an image")
        if not isinstance(self.user_namespace, bool):
            raise bad("user_namespace", self.user_namespace, "use true or false")
        for k in self.env:
            if not k or "=" in k or "\0" in k:
                raise bad("env", k, "environment names must be non-empty without '=' or NUL")
        return self


class ExecRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One command. Exactly one of ``argv`` / ``shell``."""

    argv: tuple[str, ...] = ()
    shell: str | None = None
    env: dict[str, str] = {}
    cwd: str | None = None
    user: str | None = None
    stdin: bytes = b""
    timeout_s: float | None = 60.0          # command timeout; kills the process group
    output_cap_bytes: int = 1 << 20         # per stream; beyond it output is dropped
    background: bool = False                # start and return at once (pid in result)

    def validate(self) -> ExecRequest:
        if bool(self.argv) == (self.shell is not None):
            raise InvalidArgument("exec needs exactly one of argv (a list) or shell (a string)")
        if self.timeout_s is not None and not (self.timeout_s > 0):
            raise InvalidArgument(
                f"exec timeout_s={self.timeout_s!r} must be a positive number of seconds "
                "(or null for no command timeout)", field="timeout_s")
        if not (0 <= self.output_cap_bytes <= 1 << 30):
            raise InvalidArgument(
                f"exec output_cap_bytes={self.output_cap_bytes} must be within 0..1 GiB",
                field="output_cap_bytes")
        return self


class ExecResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a finished command did. ``timed_out`` means the command timeout fired."""

    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0
    pid: int | None = None                  # set for background execs


class SandboxEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One lifecycle transition: never does a sandbox change state without one."""

    time: float
    sandbox_id: str
    from_state: SandboxState | None
    to_state: SandboxState
    reason: str
    detail: str = ""


class SandboxInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The edge's view of one sandbox, as returned by get/list/create."""

    id: str
    node: str
    state: SandboxState
    spec: SandboxSpec
    created_at: float
    last_active_at: float
    reason: str = ""                        # reason of the last transition


class ExecChunk(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of a streaming exec's output (Aether STREAM frame body)."""

    stream: Literal["stdout", "stderr"]
    data: bytes


FileType = Literal["file", "dir", "symlink", "other"]


class FileInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str
    path: str
    type: FileType
    size: int = 0
    mode: int = 0                           # permission bits (st_mode & 0o7777)
    mtime: float = 0.0
    link_target: str | None = None


class PauseStats(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a pause gave back: ``reclaimed_bytes`` of ``resident_before_bytes``."""

    resident_before_bytes: int = 0
    reclaimed_bytes: int = 0
    duration_s: float = 0.0


class SandboxStats(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Resource use now. ``disk_bytes`` of ``disk_cap_bytes`` (None: the backend has no
    per-sandbox disk cap); ``disk_full`` says writes are failing for lack of space (the
    cap, or the node's disk pool) - free space inside or recreate with more disk."""

    memory_bytes: int = 0
    memory_peak_bytes: int = 0
    #: of memory_bytes, what tmpfs files hold (/tmp, /dev/shm): no OOM kill frees it, so
    #: near the limit every new process is OOM-killed (notice "tmpfs_full")
    memory_tmpfs_bytes: int = 0
    cpu_seconds: float = 0.0
    pids: int = 0
    disk_bytes: int = 0
    disk_cap_bytes: int | None = None
    disk_full: bool = False


class SnapshotInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A pack_diff snapshot of a sandbox (edge ``snapshot`` capability).

    ``id`` is its layer ref (``sha256:<hex>``); ``parent`` the snapshot it builds on
    (the sandbox's previous snapshot, or the snapshot the sandbox was started from;
    ``None`` when it sits directly on the image). ``unchanged`` says nothing changed since
    ``parent``-or-previous, so this *is* that earlier snapshot and nothing was written.
    ``size_bytes`` is the stored size of this one layer (not of the chain).
    """

    id: str
    parent: str | None = None
    sandbox_id: str = ""
    project: str = "default"
    image: str = ""                         # the image refs the chain applies to
    workspace: str | None = None
    toolkits: tuple[str, ...] = ()
    backend: str = ""
    node: str = ""                          # the node that answered (set by the edge)
    created: float = 0.0                    # unix seconds
    size_bytes: int = 0
    unchanged: bool = False
